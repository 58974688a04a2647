"""Episode data loading for TorchRL env workers.

* :class:`EpisodeLoader` - endless, reseedable episode stream backed by one persistent
  DataLoader, started lazily inside the env worker (thread fallback in daemonic processes).
* :class:`EpisodeSampler` - the endless per-epoch permutation sampler it uses.
* :class:`EpisodeLedger` - one ledger for every env worker: each episode once per epoch across
  all of them, a bounded number of reader processes, lost episodes replayed, bad ones
  quarantined.
* :class:`ClusterEpisodeLedger` - the same ledger for a Ray cluster: one bookkeeping actor, one
  agent per node serving that node's env workers, a lost node's episodes replayed.
* :class:`ThreadPrefetcher` - background-thread prefetching for code that must stay in one process.
* :func:`memmap_episodes` / :class:`MemmapEpisodeDataset` - one-time conversion of raw episode
  files into memory-mapped TensorDicts, and a dataset over them.

Importing this package starts no process and no thread (an :class:`EpisodeLedger` starts its
readers and threads when it is built).
"""

from ._cluster import ClusterEpisodeLedger
from ._episode_loader import EpisodeLoader
from ._ledger import EpisodeLedger, EpochsExhausted, LedgerClient, LedgerClosedError, NoEpisodesError
from ._memmap import MemmapEpisodeDataset, episode_dir_name, memmap_episodes
from ._prefetch import ThreadPrefetcher
from ._sampler import EpisodeSampler

__all__ = [
    "ClusterEpisodeLedger",
    "EpisodeLedger",
    "EpisodeLoader",
    "EpisodeSampler",
    "EpochsExhausted",
    "LedgerClient",
    "LedgerClosedError",
    "MemmapEpisodeDataset",
    "NoEpisodesError",
    "ThreadPrefetcher",
    "episode_dir_name",
    "memmap_episodes",
]
