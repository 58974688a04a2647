"""One record per worker slot: what restarts and recycling remember about it.

A slot is a position in TorchRL's by-position lists (``workers``, ``channels``, ``events``,
the shared buffers). Its processes belong to the supervisor (``_supervisor``, ``_handover``);
what the env's policies remember about the slot, across the workers that hold it in turn, is
one :class:`Slot`: the slot keeper (``_keeper``) and the recycler (``_recycle``) read and
write it, on the env's calling thread only. :meth:`Slot.next_seed` is the one place a new
worker of the slot is counted and seeded, :meth:`Slot.new_worker` the one place its
per-worker counts start over, :meth:`Slot.end_recycling` the one place its recycling ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

from ._policy import RecycleCause, RestartRecord, replacement_seed
from ._starting import StartingWorker

__all__ = ["Reading", "Slot", "Slots", "Swap"]


@dataclasses.dataclass(frozen=True)
class Reading:
    """One slot's tree at a boundary where its USS was read (NOTE [unique memory])."""

    uss: int
    #: Its RSS in the same read: what the RSS grew since is added to ``uss`` to estimate it.
    rss: int
    #: ``time.monotonic()`` until which an estimate from it may stand.
    until: float


@dataclasses.dataclass(frozen=True)
class Swap:
    """A recycled slot whose new worker's first reset is still awaited."""

    record: RestartRecord
    #: ``time.monotonic()`` at the swap (the record's ``ready_after`` counts from it).
    started: float
    #: The env's label, as the log line names it.
    label: str
    #: The old worker's channel: sent "close" once the new worker answered that reset.
    retiring: Any


@dataclasses.dataclass(eq=False)
class Slot:
    """What the env's policies remember about slot ``index``. Each field: its invariant; who writes it."""

    index: int
    # --- restarts (the keeper)
    #: The last ``(seed, static_seed)`` ``set_seed`` sent the slot; ``None``: never seeded. The keeper.
    seed: tuple[int, bool] | None = None
    #: How many workers replaced the slot's first; only grows. :meth:`next_seed`.
    incarnation: int = 0
    #: Its replacement's first reset observation, kept until its mark is written. The keeper.
    fresh_obs: Any = None
    #: Its worker, a replacement lost between calls, owes it a marked transition: its next step
    #: is answered by the mark (the send hook). Set by the keeper; cleared at that step or reset.
    owes_mark: bool = False
    #: ``(pid, factory)`` of a replacement killed for passing ``start_timeout``. The keeper.
    start_timed_out: tuple[int, str] | None = None
    # --- recycling (the recycler); :meth:`end_recycling` resets them all
    #: Resets of the slot's current worker; 0 when a worker takes the slot (:meth:`new_worker`).
    episodes: int = 0
    #: Why the slot is recycled at its next episode boundary; ``None``: not due.
    due: RecycleCause | None = None
    #: Its next worker, started ahead of the boundary; set only while ``due``.
    standby: StartingWorker | None = None
    #: What the standby is seeded with (``None``: the slot was never seeded); set with it.
    standby_seed: tuple[int, bool] | None = None
    #: The standby's prepared reset: sent, or its answer read; ``None`` with no standby.
    prepared: Literal["sent", "answered"] | None = None
    #: Its ``step_and_maybe_reset`` in flight was sent as ``step`` (a standby waits).
    translated: bool = False
    #: Its tree's memory (NOTE [unique memory]) at its last boundary; ``None``: not read yet.
    boundary_memory: int | None = None
    #: Its last USS read, from which an estimate may stand.
    reading: Reading | None = None
    #: Set at a swap until the new worker answered its first reset.
    swap: Swap | None = None

    def next_seed(self) -> tuple[int, bool] | None:
        """A new worker is started for the slot: count it, and return its seed (from the slot's
        with ``replacement_seed``; ``None`` if the slot was never seeded)."""
        self.incarnation += 1
        if self.seed is None:
            return None
        return replacement_seed(self.seed[0], self.index, self.incarnation), self.seed[1]

    def new_worker(self) -> None:
        """A new worker holds the slot: it owes no mark yet; its episode count and memory
        readings start over."""
        self.owes_mark = False
        self.episodes, self.boundary_memory, self.reading = 0, None, None

    def drop_standby(self) -> StartingWorker | None:
        """Forget the standby (its seed and prepared reset too); return it, for its process to be
        ended."""
        standby, self.standby, self.standby_seed, self.prepared = self.standby, None, None, None
        return standby

    def end_recycling(self) -> None:
        """Recycling starts over for the slot (its worker was lost, or the env closed): the
        caller has ended the standby and retired worker these fields named."""
        self.new_worker()
        self.due, self.translated, self.swap = None, False, None
        self.drop_standby()


class Slots:
    """The slots of one env, by index, made on first use (the env's calling thread only)."""

    def __init__(self) -> None:
        self._slots: list[Slot] = []
        #: The slots whose ``"next"`` holds a restart's mark, cleared at the next call: a set, as
        #: every call asks whether it is empty. Written by the keeper (and :meth:`new_start`).
        self.marked: set[int] = set()

    def __getitem__(self, index: int) -> Slot:
        while len(self._slots) <= index:
            self._slots.append(Slot(len(self._slots)))
        return self._slots[index]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def new_start(self) -> None:
        """The env started (again): no mark is pending or owed."""
        self.marked.clear()
        for slot in self._slots:
            slot.owes_mark, slot.fresh_obs = False, None

    def due(self) -> list[Slot]:
        return [slot for slot in self._slots if slot.due is not None]
