"""Process identity, liveness, the tree walk and kill-and-reap: the one copy everything calls.

Standard library and psutil only, and nothing of the package but ``_wait`` (standard library
only): the standalone reaper script loads this file by path (see ``_reaper.py``), and this file
then loads ``_wait.py`` by path too; the package imports it as ``torchrl_ext._identity``.

* **Identity** is ``(pid, create time)``: a pid can be reused, the pair cannot. The create
  time is :func:`start_time`'s: on Linux the kernel's start time in seconds since boot, which
  no change of the wall clock moves. (psutil's ``create_time()`` adds the boot time *as read
  now* to it: a wall-clock step, an NTP correction or a virtual machine resumed from a snapshot
  moves every process's ``create_time()`` at once, so an identity recorded before the step no
  longer matched: the reaper took its live owner for dead and killed its workers. Seen on a
  2-core VM after a snapshot.) Elsewhere it is ``create_time()``, recorded at the process's
  start. Create times are compared by :func:`same_ctime`: within :data:`CTIME_TOLERANCE` and,
  only where the clock is a wall clock (not Linux), give or take whole seconds of drift
  (:data:`BOOT_DRIFT`). On Linux two readings of one process's start time are the same number:
  a drift allowance there took a stranger that reused a dead worker's pid exactly one or two
  seconds (to the clock tick) after the worker's birth for the worker itself; the close then
  anchored the worker's recycled process group on it and killed the stranger's child (seen
  once under load).
* **Alive** means running and not a zombie.
* **The tree** of a set of workers (:func:`tree`) is every live process of ours: the workers,
  the descendants they have and the ones seen in earlier snapshots (a subtree whose middle
  process died is no longer anyone's child), the members of their process groups, and every
  process whose environment carries the owner's tag.
* **The live-anchor rule for process groups.** A worker's process group id is its pid. Once
  the group is empty, the id can be recycled by a stranger's new group. So a group counts only
  while it is anchored: a process of ours (identity checked) lives in it, or the caller knows
  its worker was alive a moment ago (``recent_groups``). An unanchored group is left alone, and
  so is a group whose id another process holds as its pid (a new group can only be made under
  its leader's pid: the id was recycled, whatever anchored it a moment ago).
* **Kill and reap** (:func:`kill_and_reap`): SIGTERM, a grace period, SIGKILL, then reap those
  that are our own children, by pid only (never ``waitpid(-1)``, which would steal the exit
  statuses ``subprocess`` and ``multiprocessing`` wait for).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from types import ModuleType

import psutil


def load_sibling(name: str) -> ModuleType:
    """``<name>.py`` from beside this file, by path, without importing the package (or torch);
    loaded once, as ``torchrl_ext_standalone<name>``: the reaper script's way to its modules."""
    key = f"torchrl_ext_standalone{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __package__:
    from . import _platform, _wait
else:  # loaded by path (the reaper script)
    _platform = load_sibling("_platform")
    _wait = load_sibling("_wait")

__all__ = [
    "BIRTH_SLACK",
    "BOOT_DRIFT",
    "CTIME_TOLERANCE",
    "OWNER_VAR",
    "WORKER_VAR",
    "ProcessKey",
    "alive",
    "clock",
    "descendants",
    "key_of",
    "kill_and_reap",
    "me",
    "parse_tag",
    "read_tag",
    "reap_if_child",
    "running",
    "same_ctime",
    "same_process",
    "start_time",
    "start_time_of",
    "tree",
    "unique",
]

log = logging.getLogger("torchrl_ext")

