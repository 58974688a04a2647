"""Every operating-system call the library makes, behind capability checks.

Linux gets the full guarantee (``prctl`` parent-death signals, child subreaper, ``pidfd``).
Other POSIX systems (macOS) degrade: the calls below become no-ops that return ``False``
and the supervisor relies on process groups, psutil and the external reaper alone.
Capabilities are probed once and cached. ``TORCHRL_EXT_PORTABLE=1`` in the environment turns
the Linux-only calls off on Linux too, so the test suite can check the reduced guarantee that
other systems get.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import signal
import sys

__all__ = [
    "IS_LINUX",
    "PORTABLE_VAR",
    "has_pidfd",
    "has_prctl",
    "kill_process_group",
    "new_process_group",
    "open_pidfd",
    "peek_exit_status",
    "portable_only",
    "process_group_of",
    "set_child_subreaper",
    "set_parent_death_signal",
    "signal_name",
]

IS_LINUX = sys.platform.startswith("linux")

#: Set to ``1`` to use only the portable code paths (no ``prctl``, no pidfd), as on macOS.
PORTABLE_VAR = "TORCHRL_EXT_PORTABLE"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not IS_LINUX:
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def portable_only() -> bool:
    """Whether the Linux-only calls are off: not Linux, or ``TORCHRL_EXT_PORTABLE=1``."""
    return not IS_LINUX or os.environ.get(PORTABLE_VAR) == "1"


@functools.lru_cache(maxsize=1)
def has_prctl() -> bool:
    """Whether ``prctl`` (parent-death signal, child subreaper) is usable here."""
    if portable_only():
        return False
    libc = _libc()
    if libc is None:
        return False
    value = ctypes.c_int(0)
    return libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0


@functools.lru_cache(maxsize=1)
def has_pidfd() -> bool:
    """Whether ``os.pidfd_open`` works (Linux >= 5.3)."""
    if portable_only() or not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def _prctl(option: int, arg: int) -> bool:
    libc = _libc()
    if libc is None or not has_prctl():
        return False
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it exits.

    Returns ``False`` where unsupported. The caller must check ``os.getppid()`` afterwards:
    the setting is not retroactive.
    """
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper(enabled: bool = True) -> bool:
    """Make orphaned descendants of this process re-parent to it instead of PID 1."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1 if enabled else 0)


def is_child_subreaper() -> bool:
    """Whether this process is currently a child subreaper (``False`` where unsupported)."""
    libc = _libc()
    if libc is None or not has_prctl():
        return False
    value = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    return bool(value.value)


def new_process_group() -> bool:
    """Put the calling process into a new process group led by itself."""
    try:
        os.setpgid(0, 0)
    except OSError:
        return False
    return True


def process_group_of(pid: int) -> int | None:
    """The process group of ``pid``, or ``None`` when it is gone."""
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def kill_process_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group. Returns ``False`` when the group is gone.

    Only call this for a group whose leader identity was verified by the caller.
    """
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as err:
        if err.errno == errno.EPERM:
            return False
        raise
    return True


def open_pidfd(pid: int) -> int | None:
    """A pollable descriptor that becomes readable when ``pid`` exits, or ``None``."""
    if not has_pidfd():
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def peek_exit_status(pidfd: int) -> int | None:
    """Exit code (negative signal number if killed) of an exited child, without reaping it.

    ``None`` when the process is not our child, still runs, or this is unsupported.
    """
    if not hasattr(os, "waitid") or not hasattr(os, "P_PIDFD"):
        return None
    try:
        result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if result is None:
        return None
    if result.si_code == os.CLD_EXITED:
        return int(result.si_status)
    return -int(result.si_status)


def signal_name(signum: int) -> str:
    """``signal.SIGKILL`` -> ``"SIGKILL"``; unknown numbers -> ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
