"""ClusterEpisodeLedger: the cluster's bookkeeping (pure, no process) and a real multi-node Ray
cluster started on this machine (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from torchrl_ext.data._cluster_state import ClusterState, NodeState
from torchrl_ext.data._ledger_state import LedgerState


# ------------------------------------------------------------------------- pure bookkeeping
def _cluster(n: int, epochs: int = 1, quarantine_after: int = 2) -> ClusterState:
    return ClusterState(
        LedgerState(n, shuffle=False, seed=0, epochs=epochs, quarantine_after=quarantine_after)
    )


def test_nodes_are_granted_disjoint_items_and_their_completions_cover_the_epoch_once() -> None:
    c = _cluster(6, epochs=2)
    a, _q, _end = c.sync("a", [], [], 4)
    b, _q, _end = c.sync("b", [], [], 4)
    assert set(a).isdisjoint(b) and len(a + b) == 8
    c.sync("a", a, [], 0)
    c.sync("b", b, [], 0)
    rest, _q, _end = c.sync("a", [], [], 10)
    _i, _q, end = c.sync("a", rest, [], 1)
    assert end is not None and end[0] == "exhausted"
    assert c.state.completed_in(0) == c.state.completed_in(1) == frozenset(range(6))
    assert c.state.duplicates == 0 and c.state.exhausted()


def test_a_lost_nodes_items_are_replayed_in_their_own_epoch_on_another_node() -> None:
    c = _cluster(4, epochs=2)
    a, _q, _e = c.sync("a", [], [], 3)
    b, _q, _e = c.sync("b", [], [], 2)  # b holds (0, 3) and (1, 0)
    replayed, quarantined = c.lose_node("b")
    assert replayed == b and quarantined == {} and c.state.requeued == 2
    again, _q, _e = c.sync("a", a, [], 2)
    assert sorted(again) == sorted(b), "the lost items come first, in their own epoch"
    with pytest.raises(KeyError):
        c.sync("b", b, [], 1)  # a lost node's late completions are refused
    rest, _q, _e = c.sync("a", again, [], 10)
    c.sync("a", rest, [], 0)
    assert c.state.completed_in(0) == c.state.completed_in(1) == frozenset(range(4))
    assert c.state.duplicates == 0 and c.state.exhausted()


def test_a_node_quarantine_is_cluster_wide_and_releases_the_other_nodes_copies() -> None:
    c = _cluster(2, epochs=3)
    c.sync("a", [], [], 1)  # (0, 0)
    b, _q, _e = c.sync("b", [], [], 3)  # (0, 1), (1, 0), (1, 1)
    _i, quarantined, _e = c.sync("a", [], [(0, "ValueError: bad")], 0)
    assert quarantined == {0: "ValueError: bad"}
    assert (1, 0) not in c.held["b"] and not any(i == 0 for _e, i in c.state.leases.values())
    n = NodeState(2, epochs=3)
    n.receive(b, quarantined, None)
    assert list(n.feed) == [(0, 1), (1, 1)] and n.outbox() == ([], []), "adopted, not reported again"


def test_a_sync_sent_again_gets_the_same_answer() -> None:
    c = _cluster(5)
    first = c.sync("a", [], [], 2, seq=1)
    assert c.sync("a", [], [], 2, seq=1) == first
    assert c.sync("a", [], [], 2, seq=2)[0] == [(0, 2), (0, 3)]


def test_nodes_lost_twice_with_an_episode_quarantine_it() -> None:
    c = _cluster(3, epochs=1)
    c.sync("a", [], [], 1)
    c.lose_node("a")
    c.sync("b", [], [], 1)
    replayed, quarantined = c.lose_node("b")
    assert replayed == [] and list(quarantined) == [0]
    items, _q, _e = c.sync("c", [], [], 5)
    assert items == [(0, 1), (0, 2)]


def test_a_node_waits_for_grants_and_reports_its_own_losses_and_quarantines() -> None:
    n = NodeState(4, epochs=1)
    assert n.take() is None and n.waiting()
    n.receive([(0, 2), (0, 3)], {}, None, asked=2)
    assert n.take() == (0, 2) and n.lease(1) == (0, 2)
    assert n.lose(1) == (0, 2), "an env worker's loss is replayed on its node"
    assert n.take() == (0, 2) and n.lease(2) == (0, 2) and n.lose(2) is None
    assert n.outbox() == ([], [(2, "lost in flight 2 times")])
    n.receive([], {2: "lost in flight 2 times"}, ("exhausted", "all out"), asked=1)
    assert n.take() == (0, 3) and n.lease(3) == (0, 3) and n.complete(3) == (0, 3)
    assert n.take() is None and not n.waiting() and n.outbox() == ([(0, 3)], [])


# ------------------------------------------------------------------------- a Ray cluster
EPISODES = 48


class _EnvHost:
    """A ManagedParallelEnv of 2 LedgerEnv workers, built on its node from the ledger."""

    def __init__(self, ledger: Any) -> None:
        from tests.ledger_envs import make_ledger_env
        from torchrl_ext import ManagedParallelEnv

        self.env = ManagedParallelEnv(
            2, make_ledger_env, create_env_kwargs={"episodes": ledger}, max_restarts=4, mp_start_method="fork"
        )
        self.td = self.env.reset()

    def play(self, steps: int) -> list[list[int]]:
        seen = []
        for _ in range(steps):
            _out, self.td = self.env.step_and_maybe_reset(self.env.rand_action(self.td))
            seen += [[int(v) for v in row] for row in self.td["observation"]]
        return seen

    def kill_worker(self) -> int:
        """SIGKILL env worker 0 while it plays an episode (at t=1)."""
        for _ in range(20):
            index, _epoch, t = (int(v) for v in self.td["observation"][0])
            if index >= 0 and t == 1:
                break
            _out, self.td = self.env.step_and_maybe_reset(self.env.rand_action(self.td))
        victim = int(self.env.worker_pids[0])
        os.kill(victim, signal.SIGKILL)
        return index

    def restarts(self) -> int:
        return len(self.env.restarts)

    def close(self) -> None:
        self.env.close()


@pytest.fixture
def three_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="needs the optional Ray extra: pip install 'torchrl-ext[ray]'")
    from ray.cluster_utils import Cluster

    from tests.test_ray import KILL_CHILDREN_VAR, _wait_for_ray_to_exit

    monkeypatch.delenv(KILL_CHILDREN_VAR, raising=False)
    import psutil

    ours_before = {p.pid for p in psutil.Process().children()}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield ray, cluster, workers
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        _wait_for_ray_to_exit(ours_before)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_three_nodes_two_epochs_each_episode_once_while_a_worker_and_a_node_are_lost(
    three_nodes: Any,
) -> None:
    """3 nodes, each with an actor owning a ManagedParallelEnv of 2 env workers: one env worker
    SIGKILLed, then a whole node removed, mid-epoch 0; each of the 48 episodes is completed
    exactly once in each of the 2 epochs."""
    ray, cluster, workers = three_nodes
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tests.ledger_envs import Episodes
    from tests.polling import wait_until
    from torchrl_ext.data import ClusterEpisodeLedger

    ledger = ClusterEpisodeLedger(Episodes(EPISODES), seed=0, epochs=2)
    token = ledger._token
    try:
        host_class = ray.remote(num_cpus=0, max_restarts=0)(_EnvHost)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert sorted(nodes) == sorted(ledger.nodes) and len(nodes) == 3
        hosts = {
            node: host_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(ledger)
            for node in nodes
        }
        ray.get([h.play.remote(2) for h in hosts.values()], timeout=300)
        killed_on = workers[0].node_id
        ray.get(hosts[killed_on].kill_worker.remote(), timeout=60)
        ray.get([h.play.remote(4) for h in hosts.values()], timeout=120)
        assert ray.get(hosts[killed_on].restarts.remote(), timeout=60) == 1
        assert ledger.stats()["epoch"] == 0, "still mid-epoch 0: scale the run up"
        removed = workers[1].node_id
        cluster.remove_node(workers[1])
        del hosts[removed]
        wait_until(lambda: ledger.stats()["nodes_lost"] == 1, "the cluster ledger lost the node", timeout=120)
        for _ in range(200):
            ray.get([h.play.remote(6) for h in hosts.values()], timeout=120)
            if ledger.finished:
                break
        stats = ledger.stats()
        assert ledger.finished, stats
        assert ledger.completed_in(0) == ledger.completed_in(1) == frozenset(range(EPISODES)), stats
        assert stats["duplicates"] == 0 and stats["quarantined"] == 0 and stats["coverage"] == 1.0
        assert stats["nodes"] == 2 and stats["nodes_lost"] == 1 and stats["requeued"] >= 2, stats
        by_node = ledger.node_stats()
        assert set(by_node) == {n for n in nodes if n != removed}
        assert by_node[killed_on]["requeued"] >= 1, "the killed env worker's episode was replayed on its node"
        assert stats["requeued"] - sum(n["requeued"] for n in by_node.values()) >= 1, (
            "the node's were replayed"
        )
        ray.get([h.close.remote() for h in hosts.values()], timeout=120)
    finally:
        ledger.close()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"torchrl_ext-cl-{token}-*"))


@pytest.fixture
def one_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local Ray instance (one node, 1 CPU) with Ray's default settings."""
    ray = pytest.importorskip("ray", reason="needs the optional Ray extra: pip install 'torchrl-ext[ray]'")
    import psutil

    from tests.test_ray import KILL_CHILDREN_VAR, _wait_for_ray_to_exit

    monkeypatch.delenv(KILL_CHILDREN_VAR, raising=False)
    ours_before = {p.pid for p in psutil.Process().children()}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _wait_for_ray_to_exit(ours_before)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_resumed_cluster_ledger_continues_the_epoch_and_keeps_its_quarantine(one_node: Any) -> None:
    """Episode 3 fails to load (quarantined, cluster-wide); ``state_dict()`` with episode 4 held
    and a new cluster ledger ``load_state_dict()``: the epoch goes on, every other episode once."""
    from tests.ledger_envs import Episodes
    from tests.polling import wait_until
    from torchrl_ext.data import ClusterEpisodeLedger

    ledger = ClusterEpisodeLedger(Episodes(8, corrupt=(3,)), shuffle=False, epochs=1)
    try:
        client = ledger.client()
        got = [client.next()[0] for _ in range(4)]
        assert got == [0, 1, 2, 4]
        wait_until(lambda: 3 in ledger.quarantined(), "the node reported the quarantine")
        state = ledger.state_dict()
        assert sorted(ledger.completed_in(0)) == [0, 1, 2], "what the node completed was flushed"
        client.close()
    finally:
        ledger.close()
    resumed = ClusterEpisodeLedger(Episodes(8, corrupt=(3,)), shuffle=True, seed=7, epochs=1)
    try:
        resumed.load_state_dict(state)
        rest = [index for index, _episode in resumed.client()]
        assert rest[0] == 4 and sorted(rest) == [4, 5, 6, 7], rest
        wait_until(lambda: resumed.finished, "the resumed epoch finished")
        assert resumed.completed_in(0) == frozenset({0, 1, 2, 4, 5, 6, 7})
        assert resumed.quarantined() == {3: "ValueError: truncated log in episode 3"}
        assert resumed.stats()["duplicates"] == 0
    finally:
        resumed.close()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_cluster_nodes_reader_killed_by_an_episode_is_replaced_and_the_episode_quarantined(
    one_node: Any,
) -> None:
    """A node's agent runs 1 reader; episode 2 SIGKILLs whoever loads it: the reader is replaced,
    at the second loss the episode is quarantined cluster-wide, every other episode once."""
    from tests.ledger_envs import Episodes
    from tests.polling import wait_until
    from torchrl_ext.data import ClusterEpisodeLedger

    ledger = ClusterEpisodeLedger(Episodes(6, crash=(2,)), num_readers=1, shuffle=False, epochs=1)
    try:
        client = ledger.client()
        got = [index for index, _episode in client]
        assert got == [0, 1, 3, 4, 5]
        wait_until(lambda: ledger.finished, "the node reported every completion")
        stats = ledger.stats()
        assert list(ledger.quarantined()) == [2] and stats["reader_restarts"] == 2, stats
        assert stats["readers_alive"] == 1 and stats["duplicates"] == 0
        assert ledger.completed_in(0) == frozenset({0, 1, 3, 4, 5})
        client.close()
    finally:
        ledger.close()