#: The inherited tag: ``<owner pid>:<owner create time>:<env id>``.
OWNER_VAR = "TORCHRL_EXT_OWNER"
#: The worker index a worker's descendants inherit.
WORKER_VAR = "TORCHRL_EXT_WORKER"
#: Two create times closer than this (seconds) belong to the same process.
CTIME_TOLERANCE = 1e-3
#: Create times are rounded to clock ticks: "born after X" allows this much (seconds).
BIRTH_SLACK = 0.01
#: How long kill-and-reap waits for a zombie child whose other threads are still exiting.
ZOMBIE_WAIT = 1.0
#: The longest pause of that wait (seconds): the threads of a zombie end within milliseconds.
REAP_POLL = 0.005
#: How long :func:`reap_later` keeps collecting, in the background, processes that a bounded
#: wait left behind (they die, and become our zombie children, after the deadline).
LATE_REAP_WINDOW = 30.0
#: The pause of :func:`reap_later` between two looks (seconds).
LATE_REAP_POLL = 0.1

ProcessKey = tuple[int, float]
#: A recorded worker: pid -> (create time, process group id).
Workers = Mapping[int, tuple[float, int]]


_me: tuple[int, ProcessKey] | None = None
#: Whether start times are read from ``/proc/PID/stat`` (Linux), and its clock's ticks/second.
_PROC_STAT = sys.platform.startswith("linux") and os.path.exists("/proc/self/stat")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if _PROC_STAT else 100


def clock() -> float:
    """Now, on :func:`start_time`'s clock (how long a process has run: ``clock() - start``).

    Example:
        >>> 0 <= clock() - start_time(psutil.Process()) < 3600 * 24 * 365
        True
    """
    return time.clock_gettime(time.CLOCK_BOOTTIME) if _PROC_STAT else time.time()


def start_time(proc: psutil.Process) -> float:
    """The create time of ``proc`` that identifies it (see the module doc, **Identity**):
    seconds since boot on Linux, unmoved by changes of the wall clock; ``create_time()``
    elsewhere. Raises ``psutil.NoSuchProcess`` when it is gone.

    Example:
        >>> start_time(psutil.Process()) == start_time(psutil.Process(os.getpid()))
        True
    """
    if not _PROC_STAT:
        return float(proc.create_time())
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(proc.pid) from None
    # Field 22 (starttime, in clock ticks since boot); the name in field 2 may hold spaces.
    return int(stat[stat.rindex(b")") + 2 :].split()[19]) / _CLOCK_TICKS


def start_time_of(pid: int) -> float | None:
    """:func:`start_time` of the process ``pid``; ``None`` once it is gone.

    Example:
        >>> start_time_of(os.getpid()) == start_time(psutil.Process())
        True
    """
    try:
        return start_time(psutil.Process(pid))
    except psutil.Error:
        return None


def parent_pids() -> dict[int, int]:
    """``{pid: parent pid}`` of every process, from one pass over the process table (each
    ``/proc/PID/stat`` read once on Linux; psutil's listing elsewhere). A process that ends
    during the pass is left out.

    Example:
        >>> parent_pids()[os.getpid()] == os.getppid()
        True
    """
    if not _PROC_STAT:
        return {proc.pid: proc.info["ppid"] for proc in psutil.process_iter(["ppid"])}
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Field 4 (ppid); the name in field 2 may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split(None, 2)
        if len(fields) >= 2:
            found[int(name)] = int(fields[1])
    return found


def me() -> ProcessKey:
    """``(pid, create_time)`` of the calling process (read once per process, forks included).

    Example:
        >>> me()[0] == os.getpid()
        True
    """
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, (pid, start_time(psutil.Process(pid))))
    return _me[1]


def key_of(proc: psutil.Process) -> ProcessKey | None:
    """``(pid, create_time)`` of ``proc``; ``None`` once it is gone."""
    try:
        return (proc.pid, start_time(proc))
    except psutil.Error:
        return None


#: How many whole seconds two readings of one process's create time may differ by where it is
#: psutil's ``create_time()`` (boot time re-read after wall-clock adjustments; the fraction must
#: still match to CTIME_TOLERANCE); 0 where it is the kernel's start time (Linux): no drift.
BOOT_DRIFT = 0 if _PROC_STAT else 2


