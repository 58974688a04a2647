"""The operating-system primitives the library relies on, behind capability checks.

Linux gets the full guarantee (``prctl`` parent-death signals, child subreaper, ``pidfd``).
Other POSIX systems (macOS) degrade: the calls below become no-ops that return ``False``
and the supervisor relies on process groups, psutil and the external reaper alone.
Capabilities are probed once and cached. ``TORCHRL_EXT_PORTABLE=1`` in the environment turns
the Linux-only calls off on Linux too, so the test suite can check the reduced guarantee that
other systems get. Also here: process groups, exit status, signal and process names, the
``/proc`` and cgroup readers (memory, a dying process, OOM kills) and the spawn that passes
descriptors. What ``python -m torchrl_ext doctor`` measures is in :mod:`torchrl_ext._probes`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import psutil

__all__ = [
    "IS_LINUX",
    "PORTABLE_VAR",
    "ZYGOTE_VAR",
    "ProcessMemory",
    "fork_unsafe_reason",
    "has_children",
    "has_parent_death_signal",
    "has_pidfd",
    "has_prctl",
    "has_proc_children",
    "has_smaps_rollup",
    "kill_process_group",
    "neutralise_descriptors",
    "new_process_group",
    "open_pidfd",
    "peek_exit_status",
    "portable_only",
    "process_group_of",
    "process_memory",
    "process_name",
    "set_child_subreaper",
    "set_parent_death_signal",
    "show_environment",
    "signal_name",
    "spawn_passing_fds",
]

IS_LINUX = sys.platform.startswith("linux")

#: Set to ``1`` to use only the portable code paths (no ``prctl``, no pidfd), as on macOS.
PORTABLE_VAR = "TORCHRL_EXT_PORTABLE"

#: Set to ``0`` to start the preloaded fork server as a new interpreter even where forking the
#: main process would be safe (see :func:`fork_unsafe_reason`).
ZYGOTE_VAR = "TORCHRL_EXT_ZYGOTE"

_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not IS_LINUX:
        return None
    try:
        # The symbols this process has loaded, libc's among them. Not ctypes.util.find_library:
        # on Linux it runs `/sbin/ldconfig -p`, a child process, wherever it is first called
        # (a worker exiting, a server stopping: seen as a survivor of the main process's exit).
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def portable_only() -> bool:
    """Whether the Linux-only calls are off: not Linux, or ``TORCHRL_EXT_PORTABLE=1``."""
    return not IS_LINUX or os.environ.get(PORTABLE_VAR) == "1"


@functools.cache
def _prctl_get_works(option: int) -> bool:
    """Whether the read-only ``prctl`` query ``option`` succeeds (it changes nothing)."""
    if portable_only():
        return False
    libc = _libc()
    if libc is None:
        return False
    value = ctypes.c_int(0)
    return bool(libc.prctl(option, ctypes.byref(value), 0, 0, 0) == 0)


def has_prctl() -> bool:
    """Whether ``prctl`` (parent-death signal, child subreaper) is usable here.

    Probed with ``PR_GET_CHILD_SUBREAPER`` (Linux >= 3.4), so it also says whether this
    process can become a child subreaper.
    """
    return _prctl_get_works(_PR_GET_CHILD_SUBREAPER)


def has_parent_death_signal() -> bool:
    """Whether ``PR_SET_PDEATHSIG`` is usable here (probed with ``PR_GET_PDEATHSIG``).

    Example:
        >>> has_parent_death_signal() in (True, False)
        True
    """
    return has_prctl() and _prctl_get_works(_PR_GET_PDEATHSIG)


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


def parent_death_outlives_worker(start_method: str | None) -> bool:
    """Whether a worker started now by this thread may arm the parent-death signal.

    The signal follows the thread that forked the worker, not its process: arm it only where
    that thread outlives the worker, that is, under a fork server (its own main thread forks)
    or when the caller is the main thread. The one copy of that rule.

    Example:
        >>> parent_death_outlives_worker("forkserver")
        True
    """
    return start_method == "forkserver" or threading.current_thread() is threading.main_thread()


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


def process_name(pid: int) -> str | None:
    """The name of process ``pid`` (``"systemd"``, ``"tini"``...), or ``None`` if unreadable."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None


