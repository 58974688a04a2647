"""Several envs per worker process (``envs_per_worker``): which slots share a process, and how.

TorchRL starts one process per env. With more envs than cores, most of a batched step goes to
waking processes and refilling caches; ``envs_per_worker=k`` groups the slots ``k`` at a time
(``0..k-1``, ``k..2k-1``, ...) and each group's envs live in one process, the *host*::

    start (main process)                          host process (slots a..b)
    --------------------                          --------------------------
    TorchRL's _start_workers, per slot:           _worker.run_managed:
      Process(...).start()  -- held back by         one _Member per slot (its recorder, its plan)
      co_hosting for every slot of a group          TorchRL's worker loop per slot, one thread
      but its last; the last slot's process         each (the process's own slot: the main one)
      starts with the others' kwargs beside
      its own (ConfiguredKwargs.hosted)
    the held-back Process objects share the       a..b answer every TorchRL command on their own
      host's Popen (_cpython.share_popen)           pipes, as one worker each would

    a batched step (_step_path), per slot:
      channel a: HOST_STEP_WIRE  --- one write -->  slot a's recorder: steps a, then a+1..b
      channels a+1..b: nothing written               (planned copies; one wake-up byte, the last)
      (each records the step as sent)
    every slot's done flag, as before  <-------------

**Who decides.** The main process, once per start: a group is *stepped as one* when every one of
its slots' workers will plan its steps (``_step_path.kwargs_reason`` on the same kwargs the
worker reads); the host's own config says so (``WorkerConfig.host_step``). A group whose workers
cannot plan (TorchRL's path) keeps its slots in one process, each answering its own messages.

**Losses.** A host's slots live and die together: a host that dies (killed, hung, or an env
that raised) is a loss of every slot in it, each replaced as a process of its own
(restarts, within ``max_restarts``); the first replacement breaks the group
(:meth:`Hosts.break_group`), and every slot of it is told its steps itself from then on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.process
import os
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

from . import _cpython
from ._compat import WORKER_KWARGS
from ._patch import ScopedPatch
from ._step_path import kwargs_reason

__all__ = ["HOST_STEP", "HOST_STEP_BYTES", "HOST_STEP_WIRE", "Hosts", "co_hosting"]

#: The message a host's first slot gets for a batched step of every env of the host (ours
#: only: TorchRL's loop never sees it).
HOST_STEP: tuple[str, None] = ("torchrl_ext.host_step", None)
#: The same, pickled once: what the host's first worker compares before unpickling anything.
HOST_STEP_BYTES: bytes = bytes(ForkingPickler.dumps(HOST_STEP))
#: The same, framed as ``Connection.send_bytes`` frames it (written in one system call).
HOST_STEP_WIRE: bytes = struct.pack("!i", len(HOST_STEP_BYTES)) + HOST_STEP_BYTES

#: How a slot's channel carries a batched step of our path (``_channel``): ``"host"``: it tells
#: the whole host (:data:`HOST_STEP_WIRE`); ``"carried"``: nothing is written (its host's first
#: slot was told); ``None``: the slot's own step, as without hosts.
StepRole = Literal["host", "carried"] | None


class Hosts:
    """The groups of one start of one env (made by :func:`co_hosting`, read by the supervisor).

    Example:
        >>> hosts = Hosts(5, 2)
        >>> hosts.groups
        [(0, 1), (2, 3), (4,)]
        >>> hosts.stepped_as_one = [True, True, True]
        >>> [hosts.role(slot) for slot in range(5)]
        ['host', 'carried', 'host', 'carried', None]
        >>> _ = hosts.break_group(3); [hosts.role(slot) for slot in range(4)]
        ['host', 'carried', None, None]
    """

    def __init__(self, workers: int, size: int) -> None:
        #: Envs per host (``envs_per_worker``), and the groups of slots it makes. Fixed.
        self.size = size
        self.groups: list[tuple[int, ...]] = [
            tuple(range(first, min(workers, first + size))) for first in range(0, workers, size)
        ]
        #: By group: whether a batched step tells the host once (its workers all plan their
        #: steps); written by the start (:class:`_HeldStarts`), once per group.
        self.stepped_as_one = [False] * len(self.groups)
        #: By group: whether its host still runs all its slots; cleared by :meth:`break_group`.
        self.intact = [True] * len(self.groups)

    def group_of(self, slot: int) -> int:
        return slot // self.size

    def role(self, slot: int) -> StepRole:
        """How ``slot``'s channel carries a batched step of our path (:data:`StepRole`)."""
        group = self.group_of(slot)
        members = self.groups[group]
        if len(members) < 2 or not (self.intact[group] and self.stepped_as_one[group]):
            return None
        return "host" if slot == members[0] else "carried"

    def hosted(self, slot: int) -> tuple[int, ...]:
        """The slots whose process is ``slot``'s (itself alone once its group is broken)."""
        group = self.group_of(slot)
        return self.groups[group] if self.intact[group] else (slot,)

    def break_group(self, slot: int) -> list[int]:
        """``slot``'s worker is replaced: its host is gone, every slot of it steps alone from
        now on. Returns the group's slots whose role changed (empty: already broken)."""
        group = self.group_of(slot)
        if not self.intact[group]:
            return []
        self.intact[group] = False
        return list(self.groups[group]) if len(self.groups[group]) > 1 else []


