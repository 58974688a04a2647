"""Find (and end) processes left behind by managed envs, for the report and the CLI.

``python -m torchrl_ext sweep`` lists the processes of managed envs whose owner is gone (its pid
is dead, or was reused: the create time differs), found two ways:

* by tag: the process's ``TORCHRL_EXT_OWNER`` names the owner (every process exec'd below a
  worker, whatever it did to its session or process group);
* by registry: the reaper's ``registry.json`` in the owner's runtime directory
  (``$TMPDIR/torchrl_ext-<owner pid>-*``) names the workers and the descendants it saw, which
  covers processes forked without ``exec`` (their ``/proc/PID/environ`` predates the tag).

``--kill`` ends them (SIGTERM, a grace period, SIGKILL) and removes the runtime directories of
dead owners. Useful after a node-wide crash took the reaper down with everything else.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

import psutil

from ._process_tree import key_of, kill_and_reap
from ._reaper import REGISTRY_NAME, read_registry
from ._tag import Tag, read_tag

__all__ = ["Orphan", "find_orphans", "leftover_processes", "stale_runtime_dirs", "sweep_orphans"]

_RUNTIME_DIR = re.compile(r"torchrl_ext-(\d+)-")


@dataclass(frozen=True)
class Orphan:
    """A process left by a managed env whose owner is gone."""

    process: psutil.Process
    owner_pid: int
    #: ``"tag"`` (its environment names the owner) or ``"registry"`` (the owner's reaper saw it).
    found_by: str
    env_id: str | None = None
    worker: str | None = None

    def describe(self) -> str:
        try:
            cmd = " ".join(self.process.cmdline())[:100]
        except psutil.Error:
            cmd = "?"
        where = f"env {self.env_id}, worker {self.worker or '?'}, " if self.env_id else ""
        return f"pid {self.process.pid} ({where}owner pid {self.owner_pid}, found by {self.found_by}): {cmd}"


@dataclass(frozen=True)
class TaggedProcess:
    """A process carrying a ``TORCHRL_EXT_OWNER`` tag."""

    process: psutil.Process
    tag: Tag
    worker: str | None


def _tagged() -> list[TaggedProcess]:
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        tag, worker = read_tag(proc)
        if tag is None:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found.append(TaggedProcess(proc, tag, worker))
    return found


def _owner_alive(pid: int, ctime: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        if ctime is not None and abs(proc.create_time() - ctime) >= 1e-3:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stale_runtime_dirs(base: str | None = None) -> list[str]:
    """Runtime directories (``torchrl_ext-<owner pid>-*`` under ``base``, default the temporary
    directory) whose owner is gone: the registry's owner identity when there is one, else the
    pid in the name."""
    stale = []
    for path in glob.glob(os.path.join(base or tempfile.gettempdir(), "torchrl_ext-*")):
        match = _RUNTIME_DIR.match(os.path.basename(path))
        if match is None or not os.path.isdir(path):
            continue
        registry = read_registry(os.path.join(path, REGISTRY_NAME))
        if registry is not None:
            alive = _owner_alive(registry[0], registry[1])
        else:
            alive = _owner_alive(int(match.group(1)), None)
        if not alive:
            stale.append(path)
    return stale


def find_orphans(base: str | None = None) -> list[Orphan]:
    """Processes of managed envs whose owner process no longer exists (by tag and by registry)."""
    found: dict[tuple[int, float], Orphan] = {}
    for t in _tagged():
        key = key_of(t.process)
        if key is not None and not t.tag.owner_alive():
            found[key] = Orphan(t.process, t.tag.owner_pid, "tag", t.tag.env_id, t.worker)
    for path in stale_runtime_dirs(base):
        registry = read_registry(os.path.join(path, REGISTRY_NAME))
        if registry is None:
            continue
        owner_pid, _ctime, procs = registry
        for proc in procs:
            key = key_of(proc)
            if key is not None and key not in found and proc.pid != os.getpid():
                found[key] = Orphan(proc, owner_pid, "registry")
    return list(found.values())


def leftover_processes(owner_pid: int | None = None) -> list[psutil.Process]:
    """Live tagged processes of ``owner_pid`` (default: this process) and its live children
    that are not multiprocessing's own helpers. Empty once every env was closed.

    Example:
        >>> leftover_processes()
        []
    """
    owner = os.getpid() if owner_pid is None else owner_pid
    out = [t.process for t in _tagged() if t.tag.owner_pid == owner]
    try:
        children = psutil.Process(owner).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            cmd = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if "multiprocessing.forkserver" in cmd or "resource_tracker" in cmd or "_reaper.py" in cmd:
            continue
        if child not in out:
            out.append(child)
    return out


def sweep_orphans(
    kill: bool, grace: float = 3.0, base: str | None = None
) -> tuple[list[Orphan], list[Orphan], list[str]]:
    """Find orphans; with ``kill`` end them and remove the runtime directories of dead owners.

    Returns ``(found, still_alive, removed_dirs)``.
    """
    found = find_orphans(base)
    if kill and found:
        kill_and_reap([t.process for t in found], grace, what="orphaned torchrl_ext")
    alive = [t for t in found if t.process.is_running() and _not_zombie(t.process)]
    removed = []
    if kill and not alive:
        for path in stale_runtime_dirs(base):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return found, alive, removed


def _not_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