class ProcessMemory(NamedTuple):
    """One process's memory as ``/proc/PID/smaps_rollup`` counts it, in bytes."""

    #: Resident: every page it maps, shared or not.
    rss: int
    #: Proportional: each resident page divided by the number of processes that map it.
    pss: int
    #: Unique: the resident pages no other process maps (``Private_Clean + Private_Dirty``).
    uss: int


#: The ``smaps_rollup`` lines read, and the field of :class:`ProcessMemory` each adds to.
_ROLLUP_FIELDS = {b"Rss:": 0, b"Pss:": 1, b"Private_Clean:": 2, b"Private_Dirty:": 2}


def _read_rollup(pid: int) -> ProcessMemory | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    totals = [0, 0, 0]
    seen = False
    for line in data.splitlines():
        name, _sep, rest = line.partition(b" ")
        field = _ROLLUP_FIELDS.get(name)
        if field is not None:
            totals[field] += int(rest.split()[0]) << 10  # in kB
            seen = True
    return ProcessMemory(*totals) if seen else None  # a zombie's file is empty


@functools.lru_cache(maxsize=1)
def has_proc_children() -> bool:
    """Whether ``/proc/PID/task/TID/children`` can be read (Linux with ``CONFIG_PROC_CHILDREN``):
    a process's children without a scan of every process (:func:`has_children`). Off with
    ``TORCHRL_EXT_PORTABLE=1``.

    Example:
        >>> has_proc_children() in (True, False)
        True
    """
    if portable_only():
        return False
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children", "rb"):
            return True
    except OSError:
        return False


def has_children(pid: int) -> bool | None:
    """Whether process ``pid`` has a child now (zombies count), read from its threads'
    ``children`` files: a few reads, where a full list of its descendants (psutil's) reads
    every process's ``stat``. ``None`` where it cannot tell: :func:`has_proc_children` is
    false, ``pid`` is gone or unreadable, or one of its threads ended while being read (its
    children moved to another thread, perhaps one already read).

    Example:
        >>> has_children(os.getpid()) in (True, False, None)
        True
    """
    if not has_proc_children():
        return None
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        for tid in threads:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                if fh.read(1):
                    return True
    except OSError:
        return None
    return False


@functools.lru_cache(maxsize=1)
def has_smaps_rollup() -> bool:
    """Whether ``/proc/PID/smaps_rollup`` can be read (Linux >= 4.14): the unique and the
    proportional memory of a process (:func:`process_memory`). Off with ``TORCHRL_EXT_PORTABLE=1``.

    Example:
        >>> has_smaps_rollup() in (True, False)
        True
    """
    return not portable_only() and _read_rollup(os.getpid()) is not None


def process_memory(pid: int) -> ProcessMemory | None:
    """Process ``pid``'s resident, proportional and unique memory; ``None`` where
    :func:`has_smaps_rollup` is false, or if it is gone. The kernel walks the process's page
    tables: about 10 ms for a process with torch loaded (RSS alone costs 0.1 ms).

    Example:
        >>> mine = process_memory(os.getpid())
        >>> mine is None or 0 < mine.uss <= mine.pss <= mine.rss
        True
    """
    return _read_rollup(pid) if has_smaps_rollup() else None


#: Where cgroup hierarchies are mounted: v2 (unified) first, then v1's memory controller.
_CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_CGROUP_V1_MEMORY = "/sys/fs/cgroup/memory"