# --------------------------------------------------------------------------- the start
_holding = threading.local()


def _held_start(previous: Any) -> Any:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        held = getattr(_holding, "starts", None)
        if held is None:
            previous(self)
        else:
            held.start(self, previous)

    start.__wrapped__ = previous  # type: ignore[attr-defined]
    return start


_START_PATCH = ScopedPatch(multiprocessing.process.BaseProcess, "start", _held_start)


class _HeldStarts:
    """The starts of one env's workers while :func:`co_hosting` is active (this thread only)."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        #: The held-back slots of the group being started: process, kwargs, pipe duplicate.
        self.held: list[tuple[Any, dict[str, Any], Connection]] = []

    def start(self, process: Any, previous: Any) -> None:
        key = WORKER_KWARGS["env_kwargs"]
        kwargs = _cpython.process_kwargs(process)
        configured: Any = kwargs.get(key)  # an _intercept.ConfiguredKwargs where it is one of ours
        if getattr(configured, "worker_config", None) is None:
            previous(process)
            return
        config = configured.worker_config
        group = self.hosts.group_of(config.index)
        members = self.hosts.groups[group]
        if config.index != members[-1]:
            # TorchRL closes the child's end of the pipe once start() returns: keep a copy.
            pipe_key = WORKER_KWARGS["pipe"]
            dup = Connection(os.dup(kwargs[pipe_key].fileno()))
            self.held.append((process, {**kwargs, pipe_key: dup}, dup))
            return
        held, self.held = self.held, []
        everyone = [member for _, member, _ in held] + [kwargs]
        as_one = len(everyone) > 1 and all(_plans(member) for member in everyone)
        self.hosts.stepped_as_one[group] = as_one
        own = type(configured)(
            dict(configured),
            dataclasses.replace(config, host_step=as_one),
            tuple(member for _, member, _ in held),
        )
        # A new dict: the recorded template (a copy of this process) keeps the slot's own.
        _cpython.set_process_kwargs(process, {**kwargs, key: own})
        try:
            previous(process)
        finally:
            for _, _, dup in held:
                dup.close()
        for member, _, _ in held:
            _cpython.share_popen(member, process)


def _plans(kwargs: dict[str, Any]) -> bool:
    """Whether the worker given ``kwargs`` plans its steps (what it decides, decided here)."""
    config = kwargs[WORKER_KWARGS["env_kwargs"]].worker_config
    return kwargs_reason(kwargs, config.step_path_off) is None


@contextlib.contextmanager
def co_hosting(hosts: Hosts | None) -> Iterator[None]:
    """While active, this thread's starts of managed workers are grouped by ``hosts``
    (``None``: one process per slot, untouched)."""
    if hosts is None:
        yield
        return
    _holding.starts = _HeldStarts(hosts)
    try:
        with _START_PATCH.active():
            yield
    finally:
        _holding.starts = None
