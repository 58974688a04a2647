"""Where a hung worker hung: its Python stacks, every thread, captured before it is killed.

Worker side, :func:`arm` (called while the worker process is prepared, before the user's env
exists): ``faulthandler`` dumps every thread's stack to the slot's stacks file when the process
gets :data:`STACKS_SIGNAL`. The dump is written by C code in the signal handler, so it works
while the worker is stuck in a C call that holds the GIL.

Parent side, :func:`capture` (the supervisor's ``kill_hung``, just before the SIGKILL): send
the signal to the worker itself (by identity: never to a reused pid), wait at most
:data:`CAPTURE_TIMEOUT` for the dump to stop growing, and return what it wrote.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from typing import IO

import psutil

from . import _identity
from ._wait import wait_for

__all__ = ["CAPTURE_TIMEOUT", "STACKS_SIGNAL", "arm", "capture", "stacks_path"]

#: The signal a worker dumps its stacks on (a program whose env handles SIGUSR2 itself gets no
#: stacks, and loses nothing else).
STACKS_SIGNAL = signal.SIGUSR2
#: Longest wait for a dump before the hung worker is killed anyway.
CAPTURE_TIMEOUT = 0.5
#: A dump is complete once its size stayed the same for this long.
_SETTLED = 0.05

_armed: IO[str] | None = None  # kept open for the life of the worker (faulthandler holds its fd)


def stacks_path(report_path: str) -> str:
    """The stacks file next to a worker's report file (both in the supervisor's directory)."""
    return report_path + ".stacks"


def built_path(report_path: str) -> str:
    """The file a worker creates once its env is built (next to its report file): what the
    start-up bound (``start_timeout``) reads to tell a worker still building from a built one."""
    return report_path + ".built"


def arm(path: str) -> None:
    """In the worker: dump every thread's stack to ``path`` (appending) on STACKS_SIGNAL."""
    global _armed
    try:
        _armed = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the worker's life
        faulthandler.register(STACKS_SIGNAL, file=_armed, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        _armed = None  # no stacks for this worker; the hang is still handled


def capture(pid: int, create_time: float, report_path: str, timeout: float = CAPTURE_TIMEOUT) -> str | None:
    """Ask worker ``pid`` (whose report file is ``report_path``) for its stacks and return them
    (``None``: it wrote nothing in time)."""
    path = stacks_path(report_path)
    try:
        start = os.path.getsize(path)
    except OSError:
        return None  # never armed (a worker started without supervision of ours)
    proc = _identity.same_process(pid, create_time)
    if proc is None:
        return None
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        proc.send_signal(STACKS_SIGNAL)
    size, stable_since = start, time.monotonic()

    def settled() -> bool:
        nonlocal size, stable_since
        now_size = os.path.getsize(path)
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
            return False
        return size > start and time.monotonic() - stable_since >= _SETTLED

    try:
        # Looks 10 ms apart at most: settling (50 ms unchanged) is judged to within one look.
        wait_for(settled, time.monotonic() + timeout, "the stacks did not settle", slice=0.01)
    except OSError:
        return None
    if size <= start:
        return None
    with open(path, encoding="utf-8", errors="replace") as fh:
        fh.seek(start)
        return fh.read().strip() or None
