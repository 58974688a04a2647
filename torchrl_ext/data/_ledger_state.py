"""The episode ledger's bookkeeping, with no I/O: which episode is handed out next, which are
held and by whom, which came back, which are quarantined.

An *item* is ``(epoch, index)``. Every item goes one way::

    order of its epoch (or ``front``) --take--> pending --lease--> leased --complete--> done
                                                   ^                  |
                                                   +------lose--------+   (quarantine after
                                                                           ``quarantine_after``)

``EpisodeLedger`` drives one instance under its lock; the tests drive it directly.

Why nothing is left to take is one of two ends, never confused: the epochs asked for were all
handed out (``EpochsExhausted``), or no episode can be served at all, every one quarantined or
none to begin with (``NoEpisodesError``, :func:`no_episodes_message`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from ._sampler import EpisodeSampler

__all__ = ["CAUSES_NAMED", "Item", "LedgerState", "no_episodes_message"]

#: ``(epoch, index)``: one episode of one epoch.
Item = tuple[int, int]

#: Finished epochs whose completed sets are kept (for ``completed_in``); older ones are dropped.
_KEPT_EPOCHS = 4
#: Quarantine reasons a "no episode can be served" message names (the first ones).
CAUSES_NAMED = 3


def no_episodes_message(dataset: str, num_episodes: int, causes: Sequence[tuple[str, str]] = ()) -> str:
    """Why a ledger over ``dataset`` (its description) can serve no episode: it has none
    (``num_episodes`` 0), or every one is quarantined, ``causes`` naming the first few as
    ``(episode, why)``.

    Example:
        >>> no_episodes_message("Logs('/data/run1')", 0).split(":")[0]
        "the episode ledger's dataset Logs('/data/run1') has no episode (len() 0)"
        >>> no_episodes_message("Logs('/d')", 2, [("episode 0", "ValueError: bad")]).split(". ")[1]
        'The first: episode 0: ValueError: bad'
    """
    if num_episodes <= 0:
        return (
            f"the episode ledger's dataset {dataset} has no episode (len() 0): nothing to hand out. "
            "A folder that does not exist or is empty, or a pattern that matched no file, gives an "
            "empty dataset: check what the dataset was built from"
        )
    named = "; ".join(f"{what}: {why}" for what, why in causes[:CAUSES_NAMED])
    more = (
        f" (and {num_episodes - CAUSES_NAMED} more, see quarantined())" if num_episodes > CAUSES_NAMED else ""
    )
    return (
        f"no episode of the episode ledger's dataset {dataset} can be served: all {num_episodes} "
        f"are quarantined. The first: {named}{more}. Fix the episodes (or the dataset's loading), "
        "or build the ledger over another dataset"
    )


class LedgerState:
    """Exactly-once bookkeeping over ``num_episodes`` episodes, epoch after epoch.

    Example:
        >>> s = LedgerState(3, shuffle=False, seed=0, epochs=1)
        >>> s.take(), s.lease(holder=7)
        ((0, 0), (0, 0))
        >>> s.lose(7)  # the holder died: the episode goes back to the front
        (0, 0)
        >>> [s.take() for _ in range(4)]
        [(0, 0), (0, 1), (0, 2), None]
    """

    def __init__(
        self,
        num_episodes: int,
        shuffle: bool = True,
        seed: int | None = None,
        epochs: int | None = None,
        quarantine_after: int = 2,
    ) -> None:
        if epochs is not None and epochs <= 0:
            raise ValueError(f"epochs must be positive or None, got {epochs}")
        if quarantine_after <= 0:
            raise ValueError(f"quarantine_after must be positive, got {quarantine_after}")
        self.sampler = EpisodeSampler(num_episodes, shuffle, seed)  # fixed; load_state_dict reseeds
        self.epochs = epochs  # fixed: None runs forever
        self.quarantine_after = quarantine_after  # fixed
        self.epoch = 0  # the epoch ``cursor`` walks; only ``_next_from_order`` advances it
        self.order: list[int] = self.sampler.epoch_order(0)  # ``epoch``'s order; with ``epoch``
        self.cursor = 0  # items of ``order`` taken so far; ``_next_from_order`` writes
        self.front: deque[Item] = deque()  # lost items not yet taken again; lose/take write
        self.pending: deque[Item] = deque()  # taken, not yet leased, in hand-out order
        self.leases: dict[int, Item] = {}  # holder -> the item it plays; lease/complete/lose write
        self.completed: dict[int, set[int]] = {0: set()}  # epoch -> indices completed in it
        self.losses: Counter[int] = Counter()  # index -> times it was lost in flight (whole run)
        self.quarantined: dict[int, str] = {}  # index -> why; never shrinks
        self.current = 0  # the newest epoch handed out (``epoch`` may run ahead: loads); lease writes
        self.served = 0  # leases handed out
        self.done = 0  # items completed
        self.requeued = 0  # items put back after a loss
        self.duplicates = 0  # completions of an index already completed in its epoch: stays 0

    @property
    def num_episodes(self) -> int:
        return self.sampler.num_episodes

    # -- the one-way path ------------------------------------------------------------------
    def take(self) -> Item | None:
        """The next item to load (lost ones first), now pending; None when every epoch is out."""
        item = self.front.popleft() if self.front else self._next_from_order()
        if item is not None:
            self.pending.append(item)
        return item

    def _next_from_order(self) -> Item | None:
        while True:
            while self.cursor < len(self.order):
                index = self.order[self.cursor]
                self.cursor += 1
                if index not in self.quarantined:
                    return (self.epoch, index)
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                return None
            self.epoch += 1
            self.order, self.cursor = self.sampler.epoch_order(self.epoch), 0
            self.completed.setdefault(self.epoch, set())
            self._forget_old_epochs()
            if len(self.quarantined) >= self.num_episodes:
                return None

    def lease(self, holder: int) -> Item:
        """Hand the first pending item to ``holder``, which must hold none."""
        assert holder not in self.leases, f"holder {holder} already holds {self.leases[holder]}"
        item = self.pending.popleft()
        self.leases[holder] = item
        self.current = max(self.current, item[0])
        self.served += 1
        return item

    def complete(self, holder: int) -> Item | None:
        """``holder`` finished its item (it asked for the next one, or closed)."""
        item = self.leases.pop(holder, None)
        if item is not None:
            epoch, index = item
            done = self.completed.setdefault(epoch, set())
            if index in done:
                self.duplicates += 1
            done.add(index)
            self.done += 1
        return item

    def lose(self, holder: int) -> Item | None:
        """``holder`` is gone with its item: the item goes back to the front, unless this loss
        quarantines it. Returns the item requeued, or None."""
        item = self.leases.pop(holder, None)
        return None if item is None else self._requeue(item, "lost in flight")

    def lose_pending(self, item: Item, why: str = "its reader died") -> Item | None:
        """A pending item's load was lost (``why``): load it again, at the same place, unless
        this loss quarantines it. Returns the item kept pending, or None (also when the item
        is no longer pending)."""
        if item not in self.pending:
            return None
        index = item[1]
        self.losses[index] += 1
        if self.losses[index] >= self.quarantine_after:
            self._skip(index, f"its load was lost {self.losses[index]} times; last: {why}")
            return None
        return item

    def _requeue(self, item: Item, what: str) -> Item | None:
        index = item[1]
        self.losses[index] += 1
        if index in self.quarantined:  # another epoch's copy was quarantined meanwhile
            return None
        if self.losses[index] >= self.quarantine_after:
            self._skip(index, f"{what} {self.losses[index]} times")
            return None
        self.front.appendleft(item)
        self.requeued += 1
        return item

    def give_back(self, holder: int) -> Item | None:
        """``holder`` never received its item: it goes back to the front, no loss counted."""
        item = self.leases.pop(holder, None)
        if item is not None:
            self.served -= 1
            if item[1] not in self.quarantined:
                self.front.appendleft(item)
        return item

    def quarantine(self, item: Item, reason: str) -> None:
        """A pending item cannot be loaded: skip its index for the rest of the run."""
        self._skip(item[1], reason)

    def reject(self, holder: int, reason: str) -> Item | None:
        """``holder`` could not load the item it was leased: skip its index for the rest of the run."""
        item = self.leases.pop(holder, None)
        if item is not None:
            self._skip(item[1], reason)
        return item

    def _skip(self, index: int, reason: str) -> None:
        """The one place an index is quarantined: no epoch hands it out again, the copies
        already taken or requeued included."""
        self.quarantined.setdefault(index, reason)
        self.pending = deque(item for item in self.pending if item[1] != index)
        self.front = deque(item for item in self.front if item[1] != index)

    # -- what the ledger reports -----------------------------------------------------------
    def waiting(self) -> bool:
        """Nothing to take now, but more may come without a loss (a cluster node's next grant:
        ``NodeState``); never on one machine, where nothing to take means the epochs are out."""
        return False

    def can_serve(self) -> bool:
        """Some episode can still be served: not every one is quarantined."""
        return len(self.quarantined) < self.num_episodes

    def first_causes(self) -> list[tuple[int, str]]:
        """The first ``CAUSES_NAMED`` quarantined indices and why, in the order they were."""
        return list(self.quarantined.items())[:CAUSES_NAMED]

    def coverage(self, epoch: int) -> float:
        """Completed share of ``epoch``'s episodes that can be served (quarantined ones left
        out of both counts); 0.0 when none can be: nothing was covered."""
        wanted = self.num_episodes - len(self.quarantined)
        done = len(self.completed.get(epoch, set()) - self.quarantined.keys())
        return 0.0 if wanted <= 0 else done / wanted

    def completed_in(self, epoch: int) -> frozenset[int]:
        """The indices completed in ``epoch`` (kept for the last few finished epochs)."""
        return frozenset(self.completed.get(epoch, ()))

    def outstanding(self) -> list[Item]:
        """Items handed out or taken but not completed, in the order a resume replays them: the
        lost ones first, then those held, then those loaded ahead; quarantined ones left out."""
        return [
            item
            for item in (*self.front, *self.leases.values(), *self.pending)
            if item[1] not in self.quarantined
        ]

    def exhausted(self) -> bool:
        """Nothing is left to take or to finish."""
        return not self.leases and not self.pending and not self.front and self._order_spent()

    def _order_spent(self) -> bool:
        last = self.epochs is not None and self.epoch + 1 >= self.epochs
        rest = self.order[self.cursor :]
        return last and all(i in self.quarantined for i in rest)

    def _forget_old_epochs(self) -> None:
        live = {epoch for epoch, _ in self.outstanding()} | {self.epoch}
        oldest = min(live) - _KEPT_EPOCHS
        for epoch in [e for e in self.completed if e < oldest]:
            del self.completed[epoch]

    # -- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch, position, seed, what is outstanding (replayed first) and the quarantine."""
        return {
            "num_episodes": self.num_episodes,
            "shuffle": self.sampler.shuffle,
            "seed": self.sampler.seed,
            "epoch": self.epoch,
            "current": min([self.current, *(e for e, _i in self.outstanding())]),
            "cursor": self.cursor,
            "outstanding": [list(item) for item in self.outstanding()],
            "completed": {str(e): sorted(done) for e, done in self.completed.items()},
            "losses": dict(self.losses),
            "quarantined": dict(self.quarantined),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken; only before anything was handed out."""
        if self.served or self.pending or self.leases:
            raise RuntimeError("load_state_dict() must come before the ledger hands out an episode")
        if int(state["num_episodes"]) != self.num_episodes:
            raise ValueError(
                f"the state is of a dataset of {state['num_episodes']} episodes; this one has "
                f"{self.num_episodes}"
            )
        self.sampler = EpisodeSampler(self.num_episodes, bool(state["shuffle"]), int(state["seed"]))
        self.epoch = int(state["epoch"])
        self.current = int(state["current"])
        self.order, self.cursor = self.sampler.epoch_order(self.epoch), int(state["cursor"])
        self.front = deque((int(e), int(i)) for e, i in state["outstanding"])
        self.completed = {int(e): set(map(int, done)) for e, done in state["completed"].items()}
        self.completed.setdefault(self.epoch, set())
        self.losses = Counter({int(i): int(n) for i, n in state["losses"].items()})
        self.quarantined = {int(i): str(why) for i, why in state["quarantined"].items()}
