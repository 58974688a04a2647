"""Episode data loading for TorchRL env workers.

* :class:`EpisodeLoader` - endless, reseedable episode stream backed by one persistent
  DataLoader, started lazily inside the env worker (thread fallback in daemonic processes).
* :class:`EpisodeSampler` - the endless per-epoch permutation sampler it uses.
* :class:`ThreadPrefetcher` - background-thread prefetching for code that must stay in one process.
* :func:`memmap_episodes` / :class:`MemmapEpisodeDataset` - one-time conversion of raw episode
  files into memory-mapped TensorDicts, and a dataset over them.

Importing this package starts no process and no thread.
"""

from ._episode_loader import EpisodeLoader
from ._memmap import MemmapEpisodeDataset, episode_dir_name, memmap_episodes
from ._prefetch import ThreadPrefetcher
from ._sampler import EpisodeSampler

__all__ = [
    "EpisodeLoader",
    "EpisodeSampler",
    "MemmapEpisodeDataset",
    "ThreadPrefetcher",
    "episode_dir_name",
    "memmap_episodes",
]
