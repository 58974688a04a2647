"""The inherited environment-variable tag that marks every process of a managed env.

``TORCHRL_EXT_OWNER=<owner pid>:<owner create_time>:<env id>`` is set inside each worker
before the user's env exists, so every process the env starts inherits it. The final sweep,
the external reaper and ``python -m torchrl_ext sweep`` use it to find escapees (for example a
simulator started with ``start_new_session=True``).

Caveat: ``/proc/<pid>/environ`` shows the environment a process had at its last ``exec``. A
descendant that was *forked* without exec (a fork-context DataLoader worker) shows its
parent's exec-time environment; those are found through their process group and the
recorded process tree instead.

NOTE [tagged at birth]
----------------------
A spawned worker spends seconds importing torch before its own set-up runs; a worker of
CPython's fork server is a fork of a process we did not start. Were the owner SIGKILLed in that
window, neither would be known to anyone. So while a managed env starts processes
(:func:`tagged_starts`), ``multiprocessing``'s exec of a spawned child carries the tag in its
*exec* environment and leads its own process group from its first instruction, and CPython's
fork server, when this start launches it, carries an owner-wide tag (env id
``<pid>.mpforkserver``) that every process it forks shows too. The external reaper's tag scan
finds all of them the moment the owner dies; each spawned worker is also reported to the
reaper as soon as its pid exists. ``multiprocessing``'s resource tracker is left untagged: it
unlinks what dead processes leaked and exits by itself once they are gone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from . import _cpython, _identity, _platform, _reaper_client
from ._identity import OWNER_VAR, WORKER_VAR
from ._patch import ScopedPatch

__all__ = ["OWNER_VAR", "WORKER_VAR", "Tag", "new_env_tag", "read_tag", "tagged_starts"]

#: Env id suffix of the tag CPython's own fork server gets (NOTE [tagged at birth]).
MP_FORKSERVER_SUFFIX = "mpforkserver"

_env_counter = itertools.count(1)


@dataclass(frozen=True)
class Tag:
    """A parsed ``TORCHRL_EXT_OWNER`` value."""

    owner_pid: int
    owner_create_time: float
    env_id: str

    def __str__(self) -> str:
        return f"{self.owner_pid}:{self.owner_create_time:.6f}:{self.env_id}"

    @property
    def owner(self) -> _identity.ProcessKey:
        """``(pid, create time)`` of the owning process."""
        return (self.owner_pid, self.owner_create_time)

    def owner_alive(self) -> bool:
        """Whether the owning process still runs (a reused pid does not count)."""
        return _identity.running(self.owner_pid, self.owner_create_time)


def new_env_tag() -> Tag:
    """A fresh tag for one env owned by the calling process."""
    pid, ctime = _identity.me()
    return Tag(pid, ctime, f"{pid}.{next(_env_counter)}")


def read_tag(proc: psutil.Process) -> tuple[Tag | None, str | None]:
    """The tag and worker index a process carries in its environment, if readable."""
    parsed, worker = _identity.read_tag(proc)
    return (None if parsed is None else Tag(*parsed)), worker


# --------------------------------------------------------------------------- NOTE [tagged at birth]
_birth = threading.local()


def _tagging_spawnv(previous: Callable[..., int]) -> Callable[..., int]:
    def spawnv_passfds(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        tag: Tag | None = getattr(_birth, "tag", None)
        kind = None if tag is None else _cpython.spawned_kind(args)
        if tag is None or kind is None:
            return previous(path, args, passfds)
        env = dict(os.environ)
        if kind == "worker":
            env[OWNER_VAR] = str(tag)
            env.pop(WORKER_VAR, None)  # set by the worker itself, with its index
        else:
            server_id = f"{tag.owner_pid}.{MP_FORKSERVER_SUFFIX}"
            env[OWNER_VAR] = str(Tag(tag.owner_pid, tag.owner_create_time, server_id))
            env[WORKER_VAR] = MP_FORKSERVER_SUFFIX
        pid = _platform.spawn_passing_fds(path, args, passfds, env, own_group=kind == "worker")
        ctime = _identity.start_time_of(pid)
        if ctime is None:  # already gone: nothing to watch
            return pid
        if kind == "worker":
            _reaper_client.watch(pid, ctime, pid)
        else:  # the fork server is shared: its tag alone marks it, and it ends with its owner
            _reaper_client.add_helper(pid, ctime)
        return pid

    spawnv_passfds.__wrapped__ = previous  # type: ignore[attr-defined]
    return spawnv_passfds


_SPAWN_PATCH = ScopedPatch(*_cpython.spawn_patch_target(), _tagging_spawnv)


def tagged_starts(tag: Tag, start_method: str, preloaded: bool) -> contextlib.AbstractContextManager[None]:
    """Around starting processes by ``start_method`` (``preloaded``: forks of the preloaded
    server): the patch below where ``multiprocessing`` execs them (spawn, or CPython's fork
    server); a fork, or a fork of the preloaded server, execs nothing and needs none."""
    if preloaded or start_method == "fork":
        return contextlib.nullcontext()
    return _tagged_spawns(tag)


@contextlib.contextmanager
def _tagged_spawns(tag: Tag) -> Iterator[None]:
    """While active, processes that ``multiprocessing`` spawns from this thread carry ``tag``
    from their exec on (NOTE [tagged at birth])."""
    previous: Any = getattr(_birth, "tag", None)
    _birth.tag = tag
    try:
        with _SPAWN_PATCH.active():
            yield
    finally:
        _birth.tag = previous
