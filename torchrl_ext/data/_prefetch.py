"""A background-thread prefetcher for code that must stay in one process."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar, cast

from torch.utils.data import Dataset

from ._closing import Closing

__all__ = ["ThreadPrefetcher"]

_logger = logging.getLogger("torchrl_ext")

T = TypeVar("T")

# How often a blocked producer or consumer re-checks whether it should stop. Items are
# handed over as soon as they are ready; this only bounds how long a stop takes to notice.
_POLL_S = 0.05


class _End:
    """Sentinel: the keys are exhausted."""


class _Failure:
    """Wraps an exception raised by the load function in the producer thread."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue[Any], item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    load: Callable[[Any], Any], keys: Iterator[Any], q: queue.Queue[Any], stop: threading.Event
) -> None:
    # Module-level on purpose: the thread must not keep the prefetcher itself alive,
    # so that dropping the last reference still reaches ``__del__``.
    try:
        for key in keys:
            if stop.is_set():
                return
            if not _put(q, load(key), stop):
                return
    except BaseException as exc:
        _put(q, _Failure(exc), stop)
        return
    _put(q, _End(), stop)


class ThreadPrefetcher(Closing, Generic[T]):
    """Load items in a background daemon thread while the caller works on the current one.

    For code that must stay in one process: while you consume item ``k`` the thread is already
    loading ``k + 1 ... k + prefetch`` (CPython releases the GIL during file reads and most
    torch ops, so loading overlaps with your work). ``source`` is either a callable
    ``load(key) -> item`` or a map-style dataset (``source[key]``). ``keys`` is any iterable,
    possibly endless (e.g. an :class:`EpisodeSampler`); it defaults to ``range(len(source))``.
    Items arrive in key order; iteration ends when the keys do. An exception raised while
    loading is re-raised by the :meth:`__next__` call that would have returned that item.

    The thread starts lazily (first :meth:`__next__` or :meth:`start`), holds at most
    ``prefetch`` finished items in its queue (plus the one it is loading), and is stopped and
    joined by :meth:`close`. Not safe for several consumer threads.

    Example:
        >>> with ThreadPrefetcher(lambda k: k * k, keys=range(4), prefetch=2) as pf:
        ...     list(pf)
        [0, 1, 4, 9]
    """

    def __init__(
        self,
        source: Callable[[Any], T] | Dataset[T],
        keys: Iterable[Any] | None = None,
        prefetch: int = 2,
        *,
        name: str = "torchrl_ext-prefetch",
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if isinstance(source, Dataset) or (hasattr(source, "__getitem__") and not callable(source)):
            load: Callable[[Any], T] = source.__getitem__
        elif callable(source):
            load = source
        else:
            raise TypeError("source must be a callable load(key) or a map-style dataset")
        if keys is None:
            if not isinstance(source, Sized):
                raise TypeError("keys is required when source has no len()")
            keys = range(len(source))
        self._load = load
        self._keys = keys
        self._prefetch = int(prefetch)
        self._name = name
        self._queue: queue.Queue[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        self._finished = False
        self._error: BaseException | None = None

    @property
    def prefetch(self) -> int:
        """Maximum number of finished items waiting in the queue."""
        return self._prefetch

    @property
    def started(self) -> bool:
        """True once the thread was started and until :meth:`close`."""
        return self._thread is not None and not self._closed

    def start(self) -> None:
        """Start the loading thread now instead of on the first :meth:`__next__` (idempotent)."""
        if self._closed:
            raise RuntimeError("ThreadPrefetcher is closed")
        if self._thread is not None:
            return
        self._queue = queue.Queue(maxsize=self._prefetch)
        thread = threading.Thread(
            target=_produce,
            args=(self._load, iter(self._keys), self._queue, self._stop),
            name=self._name,
            daemon=True,
        )
        thread.start()
        self._thread = thread

    def __iter__(self) -> ThreadPrefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise RuntimeError("ThreadPrefetcher is closed")
        if self._error is not None:
            raise RuntimeError("ThreadPrefetcher stopped after a load error") from self._error
        if self._finished:
            raise StopIteration
        self.start()
        q, thread = cast(queue.Queue[Any], self._queue), cast(threading.Thread, self._thread)
        while True:
            try:
                item = q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._closed:
                    raise RuntimeError("ThreadPrefetcher was closed while waiting") from None
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("the prefetch thread exited unexpectedly") from None
        if isinstance(item, _End):
            self._finished = True
            thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self._error = item.exc
            thread.join()
            raise item.exc
        return cast(T, item)

    def next(self) -> T:
        """Same as ``next(prefetcher)``."""
        return self.__next__()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread, join it (up to ``timeout`` s) and drop queued items. Idempotent.

        A load already in progress is not interrupted: the join waits for it (the thread is a
        daemon, so a load that outlives ``timeout`` cannot keep the interpreter alive).
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        thread, q = self._thread, self._queue
        self._thread = self._queue = None
        if os.getpid() != self._pid:
            # A forked copy: the thread lives in the parent only, and the queue's lock may have
            # been copied in a held state, so touch nothing.
            return
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                _logger.warning(
                    "ThreadPrefetcher %r: a load is still running after %.1f s; "
                    "the daemon thread will exit when it returns",
                    self._name,
                    timeout if timeout is not None else float("nan"),
                )
        if q is not None:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break

    def _close_when_collected(self) -> None:
        self.close(timeout=1.0)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._thread is not None else "idle")
        return f"{type(self).__name__}(prefetch={self._prefetch}, {state})"
