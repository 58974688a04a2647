"""Endless, reseedable, lazily started episode loader for use inside env worker processes."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator, Sized
from typing import Any, Generic, Literal, TypeVar, cast

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils import signal_handling as _signal_handling

from ._closing import Closing
from ._prefetch import ThreadPrefetcher
from ._sampler import EpisodeSampler, derive_seed

__all__ = ["EpisodeLoader"]

_logger = logging.getLogger("torchrl_ext")

T = TypeVar("T")

# Salt that separates the DataLoader's worker-seed stream from the episode-order stream.
_WORKER_SEED_SALT = 0x5EED

_warn_lock = threading.Lock()
_warned_pid: int | None = None

_DAEMONIC_WARNING = (
    "EpisodeLoader: this process is daemonic, so it cannot start DataLoader worker processes "
    "('daemonic processes are not allowed to have children'); falling back to one background "
    "thread that prefetches episodes in this process. To load episodes in worker processes, "
    "build the environment with torchrl_ext.ManagedParallelEnv(..., daemon_workers=False)."
)


def _warn_daemonic_once() -> None:
    global _warned_pid
    pid = os.getpid()
    with _warn_lock:
        if _warned_pid == pid:  # keyed by pid: a forked child warns again, once
            return
        _warned_pid = pid
    _logger.warning(_DAEMONIC_WARNING)


#: Default niceness increment of the loader's worker processes.
DEFAULT_WORKER_NICE = 19


def _lower_priority(increment: int, _worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the loader works ahead, so it yields to stepping."""
    try:
        os.nice(increment)
    except OSError as err:  # not permitted (only raising priority needs privileges)
        _logger.debug("could not renice loader worker %d: %s", os.getpid(), err)


def _identity(item: Any) -> Any:
    # batch_size=None: deliver each episode exactly as the dataset returned it.
    return item


