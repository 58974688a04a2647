"""Find (and end) processes left behind by managed envs, for the report and the CLI.

``python -m torchrl_ext sweep`` lists every process whose ``TORCHRL_EXT_OWNER`` tag names an
owner that is gone (its pid is dead, or was reused: the create time differs); ``--kill`` ends
them (SIGTERM, a grace period, SIGKILL). Useful after a node-wide crash took the reaper down
with everything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from ._process_tree import kill_and_reap
from ._tag import Tag, read_tag

__all__ = ["TaggedProcess", "find_orphans", "leftover_processes", "sweep_orphans"]


@dataclass(frozen=True)
class TaggedProcess:
    """A process carrying a ``TORCHRL_EXT_OWNER`` tag."""

    process: psutil.Process
    tag: Tag
    worker: str | None

    def describe(self) -> str:
        try:
            cmd = " ".join(self.process.cmdline())[:100]
        except psutil.Error:
            cmd = "?"
        return (
            f"pid {self.process.pid} (env {self.tag.env_id}, worker {self.worker or '?'}, "
            f"owner pid {self.tag.owner_pid}): {cmd}"
        )


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


def find_orphans() -> list[TaggedProcess]:
    """Tagged processes whose owner process no longer exists."""
    return [t for t in _tagged() if not t.tag.owner_alive()]


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


def sweep_orphans(kill: bool, grace: float = 3.0) -> tuple[list[TaggedProcess], list[TaggedProcess]]:
    """Find orphans; with ``kill`` end them. Returns ``(found, still_alive)``."""
    found = find_orphans()
    if kill and found:
        kill_and_reap([t.process for t in found], grace, what="orphaned torchrl_ext")
    alive = [t for t in found if t.process.is_running() and _not_zombie(t.process)]
    return found, alive


def _not_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
