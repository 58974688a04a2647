"""Log-replay building blocks shared by ``examples/heavy_reset.py`` and the benchmarks.

Everything here is importable by reference (module-level classes and functions only), so it
works with every multiprocessing start method, ``spawn`` included.

* :func:`generate_logs` writes N synthetic episode "log" files. A file is a small header plus
  zlib-compressed int16 sample deltas, so parsing one costs real CPU, like parsing a real
  log: decompress, decode to float, integrate the deltas (a cumulative sum) and normalise
  every channel.
* :class:`StorageProfile` says how files are read: ``local`` reads at page-cache speed;
  ``remote`` is SIMULATED network storage, where a read sleeps for a per-file latency plus
  ``bytes / bandwidth`` (each concurrent reader gets the stated bandwidth).
* :class:`LogDataset` is a map-style dataset whose item is one parsed episode, ``[T, D]``.
* :class:`LogReplayEnv` replays one episode per reset; where the next episode comes from is
  pluggable (see :data:`SOURCES`).
"""

from __future__ import annotations

import functools
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

from torchrl_ext.data import (
    EpisodeLoader,
    EpisodeSampler,
    MemmapEpisodeDataset,
    ThreadPrefetcher,
    episode_dir_name,
    memmap_episodes,
)

__all__ = [
    "PROFILES",
    "SOURCES",
    "EpisodeSource",
    "LogDataset",
    "LogReplayEnv",
    "StorageProfile",
    "convert_to_memmap",
    "generate_logs",
    "make_source",
    "parse_log",
    "read_header",
    "read_log",
]

MAGIC = b"TRXLOG01"
_HEADER = struct.Struct("<8sIIIf")  # magic, rows T, channels D, episode id, scale
_READ_CHUNK = 256 * 1024
_DELTA_STD = 24.0  # spread of the int16 deltas; sets how well the files compress (about 2x)

#: Where ``LogReplayEnv.reset()`` gets the next episode from.
SOURCES = ("inline", "dataloader_per_reset", "episode_loader", "thread", "memmap", "oracle", "ledger")


# ---------------------------------------------------------------------------------- storage
@dataclass(frozen=True)
class StorageProfile:
    """How episode files are read.

    ``bandwidth_mb_s=None`` reads at full speed (page cache). Otherwise every read sleeps
    ``latency_s`` once per file and ``bytes / (bandwidth_mb_s * 1e6)`` seconds as it reads:
    a SIMULATED network store in which each concurrent reader gets the stated bandwidth.
    """

    name: str
    bandwidth_mb_s: float | None = None
    latency_s: float = 0.0

    def describe(self) -> str:
        if self.bandwidth_mb_s is None:
            return f"{self.name}: page cache, no throttle"
        return (
            f"{self.name} (simulated): {self.bandwidth_mb_s:g} MB/s per reader, "
            f"{self.latency_s * 1e3:g} ms latency per file"
        )


PROFILES: dict[str, StorageProfile] = {
    "local": StorageProfile("local"),
    "remote": StorageProfile("remote", bandwidth_mb_s=25.0, latency_s=0.05),
}


def _profile(profile: str | StorageProfile) -> StorageProfile:
    return PROFILES[profile] if isinstance(profile, str) else profile


def read_log(path: str | os.PathLike[str], profile: str | StorageProfile = "local") -> bytes:
    """Read a whole file through ``profile`` (sleeping where the profile is throttled)."""
    prof = _profile(profile)
    if prof.latency_s > 0:
        time.sleep(prof.latency_s)
    chunks = []
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            chunks.append(chunk)
            if prof.bandwidth_mb_s is not None:
                time.sleep(len(chunk) / (prof.bandwidth_mb_s * 1e6))
    return b"".join(chunks)


