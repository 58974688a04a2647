"""The inherited environment-variable tag that marks every process of a managed env.

``TORCHRL_EXT_OWNER=<owner pid>:<owner create_time>:<env id>`` is set inside each worker
before the user's env exists, so every process the env starts inherits it. The final sweep,
the external reaper and ``python -m torchrl_ext sweep`` use it to find escapees (for example a
simulator started with ``start_new_session=True``).

Caveat: ``/proc/<pid>/environ`` shows the environment a process had at its last ``exec``. A
descendant that was *forked* without exec (a fork-context DataLoader worker) shows its
parent's exec-time environment; those are found through their process group and the
recorded process tree instead.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import psutil

from . import _identity
from ._identity import OWNER_VAR, WORKER_VAR

__all__ = ["OWNER_VAR", "WORKER_VAR", "Tag", "new_env_tag", "read_tag"]

_env_counter = itertools.count(1)


@dataclass(frozen=True)
class Tag:
    """A parsed ``TORCHRL_EXT_OWNER`` value."""

    owner_pid: int
    owner_create_time: float
    env_id: str

    def __str__(self) -> str:
        return f"{self.owner_pid}:{self.owner_create_time:.6f}:{self.env_id}"

    @classmethod
    def parse(cls, value: str) -> Tag | None:
        parsed = _identity.parse_tag(value)
        return None if parsed is None else cls(*parsed)

    @property
    def owner(self) -> _identity.ProcessKey:
        """``(pid, create time)`` of the owning process."""
        return (self.owner_pid, self.owner_create_time)

    def same_owner(self, other: Tag) -> bool:
        return (
            self.owner_pid == other.owner_pid
            and abs(self.owner_create_time - other.owner_create_time) < _identity.CTIME_TOLERANCE
        )

    def owner_alive(self) -> bool:
        """Whether the owning process still runs (a reused pid does not count)."""
        return _identity.running(self.owner_pid, self.owner_create_time)


def new_env_tag() -> Tag:
    """A fresh tag for one env owned by the calling process."""
    me = psutil.Process(os.getpid())
    return Tag(me.pid, me.create_time(), f"{os.getpid()}.{next(_env_counter)}")


def read_tag(proc: psutil.Process) -> tuple[Tag | None, str | None]:
    """The tag and worker index a process carries in its environment, if readable."""
    parsed, worker = _identity.read_tag(proc)
    return (None if parsed is None else Tag(*parsed)), worker