def same_ctime(a: float, b: float) -> bool:
    """Whether two create times are one process's (see the module doc, **Identity**).

    Example:
        >>> same_ctime(100.25, 100.2504), same_ctime(100.25, 100.26)
        (True, False)
        >>> same_ctime(100.25, 101.25) == (BOOT_DRIFT >= 1)  # a whole second apart: Linux says no
        True
    """
    shift = round(a - b)
    return abs(shift) <= BOOT_DRIFT and abs(a - b - shift) < CTIME_TOLERANCE


def same_process(pid: int, ctime: float) -> psutil.Process | None:
    """The process ``pid`` if it still is the one created at ``ctime`` (not a reused pid).

    Example:
        >>> me = psutil.Process()
        >>> same_process(me.pid, start_time(me)) == me
        True
        >>> same_process(me.pid, start_time(me) - 10) is None
        True
    """
    try:
        proc = psutil.Process(pid)
        return proc if same_ctime(start_time(proc), ctime) else None
    except psutil.Error:
        return None


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` (the very process, psutil checks the pid was not reused) runs and is
    not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(pid: int, ctime: float | None = None) -> bool:
    """Whether ``pid`` is alive and, when ``ctime`` is given, is the process created then."""
    try:
        proc = psutil.Process(pid) if ctime is None else same_process(pid, ctime)
    except psutil.Error:
        return False
    return proc is not None and alive(proc)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when ``pid`` is gone). A process without a
    child (most workers, most of the time) is told by its own ``/proc`` files, without the
    scan of every process that listing descendants takes (``_platform.has_children``)."""
    return descendants_of([pid])[pid]


def descendants_of(pids: Iterable[int]) -> dict[int, list[psutil.Process]]:
    """:func:`descendants` of each of ``pids``, from at most one pass over the process table
    (not one pass per pid), and none where each of them shows it has no child.

    The same rule as psutil's ``children(recursive=True)``: a process counts only if it was
    created no earlier than the pid it descends from (else its pid was reused). A gone pid
    maps to an empty list."""
    out: dict[int, list[psutil.Process]] = {pid: [] for pid in pids}
    # A process whose own /proc files show no child needs no pass (``_platform.has_children``).
    roots = [pid for pid in out if _platform.has_children(pid) is not False]
    if not roots:
        return out
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_pids().items():
        children.setdefault(ppid, []).append(pid)
    for root in roots:
        found = out[root]
        try:
            root_ctime = psutil.Process(root).create_time()
        except psutil.Error:
            continue
        seen = {root}
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child in seen:  # pids reused during the pass can make a cycle
                    continue
                seen.add(child)
                try:
                    proc = psutil.Process(child)
                    if proc.create_time() >= root_ctime:
                        found.append(proc)
                        stack.append(child)
                except psutil.Error:
                    pass
    return out


def unique(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """``procs`` without duplicates (by identity) and without the caller."""
    seen: set[ProcessKey] = set()
    me = os.getpid()
    out = []
    for proc in procs:
        key = key_of(proc)
        if key is None or key in seen or proc.pid == me:
            continue
        seen.add(key)
        out.append(proc)
    return out


# --------------------------------------------------------------------------- the tag
def parse_tag(value: str) -> tuple[int, float, str] | None:
    """``(owner pid, owner create time, env id)`` of a tag value, or ``None``."""
    parts = value.split(":")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0]), float(parts[1]), parts[2]
    except ValueError:
        return None


def read_tag(proc: psutil.Process) -> tuple[tuple[int, float, str] | None, str | None]:
    """The parsed tag and the worker index ``proc`` carries in its environment, if readable."""
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return None, None
    value = env.get(OWNER_VAR)
    if value is None:
        return None, None
    return parse_tag(value), env.get(WORKER_VAR)


# --------------------------------------------------------------------------- the tree walk
def tree(
    workers: Workers,
    seen: Iterable[psutil.Process] = (),
    *,
    owner: ProcessKey | None = None,
    env_id: str | None = None,
    worker_index: str | None = None,
    recent_groups: Iterable[int] = (),
    include_workers: bool = True,
    dying: bool = False,
) -> list[psutil.Process]:
    """Every live process of ours, each once (see the module doc), and those of them that are
    the caller's zombie children (so that :func:`kill_and_reap` collects them).

    With ``dying``, also the zombies of the tree that are still another process's: the
    children of a worker that is exiting, which the kernel re-parents to this subreaper a
    moment later (its pipe closes before its children are handed over). Collect them with
    :func:`reap_if_child` once that worker is reaped (NOTE [shutdown order]).

    Args:
        workers: the recorded workers, pid -> (create time, process group).
        seen: descendants recorded in earlier snapshots; counted while they still run.
        owner: ``(pid, create time)`` of the owner whose tag counts; ``None``: no tag scan.
        env_id, worker_index: narrow the tag match to one env, one worker.
        recent_groups: groups whose worker the caller knows was alive a moment ago.
        include_workers: list the live workers themselves too.
    """
    me = os.getpid()
    found: dict[ProcessKey, psutil.Process] = {}
    anchors: list[psutil.Process] = []
    for pid, (ctime, _pgid) in workers.items():
        worker = same_process(pid, ctime)
        if worker is None:
            continue
        anchors.append(worker)
        for proc in [worker, *descendants(pid)] if include_workers else descendants(pid):
            key = key_of(proc)
            if key is not None:
                found[key] = proc
    for proc in seen:
        key = key_of(proc)
        if key is not None and (alive(proc) or _our_zombie(proc) or (dying and _zombie(proc.pid))):
            found[key] = proc
    anchored = set(recent_groups)
    for proc in [*anchors, *found.values()]:
        try:
            anchored.add(os.getpgid(proc.pid))
        except OSError:
            continue
    groups = {
        pgid: ctime for ctime, pgid in workers.values() if pgid in anchored and not _recycled(pgid, ctime)
    }
    if groups or owner is not None:
        oldest = min([*groups.values(), *([owner[1]] if owner else [])])
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            try:
                ctime = start_time(proc)
                if ctime + BIRTH_SLACK < oldest:
                    continue  # older than every worker and the owner: cannot be ours
                pgid = os.getpgid(proc.pid)
            except (psutil.Error, OSError):
                continue
            if pgid in groups and ctime + BIRTH_SLACK >= groups[pgid]:
                found[(proc.pid, ctime)] = proc
                continue
            if owner is None or ctime + BIRTH_SLACK < owner[1]:
                continue
            tag, index = read_tag(proc)
            if (
                tag is not None
                and tag[0] == owner[0]
                and same_ctime(tag[1], owner[1])
                and (env_id is None or tag[2] == env_id)
                and (worker_index is None or index == worker_index)
            ):
                found[(proc.pid, ctime)] = proc
    excluded: dict[int, tuple[float, int]] = {} if include_workers else dict(workers)

    def wanted(key: ProcessKey) -> bool:
        pid, ctime = key
        if pid == me:
            return False
        return pid not in excluded or not same_ctime(ctime, excluded[pid][0])

    # Our own zombie children are kept too, so that kill-and-reap collects them: a worker's
    # descendants that died with it (a SIGTERM to its process group) were re-parented to us,
    # the child subreaper, and nobody else will wait for them.
    def kept(proc: psutil.Process) -> bool:
        return alive(proc) or _our_zombie(proc) or (dying and _zombie(proc.pid))

    return [proc for key, proc in found.items() if wanted(key) and kept(proc)]


def _recycled(pgid: int, leader_ctime: float) -> bool:
    """Whether process group id ``pgid`` (our worker's pid, created at ``leader_ctime``) now names
    a stranger's group: a process other than our worker holds that pid, so the id was handed out
    again and any group by that id is the new holder's (the live-anchor rule's other half)."""
    try:
        holder = psutil.Process(pgid)
        return not same_ctime(start_time(holder), leader_ctime)
    except psutil.Error:
        return False  # nobody holds the pid: the group cannot have been recreated under it


def _our_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() == os.getpid()
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- kill and reap
def reap_if_child(procs: Iterable[psutil.Process], wait: float = 0.0) -> None:
    """Collect the exit status of those ``procs`` that are (now) our zombie children.

    A zombie whose other threads are still exiting cannot be collected yet (``waitpid``
    returns 0): such ones are retried for up to ``wait`` seconds.
    """
    me = os.getpid()
    pending = []
    for proc in procs:
        try:
            if proc.ppid() == me:
                pending.append(proc.pid)
        except psutil.Error:
            continue

    def collected() -> bool:
        left = []
        for pid in pending:
            try:
                if os.waitpid(pid, os.WNOHANG) == (0, 0) and _zombie(pid):
                    left.append(pid)
            except (ChildProcessError, OSError):
                continue
        pending[:] = left
        return not pending

    _wait.wait_for(collected, time.monotonic() + wait, "zombies not collected", slice=REAP_POLL)


def reap_later(procs: Iterable[psutil.Process], window: float = LATE_REAP_WINDOW) -> None:
    """Collect, from a daemon thread, those of ``procs`` that become our zombie children within
    ``window`` seconds: what a deadline-bounded close could not wait for (a DataLoader worker
    of a SIGTERMed worker, re-parented to this subreaper, that dies a moment later). A process
    is only collected while it still is the one recorded (pid and create time)."""
    pending = [proc for proc in unique(procs) if key_of(proc) is not None]
    if not pending:
        return

    def collected() -> bool:
        same = [proc for proc in pending if proc.is_running()]  # is_running checks the create time
        reap_if_child(same)  # collects only those that have exited
        pending[:] = [proc for proc in same if proc.is_running()]
        return not pending

    def collect() -> None:
        # A sweep over seconds, in the background: a look every 0.1 s from the first keeps it cheap.
        deadline, pause = time.monotonic() + window, LATE_REAP_POLL
        _wait.wait_for(collected, deadline, "not collected in time", first=pause, slice=pause)

    threading.Thread(target=collect, name="torchrl_ext-late-reaper", daemon=True).start()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_and_reap(
    procs: Iterable[psutil.Process],
    grace: float,
    what: str = "process",
    kill_wait: float = 5.0,
    collect_late: bool = False,
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """SIGTERM ``procs``, wait up to ``grace`` seconds, SIGKILL what is left, reap our children.

    ``grace <= 0`` sends SIGKILL at once. With ``collect_late`` (a parent process: the owner),
    those that could not be collected within the waits (a multi-threaded zombie, a process
    re-parented to us a moment later) are collected when they can be (:func:`reap_later`).
    Returns ``(terminated, killed)``: the processes that ended after SIGTERM and those that
    needed SIGKILL; those already gone are in neither.
    """
    everything = unique(procs)
    targets = [proc for proc in everything if alive(proc)]
    terminated: list[psutil.Process] = []
    pending = targets
    if targets and grace > 0:
        for proc in targets:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        gone, pending = psutil.wait_procs(targets, timeout=grace)
        terminated = list(gone)
        for proc in pending:
            log.warning(
                "%s %s (pid %d) ignored SIGTERM for %.1fs; sending SIGKILL",
                what,
                _name(proc),
                proc.pid,
                grace,
            )
    killed = []
    for proc in pending:
        try:
            proc.kill()
            killed.append(proc)
        except psutil.Error:
            pass
    if killed:
        psutil.wait_procs(killed, timeout=kill_wait)
    reap_if_child(everything, wait=min(kill_wait, ZOMBIE_WAIT))
    if collect_late:
        reap_later(everything)
    return terminated, killed


def _name(proc: psutil.Process) -> str:
    try:
        return repr(proc.name())
    except psutil.Error:
        return "'?'"