class EpisodeLoader(Closing, Generic[T]):
    """Endless episode stream that loads the next episodes while the current one runs.

    ``dataset`` is a map-style dataset whose item is one whole episode (tensor, dict or
    TensorDict). On the first :meth:`__next__` the loader builds ONE persistent
    ``torch.utils.data.DataLoader`` (``batch_size=None``, an endless :class:`EpisodeSampler`,
    ``persistent_workers=True``, ``prefetch_factor=prefetch``), so up to
    ``num_workers * prefetch`` episodes are loaded ahead; ``next()`` blocks only when none is
    ready. Constructing the loader starts no process or thread, so the copy of an env that
    TorchRL builds in the main process just to read specs costs nothing.

    Order: epoch ``e`` is a permutation drawn from ``(seed, e)`` (``shuffle=False``: ``0..n-1``);
    every episode is delivered exactly once per epoch, and the same seed gives the same stream.
    Call :meth:`set_seed` from the env's ``_set_seed`` so each worker gets its own order.

    With ``num_workers=0``, or inside a daemonic process (the default TorchRL ``ParallelEnv``
    worker), loading happens in a :class:`ThreadPrefetcher` instead (same order, queue depth
    ``prefetch``); the daemonic case logs one warning per process.

    ``worker_nice`` (default 19) lowers the priority of the loader's worker processes by that
    much (``os.nice``): they parse ahead on idle CPU and never delay the env's steps; where
    cores are scarce this makes a 2-core machine step 1.1-1.2x faster (see
    ``benchmarks/heavy_reset.py``). ``None`` keeps the env worker's priority. If every core is
    busy with other work too, the loader gets little CPU and resets wait for it.

    ``multiprocessing_context`` goes to the DataLoader. ``None`` means the process default,
    which importing torchrl sets to ``"spawn"``: each worker then re-imports torch (seconds)
    and the dataset must be picklable. On Linux, ``"fork"`` starts workers in milliseconds
    (fine unless the dataset uses CUDA).

    Not thread-safe: consume it from one thread. Items from worker processes arrive through
    shared memory; treat them as read-only if the dataset hands out shared storage.

    Example:
        >>> import torch
        >>> episodes = [torch.full((5, 2), float(i)) for i in range(3)]
        >>> with EpisodeLoader(episodes, num_workers=0, seed=0) as loader:
        ...     sorted(int(next(loader)[0, 0]) for _ in range(3))
        [0, 1, 2]
    """

    def __init__(
        self,
        dataset: Dataset[T],
        num_workers: int = 2,
        prefetch: int = 2,
        shuffle: bool = True,
        seed: int | None = None,
        *,
        multiprocessing_context: str | None = None,
        worker_nice: int | None = DEFAULT_WORKER_NICE,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if not isinstance(dataset, Sized):
            raise TypeError("dataset must be a map-style dataset with __len__ and __getitem__")
        num_episodes = len(dataset)
        if num_episodes == 0:
            raise ValueError("dataset is empty")
        self._dataset = dataset
        self._requested_workers = int(num_workers)
        self._prefetch = int(prefetch)
        self._mp_context = multiprocessing_context
        if worker_nice is not None and worker_nice < 0:
            raise ValueError(f"worker_nice must be None or >= 0 (lower priority only), got {worker_nice}")
        self._worker_nice = worker_nice
        self._sampler = EpisodeSampler(num_episodes, shuffle=shuffle, seed=seed)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._backend: Literal["dataloader", "thread"] | None = None
        self._dataloader: DataLoader[T] | None = None
        self._iterator: Iterator[T] | None = None
        self._prefetcher: ThreadPrefetcher[T] | None = None
        self._owner_pid: int | None = None
        self._reset_pending = False
        self._closed = False

    # ----------------------------------------------------------------------------- properties
    @property
    def dataset(self) -> Dataset[T]:
        """The wrapped dataset."""
        return self._dataset

    @property
    def num_episodes(self) -> int:
        """Episodes per epoch (``len(dataset)``)."""
        return self._sampler.num_episodes

    @property
    def prefetch(self) -> int:
        """Episodes prefetched per worker (thread queue depth on the thread path)."""
        return self._prefetch

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is a random permutation."""
        return self._sampler.shuffle

    @property
    def seed(self) -> int:
        """Current seed of the episode order (a random one if none was given)."""
        return self._sampler.seed

    @property
    def num_workers(self) -> int:
        """DataLoader worker processes in use (0 on the thread path).

        Before the start this predicts the value from the current process (0 if daemonic).
        """
        if self._backend is not None:
            return 0 if self._backend == "thread" else self._requested_workers
        if self._requested_workers > 0 and multiprocessing.current_process().daemon:
            return 0
        return self._requested_workers

    @property
    def backend(self) -> Literal["dataloader", "thread"] | None:
        """``"dataloader"`` or ``"thread"`` once started, else ``None``."""
        return self._backend

    @property
    def started(self) -> bool:
        """True once the first episode was requested, until :meth:`close`."""
        return self._backend is not None and not self._closed

    # ------------------------------------------------------------------------------- control
    def set_seed(self, seed: int | None) -> None:
        """Reseed the episode order; the stream restarts at epoch 0 of the new seed.

        Cheap before the start. On a started loader the restart happens at the next
        :meth:`__next__`: on the DataLoader path the persistent workers are kept, but the
        episodes already prefetched or in flight (up to ``num_workers * prefetch``) are loaded
        to completion and discarded; on the thread path the thread is joined (after its
        current load) and a new one started. Worker processes keep the RNG seeds they got at
        start-up (derived from the seed at the first start).

        Example:
            >>> loader = EpisodeLoader(list(range(4)), num_workers=0)
            >>> loader.set_seed(3)
            >>> loader.seed
            3
        """
        self._sampler.set_seed(seed)
        if self._backend is not None:
            self._reset_pending = True

    def __iter__(self) -> EpisodeLoader[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise RuntimeError("EpisodeLoader is closed")
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            self._abandon()  # forked copy of a started loader: start afresh in this process
        if self._backend is None:
            self._start()
        elif self._reset_pending:
            self._restart()
        if self._prefetcher is not None:
            return next(self._prefetcher)
        return next(cast(Iterator[T], self._iterator))

    def next(self) -> T:
        """Same as ``next(loader)``: the next episode, waiting only if none is loaded yet."""
        return self.__next__()

    def _start(self) -> None:
        workers = self._requested_workers
        if workers > 0 and multiprocessing.current_process().daemon:
            _warn_daemonic_once()
            workers = 0
        self._reset_pending = False
        if workers == 0:
            self._start_thread()
            self._backend = "thread"
        else:
            generator = torch.Generator()
            generator.manual_seed(derive_seed(self._sampler.seed, _WORKER_SEED_SALT))
            dataloader = DataLoader(
                self._dataset,
                batch_size=None,
                sampler=self._sampler,
                num_workers=workers,
                collate_fn=_identity,
                persistent_workers=True,
                prefetch_factor=self._prefetch,
                generator=generator,
                multiprocessing_context=self._mp_context,
                worker_init_fn=(
                    None if not self._worker_nice else functools.partial(_lower_priority, self._worker_nice)
                ),
            )
            # If starting the workers fails (e.g. an unpicklable dataset under spawn), the
            # loader stays unstarted and the next call tries again.
            self._iterator = iter(dataloader)
            self._dataloader = dataloader
            self._backend = "dataloader"
        self._owner_pid = os.getpid()
        _logger.debug(
            "EpisodeLoader started: backend=%s num_workers=%d prefetch=%d",
            self._backend,
            workers,
            self._prefetch,
        )

    def _start_thread(self) -> None:
        self._prefetcher = ThreadPrefetcher(
            self._dataset, keys=self._sampler, prefetch=self._prefetch, name="torchrl_ext-episodes"
        )
        self._prefetcher.start()

    def _restart(self) -> None:
        self._reset_pending = False
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._start_thread()
        else:
            # Persistent workers: iter() resets the existing iterator with a fresh sampler pass.
            self._iterator = iter(cast(DataLoader[T], self._dataloader))

    def _abandon(self) -> None:
        """Forget runtime state inherited through fork without touching the parent's workers."""
        iterator = self._iterator
        if iterator is not None and hasattr(iterator, "_shutdown"):
            # Otherwise the copy's __del__ would signal the PARENT's workers to exit.
            iterator._shutdown = True
            if getattr(iterator, "_worker_pids_set", False):
                # torch keeps each live iterator's worker pids in a process-wide table keyed by
                # id(), and the fork copied the parent's entry (the parent's own table is not
                # touched here). Left in place, a new iterator that reuses this id() fails to
                # start: "_set_worker_pids should be called only once".
                _signal_handling._remove_worker_pids(id(iterator))
                cast(Any, iterator)._worker_pids_set = False
        if self._prefetcher is not None:
            self._prefetcher.close()  # fork-aware: only marks the copy closed
        closed = self._closed
        self._init_runtime()
        self._closed = closed

    def close(self) -> None:
        """Shut the DataLoader workers (or the prefetch thread) down now. Idempotent.

        Example:
            >>> loader = EpisodeLoader(list(range(3)), num_workers=0)
            >>> loader.close(); loader.close(); loader.closed
            True
        """
        if getattr(self, "_closed", True):
            return
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            self._abandon()
            self._closed = True
            return
        self._closed = True
        iterator, prefetcher = self._iterator, self._prefetcher
        self._iterator = self._dataloader = self._prefetcher = None
        if iterator is not None:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if prefetcher is not None:
            prefetcher.close()
        if self._backend is not None:
            _logger.debug("EpisodeLoader closed (backend=%s)", self._backend)

    # ----------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """Pickle the configuration and current seed only; the copy starts unstarted."""
        return {
            "dataset": self._dataset,
            "num_workers": self._requested_workers,
            "prefetch": self._prefetch,
            "mp_context": self._mp_context,
            "worker_nice": self._worker_nice,
            "sampler": self._sampler,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._dataset = state["dataset"]
        self._requested_workers = state["num_workers"]
        self._prefetch = state["prefetch"]
        self._mp_context = state["mp_context"]
        self._worker_nice = state.get("worker_nice", DEFAULT_WORKER_NICE)
        self._sampler = state["sampler"]
        self._init_runtime()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._backend or "not started")
        return (
            f"{type(self).__name__}(num_episodes={self.num_episodes}, "
            f"num_workers={self._requested_workers}, prefetch={self._prefetch}, "
            f"shuffle={self.shuffle}, {state})"
        )
