"""Handing a slot over from one worker to the next (recycling): the workers of a slot that are
not its current one, the next, started ahead of its turn (a *standby*, see ``_recycle``), and
those recycled out, closing (*retiring*).

Neither's exit is a loss: a standby that dies is discarded (the recycler starts another), a
retiring worker is expected to exit. The supervisor owns one :class:`Handovers`; its watcher
thread reaps the retiring workers (and kills them past their deadline); ``shutdown`` ends
every one of them before it closes the current workers.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable

from . import _identity, _reaper_client
from ._record import WorkerRecord, kill_worker_tree

__all__ = ["Handovers"]

log = logging.getLogger("torchrl_ext")


class Handovers:
    """The standby and retiring workers of one env's start: the slots being handed over.

    Fields (under ``lock``, the supervisor's): ``standby`` maps a slot to its next worker (set
    by the recycler through the supervisor, taken when it is promoted or discarded);
    ``retiring`` lists recycled-out workers with the monotonic time past which they are killed
    (appended at a promotion, removed by the watcher once reaped).
    """

    def __init__(self, label: str, lock: threading.RLock, retire_fd: Callable[[int], None]) -> None:
        self.label = label
        self._lock = lock
        self._retire_fd = retire_fd
        self.standby: dict[int, WorkerRecord] = {}
        self.retiring: list[tuple[WorkerRecord, float]] = []

    def gone(self, index: int) -> bool:
        """Whether slot ``index``'s standby has exited (or there is none)."""
        with self._lock:
            worker = self.standby.get(index)
        return worker is None or worker.gone()

    def exitcode(self, index: int, wait: float = 1.0) -> int | None:
        """Slot ``index``'s standby's exit code once it exited (polled up to ``wait`` seconds:
        its pipe closes a moment before its status can be collected); ``None`` if it has not
        exited by then, or there is none."""
        with self._lock:
            worker = self.standby.get(index)
        return None if worker is None else worker.read_exitcode(wait)

    def discard(self, index: int) -> None:
        """Kill slot ``index``'s standby and its tree, and reap it."""
        with self._lock:
            worker = self.standby.pop(index, None)
        if worker is not None:
            self.end([worker])

    def sentinels(self) -> list[int]:
        """What the watcher waits on for the retiring workers (under the lock)."""
        return [w.sentinel for w, _deadline in self.retiring]

    def watch(self, ready: list[int]) -> None:
        """The watcher's part: reap retiring workers that exited (killing what is left of their
        trees); kill those past their deadline."""
        now = time.monotonic()
        with self._lock:
            retiring = list(self.retiring)
        for worker, deadline in retiring:
            if worker.sentinel in ready or worker.gone():
                worker.finished = True
                self.end([worker])
                with self._lock:
                    self.retiring = [r for r in self.retiring if r[0] is not worker]
            elif now >= deadline:
                log.warning(
                    "%s recycled worker %d (pid %d) did not close within its deadline; killing it",
                    self.label,
                    worker.index,
                    worker.pid,
                )
                worker.signal(signal.SIGKILL)

    def end_all(self) -> None:
        """At shutdown: every standby and retiring worker, killed and reaped."""
        with self._lock:
            extras = list(self.standby.values()) + [w for w, _deadline in self.retiring]
            self.standby, self.retiring = {}, []
        if extras:
            self.end(extras)

    def end(self, workers: list[WorkerRecord]) -> None:
        """SIGKILL and reap ``workers`` and their trees (nobody's loss)."""
        for worker in workers:
            worker.signal(signal.SIGKILL)
        # Their groups and recorded descendants, no tag: a tag scan would match the slot's
        # current worker too (the same slot's tag). The workers are collected by read_exitcode.
        kill_worker_tree(workers, tag=None)
        for worker in workers:
            worker.exitcode = worker.read_exitcode(wait=2.0)
            if worker.exitcode is None:  # still exiting: collected when it can be
                proc = _identity.same_process(worker.pid, worker.create_time)
                _identity.reap_later([proc] if proc is not None else [])
            worker.handled.set()
            _reaper_client.unwatch(worker.pid)
            with contextlib.suppress(OSError):
                worker.channel.close()
            with self._lock:
                if worker.pidfd is not None:
                    self._retire_fd(worker.pidfd)
                    worker.pidfd = None
