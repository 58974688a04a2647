"""psutil helpers that find, signal and reap process trees without touching strangers.

Identity is always ``(pid, create_time)``: psutil's ``send_signal``/``terminate``/``kill``
refuse a reused pid, and nothing here calls ``waitpid(-1)``: a process is only reaped by
pid, and only when it is a child of the caller.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable

import psutil

from . import _platform
from ._tag import Tag, read_tag

__all__ = ["ProcessKey", "descendants", "kill_and_reap", "members_of_group", "tagged_processes", "unique"]

log = logging.getLogger("torchrl_ext")

ProcessKey = tuple[int, float]


def key_of(proc: psutil.Process) -> ProcessKey | None:
    try:
        return (proc.pid, proc.create_time())
    except psutil.Error:
        return None


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when ``pid`` is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def members_of_group(pgid: int, born_after: float) -> list[psutil.Process]:
    """Processes in process group ``pgid`` created at or after ``born_after``.

    The creation-time filter keeps a recycled group id from matching strangers.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        if _platform.process_group_of(proc.pid) != pgid:
            continue
        try:
            if proc.create_time() + 0.01 >= born_after:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def tagged_processes(tag: Tag, env_id: str | None = None, worker: str | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag``'s owner (and env id / worker, if given).

    Only processes born after the owner can carry its tag, so older ones are skipped before
    their environment is read (the expensive part on a machine with many processes).
    """
    found = []
    me = os.getpid()
    born_after = tag.owner_create_time - 0.01
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.create_time() < born_after:
                continue
        except psutil.Error:
            continue
        found_tag, found_worker = read_tag(proc)
        if found_tag is None or not found_tag.same_owner(tag):
            continue
        if env_id is not None and found_tag.env_id != env_id:
            continue
        if worker is not None and found_worker != worker:
            continue
        found.append(proc)
    return found


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def reap_if_child(procs: Iterable[psutil.Process]) -> None:
    """Collect the exit status of those ``procs`` that are (now) our zombie children."""
    me = os.getpid()
    for proc in procs:
        try:
            if proc.ppid() != me:
                continue
            os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            continue


def kill_and_reap(
    procs: Iterable[psutil.Process], grace: float, what: str = "process"
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """SIGTERM ``procs``, wait up to ``grace`` seconds, SIGKILL what is left, reap our children.

    Returns ``(terminated, killed)``: the processes that ended after SIGTERM and those that
    needed SIGKILL. Processes already gone are in neither list.
    """
    everything = unique(procs)
    targets = _alive(everything)
    if not targets:
        reap_if_child(everything)
        return [], []
    for proc in targets:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    gone, alive = psutil.wait_procs(targets, timeout=max(grace, 0.0))
    killed = []
    for proc in alive:
        log.warning(
            "%s %s (pid %d) ignored SIGTERM for %.1fs; sending SIGKILL", what, _name(proc), proc.pid, grace
        )
        try:
            proc.kill()
            killed.append(proc)
        except psutil.Error:
            pass
    if killed:
        psutil.wait_procs(killed, timeout=5.0)
    reap_if_child(everything)
    return list(gone), killed


def unique(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """``procs`` without duplicates (by pid and create time) and without the caller."""
    seen: set[ProcessKey] = set()
    out = []
    for proc in procs:
        key = key_of(proc)
        if key is None or key in seen or proc.pid == os.getpid():
            continue
        seen.add(key)
        out.append(proc)
    return out


def _name(proc: psutil.Process) -> str:
    try:
        return repr(proc.name())
    except psutil.Error:
        return "'?'"
