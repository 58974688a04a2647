"""What ``python -m torchrl_ext doctor`` measures on this machine: the size of ``/dev/shm``,
the open-files limit (``ulimit -n``), and whether the process that adopts an orphan reaps it.

:mod:`torchrl_ext._doctor` judges these; the capability checks it also reports (``prctl``,
pidfd) are :mod:`torchrl_ext._platform`'s.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from typing import NamedTuple

import psutil

from . import _platform
from ._wait import wait_for

__all__ = [
    "OrphanProbe",
    "open_files_limit",
    "probe_orphan_reaping",
    "shm_size",
]


def shm_size(path: str = "/dev/shm") -> int | None:
    """Total size in bytes of the shared-memory file system, or ``None`` where there is none.

    Example:
        >>> size = shm_size()
        >>> size is None or size > 0
        True
    """
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def open_files_limit() -> tuple[int, int]:
    """``(soft, hard)`` limit on open file descriptors (``ulimit -n``); ``-1`` means unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (-1 if soft == unlimited else soft, -1 if hard == unlimited else hard)


class OrphanProbe(NamedTuple):
    """What :func:`probe_orphan_reaping` saw."""

    #: The test orphan's pid.
    pid: int | None
    #: The process it was re-parented to (PID 1, or the nearest child subreaper above us).
    adopter_pid: int | None
    adopter_name: str | None
    #: ``True``: the adopter reaped it; ``False``: still a zombie at the deadline;
    #: ``None``: the test could not say (it was re-parented to this very process, or failed).
    reaped: bool | None
    #: Seconds from the orphan's exit to its disappearance (or to the deadline).
    waited: float


# A grandchild that closes its stdout (so that the intermediate's output ends when the
# intermediate exits), then waits for EOF on the inherited pipe, or 60 s at most.
_ORPHAN_CODE = """\
import os, select, sys
fd = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(1)
    select.select([fd], [], [], 60.0)
    os._exit(0)
print(pid, flush=True)
"""


def probe_orphan_reaping(timeout: float = 5.0) -> OrphanProbe:
    """Make one orphan and see whether the process that adopts it reaps it.

    A child starts a grandchild and exits at once; the grandchild, now re-parented to PID 1
    (or to the nearest child subreaper above this process), exits when this process closes
    a pipe; then its pid is polled until it is gone or ``timeout`` seconds have passed.
    This process is not made a subreaper; when it already is one (or is PID 1) the orphan
    comes back to it, is reaped here, and ``reaped`` is ``None``. The grandchild exits on
    its own within 60 s even if this process dies. Where the adopter does not reap, the
    test leaves one zombie behind (a process-table entry, no memory).
    """
    read_end, write_end = os.pipe()
    try:
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _ORPHAN_CODE, str(read_end)],
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        finally:
            os.close(read_end)
        try:
            out, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return OrphanProbe(None, None, None, None, 0.0)
        if child.returncode != 0 or not out.strip().isdigit():
            return OrphanProbe(None, None, None, None, 0.0)
        pid = int(out)
        try:
            # Blocked on our pipe, so the pid cannot have been reused yet.
            orphan = psutil.Process(pid)
            adopter = orphan.ppid()
        except psutil.Error:
            return OrphanProbe(pid, None, None, None, 0.0)
        name = _platform.process_name(adopter)
    finally:
        os.close(write_end)  # the orphan exits now
    start = time.monotonic()
    if adopter == os.getpid():
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        return OrphanProbe(pid, adopter, name, None, time.monotonic() - start)
    # is_running checks the pid and the create time: a reused pid does not count.
    reaped = wait_for(lambda: not orphan.is_running(), start + timeout, "the orphan was not reaped")
    if not reaped:
        try:
            zombie = orphan.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass  # gone since: reaped after all
        else:
            return OrphanProbe(pid, adopter, name, False if zombie else None, timeout)
    return OrphanProbe(pid, adopter, name, True, time.monotonic() - start)
