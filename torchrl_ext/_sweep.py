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
from collections.abc import Collection
from dataclasses import dataclass

import psutil

from . import _cpython, _forkserver
from ._identity import alive, descendants, key_of, kill_and_reap, running
from ._reaper import REGISTRY_NAME, Registry, load_registry
from ._tag import Tag, read_tag

__all__ = [
    "Orphan",
    "RuntimeDir",
    "find_orphans",
    "leftover_processes",
    "stale_runtime_dirs",
    "sweep_orphans",
]

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
        if alive(proc):
            found.append(TaggedProcess(proc, tag, worker))
    return found


@dataclass(frozen=True)
class RuntimeDir:
    """A ``torchrl_ext-<owner pid>-*`` directory (the reaper's FIFO, registry, error reports)."""

    path: str
    owner_pid: int
    registry: Registry | None


def stale_runtime_dirs(base: str | None = None, owners: Collection[int] | None = None) -> list[RuntimeDir]:
    """Runtime directories under ``base`` (default: the temporary directory) whose owner is gone:
    by the registry's owner identity when there is one, else by the pid in the name. ``owners``
    limits them to those pids."""
    stale = []
    for path in glob.glob(os.path.join(base or tempfile.gettempdir(), "torchrl_ext-*")):
        match = _RUNTIME_DIR.match(os.path.basename(path))
        if match is None or not os.path.isdir(path):
            continue
        registry = load_registry(os.path.join(path, REGISTRY_NAME))
        owner_pid = registry.owner_pid if registry is not None else int(match.group(1))
        if owners is not None and owner_pid not in owners:
            continue
        if not running(owner_pid, registry.owner_ctime if registry is not None else None):
            stale.append(RuntimeDir(path, owner_pid, registry))
    return stale


def find_orphans(base: str | None = None, owners: Collection[int] | None = None) -> list[Orphan]:
    """Processes of managed envs whose owner process no longer exists, found by tag and through
    the registries in ``base`` (default: the temporary directory); ``owners`` limits them to
    those owner pids."""
    found: dict[tuple[int, float], Orphan] = {}
    for t in _tagged():
        key = key_of(t.process)
        if owners is not None and t.tag.owner_pid not in owners:
            continue
        if key is not None and not t.tag.owner_alive():
            found[key] = Orphan(t.process, t.tag.owner_pid, "tag", t.tag.env_id, t.worker)
    for runtime_dir in stale_runtime_dirs(base, owners):
        if runtime_dir.registry is None:
            continue
        for proc in runtime_dir.registry.leftovers():
            key = key_of(proc)
            if key is not None and key not in found and proc.pid != os.getpid():
                found[key] = Orphan(proc, runtime_dir.owner_pid, "registry")
    return list(found.values())


def leftover_processes(owner_pid: int | None = None) -> list[psutil.Process]:
    """Live tagged processes of ``owner_pid`` (default: this process) and its live children
    that are not multiprocessing's own helpers. Empty once every env was closed.

    Example:
        >>> leftover_processes()
        []
    """
    owner = os.getpid() if owner_pid is None else owner_pid
    # This process's preloaded fork server lives as long as it does, as multiprocessing's own.
    server = _forkserver.server_key() if owner == os.getpid() else None

    def helper(proc: psutil.Process) -> bool:
        """Lives as long as the owner: our server, the reaper (and its own fork), and the
        owner's children CPython's fork server (tagged at birth when a managed env started
        it) and resource tracker; never a process forked by a server, which shows its
        server's command line."""
        try:
            cmd = " ".join(proc.cmdline())
            parent = proc.ppid()
        except psutil.Error:
            return True  # gone
        if key_of(proc) == server or "_reaper.py" in cmd:
            return True
        return parent == owner and _cpython.is_multiprocessing_helper(cmd)

    out = [t.process for t in _tagged() if t.tag.owner_pid == owner and not helper(t.process)]
    for child in descendants(owner):
        if alive(child) and not helper(child) and child not in out:
            out.append(child)
    return out


def sweep_orphans(
    kill: bool, grace: float = 3.0, base: str | None = None, owners: Collection[int] | None = None
) -> tuple[list[Orphan], list[Orphan], list[str]]:
    """Find orphans; with ``kill`` end them, then remove the runtime directory of each dead owner
    none of whose processes is left. ``base`` and ``owners`` as for :func:`find_orphans`.

    Returns ``(found, still_alive, removed_dirs)``.
    """
    found = find_orphans(base, owners)
    if kill and found:
        kill_and_reap([t.process for t in found], grace, what="orphaned torchrl_ext")
    survivors = [t for t in found if alive(t.process)]
    removed = []
    if kill:
        blocked = {t.owner_pid for t in survivors}
        for runtime_dir in stale_runtime_dirs(base, owners):
            if runtime_dir.owner_pid in blocked:
                continue
            shutil.rmtree(runtime_dir.path, ignore_errors=True)
            if not os.path.exists(runtime_dir.path):
                removed.append(runtime_dir.path)
    return found, survivors, removed