def memory_cgroup(pid: int) -> str | None:
    """The directory of ``pid``'s memory cgroup whose OOM kills can be counted (v2's
    ``memory.events``, or v1's ``memory.oom_control``); ``None`` off Linux or if unreadable.

    Example:
        >>> path = memory_cgroup(os.getpid())
        >>> path is None or os.path.isdir(path)
        True
    """
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        roots: tuple[str, ...]
        if hierarchy == "0" and controllers == "":
            roots, marker = _CGROUP_ROOTS, "memory.events"
        elif "memory" in controllers.split(","):
            roots, marker = (_CGROUP_V1_MEMORY,), "memory.oom_control"
        else:
            continue
        for root in roots:
            for candidate in (os.path.join(root, path.lstrip("/")), root):  # a cgroup namespace shows "/"
                if os.path.exists(os.path.join(candidate, marker)):
                    return candidate
    return None


def cgroup_oom_kills(cgroup: str) -> int | None:
    """How many processes the kernel's OOM killer has killed in ``cgroup`` (``None``: unknown)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(cgroup, name), encoding="ascii") as fh:
                for line in fh:
                    key, _sep, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


#: ``PF_EXITING`` in the flags of ``/proc/<pid>/stat`` (the kernel is tearing the process down).
_PF_EXITING = 0x4


def is_dying(pid: int) -> bool:
    """Whether ``pid`` is exiting or about to: gone, a zombie, its exit begun, or a SIGKILL
    pending (what the OOM killer sends). Off Linux: whether it is gone.

    Example:
        >>> is_dying(os.getpid())
        False
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rpartition(")")[2].split()
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        if not os.path.isdir("/proc/self"):  # no procfs: only whether it runs at all
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
            return False
        return True
    state, flags = fields[0], int(fields[6])
    kill_bit = 1 << (signal.SIGKILL - 1)
    pending = any(int(status.get(key, "0").strip() or "0", 16) & kill_bit for key in ("SigPnd", "ShdPnd"))
    return state in ("Z", "X", "x") or bool(flags & _PF_EXITING) or pending


def cgroup_memory_limit(cgroup: str) -> int | None:
    """``cgroup``'s memory limit in bytes (v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
    ``None`` when unlimited or unreadable."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup, name), encoding="ascii") as fh:
                value = fh.read().strip()
        except OSError:
            continue
        if value == "max" or not value.isdigit() or int(value) >= 1 << 62:
            return None  # v1 writes "unlimited" as a page-rounded huge number
        return int(value)
    return None


class _HandedOver(subprocess.Popen[bytes]):
    """A child whose exit status belongs to someone else (``multiprocessing`` waits for it):
    never queued for ``subprocess``'s own reaping when this object is collected."""

    def __del__(self) -> None:
        pass


def spawn_passing_fds(
    path: str, args: Sequence[str], passfds: Sequence[int], env: Mapping[str, str], own_group: bool
) -> int:
    """Fork and exec ``path`` with ``args``, keeping only ``passfds`` open (what
    ``multiprocessing.util.spawnv_passfds`` does), with ``env`` as its environment and, if
    ``own_group``, as the leader of a new process group from its first instruction on.
    Returns the pid; the caller (``multiprocessing``) collects its exit status."""
    proc = _HandedOver(
        list(args),
        executable=path,
        pass_fds=tuple(sorted(int(fd) for fd in passfds)),
        close_fds=True,
        env=dict(env),
        process_group=0 if own_group else None,
        restore_signals=False,
    )
    return int(proc.pid)