def read_header(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """``(rows, channels, episode_id)`` of a log file (a small, unthrottled metadata read)."""
    with open(path, "rb") as fh:
        magic, rows, channels, episode_id, _ = _HEADER.unpack(fh.read(_HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"{path}: not a log file")
    return rows, channels, episode_id


def parse_log(data: bytes) -> torch.Tensor:
    """Decode one log file's bytes into a float32 episode ``[T, D]``.

    Decompress, decode int16 deltas to float, integrate them over time (cumulative sum) and
    normalise each channel to zero mean and unit variance.
    """
    magic, rows, channels, _, scale = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a log file")
    raw = bytearray(zlib.decompress(memoryview(data)[_HEADER.size :]))
    deltas = torch.frombuffer(raw, dtype=torch.int16).view(rows, channels)
    signal = torch.cumsum(deltas.to(torch.float32).mul_(scale), dim=0)
    std, mean = torch.std_mean(signal, dim=0)
    return signal.sub_(mean).div_(std.add_(1e-6))


def _estimate_ratio(rng: np.random.Generator, channels: int) -> float:
    sample = np.round(rng.normal(0.0, _DELTA_STD, size=(64, channels))).astype(np.int16)
    raw = sample.tobytes()
    return len(raw) / len(zlib.compress(raw, 1))


def generate_logs(
    out_dir: str | os.PathLike[str],
    num_files: int = 8,
    episode_len: int = 400,
    file_mb: float = 3.0,
    seed: int = 0,
    length_jitter: float = 0.0,
) -> list[Path]:
    """Write ``num_files`` log files of about ``file_mb`` MB each; return their paths.

    A file holds one row per step plus one for the reset. Episode lengths are drawn uniformly
    from ``episode_len * (1 +/- length_jitter)`` (real logs differ in length); the number of
    channels ``D`` is chosen so that a file of the mean length is about ``file_mb`` MB.
    """
    if not 0.0 <= length_jitter < 1.0:
        raise ValueError(f"length_jitter must be in [0, 1), got {length_jitter}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ratio = _estimate_ratio(rng, 1024)
    channels = max(8, round(file_mb * 1e6 * ratio / (2 * (episode_len + 1))))
    paths = []
    for i in range(num_files):
        scale = 1.0 + length_jitter * float(rng.uniform(-1.0, 1.0))
        rows = max(2, round(episode_len * scale)) + 1
        deltas = np.round(rng.normal(0.0, _DELTA_STD, size=(rows, channels))).astype(np.int16)
        body = zlib.compress(deltas.tobytes(), 1)
        path = out / f"episode_{i:04d}.log"
        with open(path, "wb") as fh:
            fh.write(_HEADER.pack(MAGIC, rows, channels, i, 0.01))
            fh.write(body)
        paths.append(path)
    return paths


class LogDataset(Dataset[torch.Tensor]):
    """Map-style dataset: item ``i`` is ``parse_log(read_log(paths[i], profile))``, ``[T, D]``."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], profile: str | StorageProfile = "local"):
        self.paths = [str(p) for p in paths]
        self.profile = _profile(profile)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return parse_log(read_log(self.paths[index], self.profile))

    def episode_path(self, index: int) -> str:
        """The file of episode ``index`` (an ``EpisodeLedger`` names it when it quarantines)."""
        return self.paths[index]

    def __repr__(self) -> str:
        """How an ``EpisodeLedger``'s errors name it: its files' folders."""
        folders = sorted({os.path.dirname(p) or "." for p in self.paths})
        where = f" in {', '.join(folders[:2])}{', ...' if len(folders) > 2 else ''}" if folders else ""
        return f"LogDataset({len(self.paths)} file(s){where}, profile={self.profile.name!r})"


def _parse_to_dict(path: str, profile: StorageProfile) -> dict[str, torch.Tensor]:
    return {"obs": parse_log(read_log(path, profile))}


def convert_to_memmap(
    paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    profile: str | StorageProfile = "local",
) -> MemmapEpisodeDataset:
    """One-time conversion (read through ``profile``, parse) into memory-mapped episodes."""
    parse = functools.partial(_parse_to_dict, profile=_profile(profile))
    return memmap_episodes([str(p) for p in paths], parse, out_dir)


# ---------------------------------------------------------------------------------- sources
class EpisodeSource(Protocol):
    """Where ``LogReplayEnv`` gets its next episode."""

    def next_episode(self) -> torch.Tensor: ...

    def set_seed(self, seed: int) -> None: ...

    def close(self) -> None: ...


class _IndexedSource:
    """Loads ``dataset[i]`` for ``i`` from an :class:`EpisodeSampler` stream."""

    def __init__(self, dataset: Dataset[Any], num_episodes: int, seed: int, shuffle: bool) -> None:
        self.dataset = dataset
        self.sampler = EpisodeSampler(num_episodes, shuffle=shuffle, seed=seed)
        self._order: Iterator[int] = iter(self.sampler)

    def _load(self, index: int) -> torch.Tensor:
        return self.dataset[index]

    def next_episode(self) -> torch.Tensor:
        return self._load(next(self._order))

    def set_seed(self, seed: int) -> None:
        self.sampler.set_seed(seed)
        self._order = iter(self.sampler)

    def close(self) -> None:
        pass


class InlineSource(_IndexedSource):
    """Read and parse the file inside ``reset()``: no helper process or thread (baseline)."""


class DataLoaderPerResetSource(_IndexedSource):
    """A new ``DataLoader(num_workers=k)`` for every reset (the pattern this library enables)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        num_episodes: int,
        seed: int,
        shuffle: bool,
        num_workers: int,
        mp_context: str | None,
    ) -> None:
        super().__init__(dataset, num_episodes, seed, shuffle)
        self.num_workers = num_workers
        self.mp_context = mp_context

    def _load(self, index: int) -> torch.Tensor:
        loader = DataLoader(
            self.dataset,
            batch_size=None,
            sampler=[index],
            num_workers=self.num_workers,
            multiprocessing_context=self.mp_context if self.num_workers > 0 else None,
        )
        iterator = iter(loader)
        try:
            episode: torch.Tensor = next(iterator)
        finally:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        return episode


class MemmapSource(_IndexedSource):
    """Memory-mapped, pre-parsed episodes: a reset reads metadata only."""

    def _load(self, index: int) -> torch.Tensor:
        return self.dataset[index]["obs"]


class OracleSource(_IndexedSource):
    """Every episode parsed up front and held in memory: a zero-cost reset (upper bound)."""

    def __init__(self, dataset: Dataset[Any], num_episodes: int, seed: int, shuffle: bool) -> None:
        super().__init__(dataset, num_episodes, seed, shuffle)
        self.episodes = [dataset[i] for i in range(num_episodes)]

    def _load(self, index: int) -> torch.Tensor:
        return self.episodes[index]


class EpisodeLoaderSource:
    """``torchrl_ext.data.EpisodeLoader``: one persistent DataLoader, episodes loaded ahead."""

    def __init__(
        self,
        dataset: Dataset[Any],
        seed: int,
        shuffle: bool,
        num_workers: int,
        prefetch: int,
        mp_context: str | None,
    ) -> None:
        self.loader: EpisodeLoader[torch.Tensor] = EpisodeLoader(
            dataset,
            num_workers=num_workers,
            prefetch=prefetch,
            shuffle=shuffle,
            seed=seed,
            multiprocessing_context=mp_context,
        )

    def next_episode(self) -> torch.Tensor:
        return next(self.loader)

    def set_seed(self, seed: int) -> None:
        self.loader.set_seed(seed)

    def close(self) -> None:
        self.loader.close()


class LedgerSource:
    """A handle on a ``torchrl_ext.data.EpisodeLedger`` built in the main process: every env
    worker takes the next episode of one shared order (its own seed is ignored)."""

    def __init__(self, episodes: Any) -> None:
        self.episodes = episodes
        self.epoch = -1

    def next_episode(self) -> torch.Tensor:
        _index, episode = self.episodes.next()
        self.epoch = self.episodes.epoch
        return episode  # type: ignore[no-any-return]

    def set_seed(self, seed: int) -> None:
        pass

    def close(self) -> None:
        self.episodes.close()


class ThreadSource:
    """``torchrl_ext.data.ThreadPrefetcher``: a background thread in the env process."""

    def __init__(self, dataset: Dataset[Any], num_episodes: int, seed: int, shuffle: bool, prefetch: int):
        self.dataset = dataset
        self.prefetch = prefetch
        self.sampler = EpisodeSampler(num_episodes, shuffle=shuffle, seed=seed)
        self.prefetcher = self._start()

    def _start(self) -> ThreadPrefetcher[torch.Tensor]:
        return ThreadPrefetcher(self.dataset, keys=self.sampler, prefetch=self.prefetch)

    def next_episode(self) -> torch.Tensor:
        return next(self.prefetcher)

    def set_seed(self, seed: int) -> None:
        self.prefetcher.close()
        self.sampler.set_seed(seed)
        self.prefetcher = self._start()

    def close(self) -> None:
        self.prefetcher.close()


def make_source(
    kind: str,
    paths: Sequence[str | os.PathLike[str]],
    profile: str | StorageProfile = "local",
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 2,
    prefetch: int = 2,
    mp_context: str | None = "fork",
    memmap_dir: str | os.PathLike[str] | None = None,
    episodes: Any = None,
) -> EpisodeSource:
    """Build the episode source ``kind`` (one of :data:`SOURCES`) over ``paths``.

    Every source delivers the same episode order for the same ``seed`` (an
    :class:`~torchrl_ext.data.EpisodeSampler` stream). ``memmap`` needs ``memmap_dir`` holding
    the output of :func:`convert_to_memmap` for ``paths``; ``ledger`` needs ``episodes``, an
    ``EpisodeLedger`` built over ``LogDataset(paths, profile)`` in the main process.
    """
    dataset = LogDataset(paths, profile)
    n = len(dataset)
    if kind == "inline":
        return InlineSource(dataset, n, seed, shuffle)
    if kind == "dataloader_per_reset":
        return DataLoaderPerResetSource(dataset, n, seed, shuffle, num_workers, mp_context)
    if kind == "episode_loader":
        return EpisodeLoaderSource(dataset, seed, shuffle, num_workers, prefetch, mp_context)
    if kind == "thread":
        return ThreadSource(dataset, n, seed, shuffle, prefetch)
    if kind == "memmap":
        if memmap_dir is None:
            raise ValueError("source 'memmap' needs memmap_dir (see convert_to_memmap)")
        dirs = [Path(memmap_dir) / episode_dir_name(str(p)) for p in paths]
        return MemmapSource(MemmapEpisodeDataset(dirs), n, seed, shuffle)
    if kind == "oracle":
        return OracleSource(dataset, n, seed, shuffle)
    if kind == "ledger":
        if episodes is None:
            raise ValueError("source 'ledger' needs episodes=EpisodeLedger(LogDataset(paths, profile))")
        return LedgerSource(episodes)
    raise ValueError(f"unknown source {kind!r}; expected one of {SOURCES}")


# ---------------------------------------------------------------------------------- the env
class LogReplayEnv(EnvBase):
    """Replays one logged episode per reset, with some compute per step.

    ``reset()`` takes the next episode from the source ``source`` (see :func:`make_source`;
    the source is built lazily on the first reset, so the copy TorchRL builds in the main
    process to read specs starts nothing). The observation at step ``t`` is ``episode[t]``
    plus the effect of the actions so far; a step also runs ``step_work`` iterations of a
    small recurrent "physics" update (a real env computes something per step). The episode
    ends at its last row.

    With ``stats_dir`` set, every reset appends its duration in seconds to
    ``stats_dir/resets-<pid>.txt``.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        source: str = "inline",
        profile: str | StorageProfile = "local",
        *,
        num_workers: int = 2,
        prefetch: int = 2,
        mp_context: str | None = "fork",
        memmap_dir: str | os.PathLike[str] | None = None,
        step_work: int = 40,
        seed: int = 0,
        shuffle: bool = True,
        stats_dir: str | os.PathLike[str] | None = None,
        episodes: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.episodes = episodes
        if source not in SOURCES:
            raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
        self.paths = [str(p) for p in paths]
        self.source_kind = source
        self.profile = _profile(profile)
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.mp_context = mp_context
        self.memmap_dir = None if memmap_dir is None else str(memmap_dir)
        self.step_work = step_work
        self.shuffle = shuffle
        self.stats_dir = None if stats_dir is None else str(stats_dir)
        self._seed = int(seed)
        self._source: EpisodeSource | None = None
        _, channels, _ = read_header(self.paths[0])
        self.channels = channels
        # Small placeholders: __init__ also runs where TorchRL reads specs, so keep it cheap.
        self._episode = torch.zeros(1, channels)
        self._t = 0
        self._offset = torch.zeros(1)
        gen = torch.Generator().manual_seed(1234)
        self._w = torch.randn(128, 128, generator=gen) / 128**0.5
        self._state = torch.zeros(128)
        self.observation_spec = Composite(observation=Unbounded(shape=(channels,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _get_source(self) -> EpisodeSource:
        if self._source is None:
            self._source = make_source(
                self.source_kind,
                self.paths,
                self.profile,
                seed=self._seed,
                shuffle=self.shuffle,
                num_workers=self.num_workers,
                prefetch=self.prefetch,
                mp_context=self.mp_context,
                memmap_dir=self.memmap_dir,
                episodes=self.episodes,
            )
        return self._source

    def _record_reset(self, seconds: float) -> None:
        if self.stats_dir is not None:
            with open(os.path.join(self.stats_dir, f"resets-{os.getpid()}.txt"), "a") as fh:
                fh.write(f"{seconds:.6f}\n")
            # Which episode this is (its length and first row), and its ledger epoch (-1: none).
            epoch = getattr(self._source, "epoch", -1)
            fingerprint = f"{self._episode.shape[0]}:{float(self._episode[0].sum()):.4f}"
            with open(os.path.join(self.stats_dir, f"played-{os.getpid()}.txt"), "a") as fh:
                fh.write(f"{time.time():.6f} {fingerprint} {epoch}\n")

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        start = time.perf_counter()
        self._episode = self._get_source().next_episode()
        self._t = 0
        self._offset = torch.zeros(1)
        self._state = torch.zeros(128)
        obs = self._episode[0] + self._offset
        self._record_reset(time.perf_counter() - start)
        return TensorDict(
            {
                "observation": obs,
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDict) -> TensorDict:
        action = tensordict["action"]
        self._offset = 0.9 * self._offset + 0.1 * action
        state = self._state
        drive = action.expand(128)
        for _ in range(self.step_work):
            state = torch.tanh(self._w @ state + drive)
        self._state = state
        self._t += 1
        obs = self._episode[self._t] + self._offset
        reward = -(obs.abs().mean() + state.abs().mean()).reshape(1)
        done = torch.tensor([self._t >= self._episode.shape[0] - 1])
        return TensorDict(
            {"observation": obs, "reward": reward, "done": done, "terminated": done.clone()},
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        self._seed = int(seed or 0)
        if self._source is not None:
            self._source.set_seed(self._seed)

    def close(self, *args: Any, **kwargs: Any) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()
        super().close(*args, **kwargs)
