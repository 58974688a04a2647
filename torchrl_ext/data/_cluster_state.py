"""The cluster ledger's bookkeeping, with no I/O: which node holds which episode, and a node's
own view of the episodes it was granted.

Two levels, each a :class:`~._ledger_state.LedgerState`:

* :class:`ClusterState` (in the cluster actor) owns the epochs. It *grants* items to nodes in
  small batches; each granted item is a lease of the node. A node reports completions and
  quarantines in batches; a lost node's items all go back through ``lose`` (the front of the
  queue, in their own epoch, a loss counted toward quarantine).
* :class:`NodeState` (in a node's agent) is today's one-machine bookkeeping fed by those
  grants instead of an epoch order: its env workers' leases, completions and losses work as on
  one machine (an env worker's lost episode is replayed on its node); what it completes or
  quarantines waits in its outbox for the next sync.

One sync, node -> cluster: ``(done items, quarantines, wanted)``; cluster -> node:
``(granted items, every quarantine so far, end)``, ``end`` None while more may come, else
``("exhausted" | "no_episodes", message)``: nothing to take now (another node may still lose
its items, which come back on a later sync).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from ._ledger_state import Item, LedgerState, no_episodes_message

__all__ = ["ClusterState", "End", "NodeState", "SyncReply"]

#: ``("exhausted" | "no_episodes", message)``, or None while more may come.
End = tuple[str, str] | None
#: What the cluster answers a node's sync.
SyncReply = tuple[list[Item], dict[int, str], End]


class ClusterState:
    """Items of one :class:`LedgerState` granted to nodes, each a lease of its node.

    Example:
        >>> c = ClusterState(LedgerState(4, shuffle=False, seed=0, epochs=1))
        >>> c.sync("a", [], [], 2)[0], c.sync("b", [], [], 1)[0]
        ([(0, 0), (0, 1)], [(0, 2)])
        >>> c.lose_node("b")  # node b is gone: its item goes back to the front
        ([(0, 2)], {})
        >>> c.sync("a", [(0, 0), (0, 1)], [], 3)[0]
        [(0, 2), (0, 3)]
    """

    def __init__(self, state: LedgerState, dataset: str = "the dataset") -> None:
        self.state = state  # the epochs, leases (one holder id per granted item), quarantine
        self.dataset = dataset  # fixed: how messages name the dataset
        self.holders = itertools.count(1)  # lease ids in ``state``; grant writes
        self.held: dict[str, dict[Item, int]] = {}  # node -> item -> its holder id; sync/lose write
        self.lost: dict[str, int] = {}  # node -> items it held when it was lost; lose_node writes
        self.granted = 0  # items granted to nodes, replays included
        self.answers: dict[str, tuple[int, SyncReply]] = {}  # node -> its last sync's seq, answer

    def sync(
        self,
        node: str,
        done: Iterable[Item],
        quarantines: Iterable[tuple[int, str]],
        want: int,
        seq: int | None = None,
    ) -> SyncReply:
        """``node`` completed ``done``, quarantined ``quarantines`` and wants ``want`` items.
        ``seq`` numbers a node's syncs: a sync sent again (its answer was lost) gets the same
        answer, so no grant is lost with it."""
        if node in self.lost:
            raise KeyError(f"node {node} was declared lost; its items were replayed elsewhere")
        last = self.answers.get(node)
        if seq is not None and last is not None and last[0] == seq:
            return last[1]
        reply = self._sync(node, done, quarantines, want)
        if seq is not None:
            self.answers[node] = (seq, reply)
        return reply

    def _sync(
        self, node: str, done: Iterable[Item], quarantines: Iterable[tuple[int, str]], want: int
    ) -> SyncReply:
        held = self.held.setdefault(node, {})
        for epoch, index in done:
            finished = held.pop((int(epoch), int(index)), None)
            if finished is not None:
                self.state.complete(finished)
        for index, why in quarantines:
            self.quarantine(index, why)
        items: list[Item] = []
        while len(items) < want:
            taken = self.state.take()
            if taken is None:
                break
            holder = next(self.holders)
            self.state.lease(holder)
            held[taken] = holder
            items.append(taken)
        self.granted += len(items)
        end: End = None
        if not self.state.can_serve():
            end = ("no_episodes", no_episodes_message(self.dataset, self.state.num_episodes, self._causes()))
        elif want and len(items) < want:
            end = ("exhausted", self._exhausted_message())
        return items, dict(self.state.quarantined), end

    def quarantine(self, index: int, why: str) -> None:
        """No node plays ``index`` again: the copies nodes hold are released, not completed."""
        self.state.quarantine((0, index), why)
        self._release(index)

    def _release(self, index: int) -> None:
        for held in self.held.values():
            for item in [item for item in held if item[1] == index]:
                self.state.leases.pop(held.pop(item), None)

    def lose_node(self, node: str) -> tuple[list[Item], dict[int, str]]:
        """``node`` is gone with everything it held: each item is lost (replayed in its own
        epoch, or quarantined at its ``quarantine_after``-th loss). Returns the items replayed
        and the indices this quarantined, with why."""
        held = self.held.pop(node, {})
        self.lost[node] = len(held)
        before = set(self.state.quarantined)
        replayed = [item for item in map(self.state.lose, held.values()) if item is not None]
        new = {i: why for i, why in self.state.quarantined.items() if i not in before}
        for index in new:
            self._release(index)
        return replayed, new

    def _causes(self) -> list[tuple[str, str]]:
        return [(f"episode {index}", why) for index, why in self.state.first_causes()]

    def _exhausted_message(self) -> str:
        held = sum(len(h) for h in self.held.values())
        return (
            f"every episode of the cluster ledger's {self.state.epochs} epoch(s) was handed out "
            f"({self.state.done} completed, {held} still held by nodes, "
            f"{len(self.state.quarantined)} quarantined)"
        )

    def stats(self) -> dict[str, float | int]:
        """The cluster's own counts (a node's agent counts its env workers)."""
        state = self.state
        return {
            "epoch": state.current,
            "completed": state.done,
            "granted": self.granted,
            "held_by_nodes": sum(len(h) for h in self.held.values()),
            "requeued": state.requeued,
            "quarantined": len(state.quarantined),
            "duplicates": state.duplicates,
            "coverage": state.coverage(state.current),
            "nodes": len(self.held),
            "nodes_lost": len(self.lost),
        }


class NodeState(LedgerState):
    """One node's :class:`LedgerState`, fed by the cluster's grants instead of an epoch order.

    Example:
        >>> n = NodeState(4, epochs=1)
        >>> n.take() is None, n.waiting()  # nothing granted yet: wait for the next sync
        (True, True)
        >>> n.receive([(0, 3)], {}, None); n.take(), n.lease(holder=1), n.complete(1)
        ((0, 3), (0, 3), (0, 3))
        >>> n.outbox()
        ([(0, 3)], [])
    """

    def __init__(self, num_episodes: int, epochs: int | None = None, quarantine_after: int = 2) -> None:
        super().__init__(
            num_episodes, shuffle=False, seed=0, epochs=epochs, quarantine_after=quarantine_after
        )
        self.order = []  # unused: ``feed`` replaces the epoch order
        self.feed: deque[Item] = deque()  # granted, not yet taken; receive/take write
        self.end: End = None  # the cluster's last word when it granted less than asked
        self.done_out: list[Item] = []  # completed, not yet reported; complete/outbox write
        self.quarantine_out: list[tuple[int, str]] = []  # quarantined here, not yet reported

    def _next_from_order(self) -> Item | None:
        while self.feed:
            item = self.feed.popleft()
            if item[1] not in self.quarantined:
                self.completed.setdefault(item[0], set())
                return item
        return None

    def complete(self, holder: int) -> Item | None:
        item = super().complete(holder)
        if item is not None:
            self.done_out.append(item)
        return item

    def _skip(self, index: int, reason: str) -> None:
        if index not in self.quarantined:
            self.quarantine_out.append((index, reason))
        super()._skip(index, reason)
        self.feed = deque(item for item in self.feed if item[1] != index)

    def waiting(self) -> bool:
        """Nothing to take here, but the cluster may grant more on the next sync."""
        return not self.feed and self.end is None

    def can_serve(self) -> bool:
        return (self.end is None or self.end[0] != "no_episodes") and super().can_serve()

    def exhausted(self) -> bool:
        return not self.leases and not self.pending and not self.front and not self.feed

    def outbox(self) -> tuple[list[Item], list[tuple[int, str]]]:
        """What to report on the next sync, taken out of the outbox."""
        done, self.done_out = self.done_out, []
        quarantines, self.quarantine_out = self.quarantine_out, []
        return done, quarantines

    def wanted(self, depth: int) -> int:
        """Items to ask for so ``depth`` are pending or granted."""
        return max(0, depth - len(self.pending) - len(self.front) - len(self.feed))

    def receive(self, items: list[Item], quarantined: dict[int, str], end: End, asked: int = 1) -> None:
        """The cluster's answer to a sync that asked for ``asked`` items."""
        for index, why in quarantined.items():
            if index not in self.quarantined:  # decided elsewhere: not ours to report
                LedgerState._skip(self, index, why)
                self.feed = deque(item for item in self.feed if item[1] != index)
        self.feed.extend((int(e), int(i)) for e, i in items if int(i) not in self.quarantined)
        if asked or end is not None:
            self.end = None if items else end