# --------------------------------------------------------------------------- NOTE [fork-safe now]
# Forking a process is safe when no other thread can hold a lock the child would inherit held
# (malloc's, stdio's, the interpreter's, a library's) and no library keeps state a child cannot
# use. We do not assume it: :func:`fork_unsafe_reason` checks, at the moment of the fork, that
# the calling thread is the main one and the only Python thread, that CUDA is not initialised,
# and that ``/proc/self/task`` lists one thread once OpenBLAS's pool is stopped (OpenBLAS stops
# it itself at every fork, in a ``pthread_atfork`` handler, and restarts it at its next call;
# numpy's import starts that pool). Any other native thread (an OpenMP or MKL pool a
# parallel op started, a library's own thread) makes the answer "not safe".
def fork_unsafe_reason() -> str | None:
    """Why forking this process now is not provably safe; ``None`` when it is
    (NOTE [fork-safe now]).

    Example:
        >>> reason = fork_unsafe_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if os.environ.get(ZYGOTE_VAR) == "0":
        return f"{ZYGOTE_VAR}=0 is set"
    if not IS_LINUX or not hasattr(os, "fork"):
        return "this platform has no /proc/self/task to count threads with"
    if threading.current_thread() is not threading.main_thread():
        return "the start runs outside the main thread"
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    if others:
        return f"{len(others)} other Python thread(s) run ({', '.join(others)})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    _stop_openblas_pools()
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError as exc:
        return f"this process's threads cannot be counted (/proc/self/task: {exc.strerror})"
    if threads != 1:
        return (
            f"{threads - 1} native thread(s) run besides this one (an OpenMP or MKL thread pool "
            "that a parallel op started, or a library's own thread)"
        )
    return None


def _stop_openblas_pools() -> None:
    """Stop the thread pool of every OpenBLAS this process loaded, as its own fork handler does
    (it restarts at its next call)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return
    for path in sorted(paths):
        shutdown = _openblas_shutdown(path)
        if shutdown is not None:
            shutdown()


@functools.cache
def _openblas_shutdown(path: str) -> Callable[[], object] | None:
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:  # not a library (a deleted mapping, a data file)
        return None
    return getattr(library, "blas_thread_shutdown_", None)


def neutralise_descriptors(keep: Sequence[int]) -> None:
    """In a forked child: point every inherited pipe, socket and anonymous descriptor (epoll,
    eventfd, pidfd...) other than ``keep`` and stdin/stdout/stderr at ``/dev/null``. Their other
    ends see this process let go (EOF, a closed connection) as if it had closed them, and the
    numbers stay taken: a Python object that still holds one never closes a later descriptor.
    Files, terminals and directories stay shared, as after any fork."""
    import stat

    kept = {0, 1, 2, *keep}
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd in kept or fd == null:
                continue
            try:
                mode = os.fstat(fd).st_mode
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISDIR(mode):
                continue
            os.dup2(null, fd, inheritable=os.get_inheritable(fd))
    finally:
        os.close(null)


def show_environment(first: Sequence[str]) -> bool:
    """In a forked child that never execs: make ``/proc/<pid>/environ`` show this process's
    ``os.environ`` (the variables named in ``first`` first), as an exec with it would.

    ``/proc/<pid>/environ`` shows the memory between the ``env_start`` and ``env_end`` fields of
    ``/proc/<pid>/stat``: the block of strings the last exec left. libc's ``environ`` is moved
    to copies first (``clearenv``, then ``putenv`` of every variable), then the block is
    overwritten, as long as it holds: a variable that no longer fits is left out of the view
    (never out of the environment). Returns whether it was written (Linux only)."""
    libc = _libc()
    if libc is None or portable_only():
        return False
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[47]), int(fields[48])  # fields 50 and 51: env_start, env_end
    except (OSError, ValueError, IndexError):
        return False
    if end <= start:
        return False
    env = dict(os.environ)
    if libc.clearenv() != 0:
        return False
    for key, value in env.items():
        os.putenv(key, value)
    order = [k for k in first if k in env] + [k for k in env if k not in first]
    blob = b"".join(os.fsencode(f"{key}={env[key]}") + b"\0" for key in order)[: end - start]
    kept = blob[: blob.rfind(b"\0") + 1]  # whole entries only
    ctypes.memmove(start, kept + b"\0" * (end - start - len(kept)), end - start)
    return True
