"""The supervisor's thread: it waits on the workers' exits and owns the descriptors it waits on.

One :class:`Watcher` per start, one daemon thread (``torchrl_ext-supervisor-<label>``)::

    round:  under the supervisor's lock: stopped? -> leave
                                         plan = supervisor's round (what to wait on, how long)
                                         take the retired descriptors
            close the retired descriptors (nobody else waits on them now)
            wait(plan's sentinels + the wake pipe, plan's timeout)
            drain the wake pipe; plan.handle(the sentinels that became readable)

What the round waits on and does with a readable sentinel is the supervisor's
(``_supervisor``: exits, retiring workers, the periodic snapshot); this module only owns the
thread and the descriptors.

Descriptors. A pidfd the thread may be waiting on is never closed by another thread: whoever
drops a worker *retires* its pidfd (:meth:`Watcher.retire_fd`, under the lock) and the thread
closes it at the top of its next round. Once the thread has left, :meth:`Watcher.stop` runs the
supervisor's release (which closes the workers' ``Process`` objects, their sentinels among
them, and hands back the pidfds it still holds) and closes those, the retired descriptors and
the wake pipe; a thread still inside a round at the deadline (a slow exit-status read, a
snapshot on a busy machine) does that itself as it leaves, so nothing is closed, or its number
reused, under it.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Round", "Watcher"]

#: The longest ``stop()`` waits for the thread to leave its round.
STOP_JOIN_LIMIT = 2.0


@dataclass(frozen=True)
class Round:
    """One round of the watcher, planned by the supervisor under its lock.

    ``waits``: the sentinels (and pidfds) to wait on; ``timeout``: the longest wait, seconds;
    ``handle``: called by the thread, outside the lock, with those of ``waits`` that became
    readable (possibly none: the timeout or a wake-up).
    """

    waits: list[int]
    timeout: float
    handle: Callable[[list[int]], None]


class Watcher:
    """The thread of one supervisor and the descriptors it waits on.

    Fields, under ``lock`` (the supervisor's): ``_stopped`` is set once, by :meth:`stop`;
    ``_retired`` collects descriptors to close, appended by :meth:`retire_fd` and taken by the
    thread each round (or by :meth:`stop`); ``_left`` is set once, by the thread as it leaves;
    ``_on_exit`` is what :meth:`stop` left to a thread that had not left after its join (the
    release, then the descriptors), run by that thread as it leaves. Both are read and written
    under the lock, so exactly one of the two runs it.
    """

    def __init__(self, name: str, lock: threading.RLock, plan: Callable[[], Round]) -> None:
        self.name = name
        self._lock = lock
        self._plan = plan
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self._retired: list[int] = []
        self._left = False
        self._on_exit: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """End the current wait: the next round is planned anew (a worker was replaced)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")

    def retire_fd(self, fd: int) -> None:
        """Have ``fd`` (a dropped worker's pidfd) closed by the thread; under the lock."""
        self._retired.append(fd)

    def stop(self, deadline: float | None, release: Callable[[], list[int]]) -> bool:
        """Stop the thread, waiting for it until ``deadline`` (monotonic; at most
        :data:`STOP_JOIN_LIMIT` from now); once it is gone, run ``release`` (under the lock:
        it frees what the thread may have been waiting on and returns the descriptors still
        held) and close those, the retired ones and the thread's own. A thread still running
        at the deadline does that itself as it leaves. Returns False if already stopped."""
        with self._lock:
            if self._stopped:
                return False
            self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        thread = self._thread
        current = threading.current_thread()
        if thread is not None and thread is not current:
            limit = STOP_JOIN_LIMIT if deadline is None else deadline - time.monotonic()
            thread.join(timeout=max(0.0, min(STOP_JOIN_LIMIT, limit)))

        def finish() -> None:
            with self._lock:
                retired, self._retired = self._retired, []
                fds = [*release(), *retired, self._wake_r, self._wake_w]
            close_all(fds)

        with self._lock:
            if thread is not None and not self._left and thread is not current:
                self._on_exit = finish
                return True
        finish()
        return True

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._left = True
                finish, self._on_exit = self._on_exit, None
            if finish is not None:
                finish()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                plan = self._plan()
                retired, self._retired = self._retired, []
            close_all(retired)
            ready = multiprocessing.connection.wait([*plan.waits, self._wake_r], timeout=plan.timeout)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            plan.handle([fd for fd in ready if isinstance(fd, int) and fd != self._wake_r])


def close_all(fds: list[int]) -> None:
    """Close each of ``fds``, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
