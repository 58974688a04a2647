"""One episode ledger for a Ray cluster: each episode once per epoch across every node.

Who runs what (every arrow is a Ray call; env workers talk to their node's agent as today)::

    driver                 ClusterEpisodeLedger -- stats, state_dict, close --> cluster actor
    cluster actor          ClusterState (the epochs), pings each agent every PING_EVERY s
    node agent (per node)  _Service over a NodeState: the node's Unix socket, readers, spool
                           sync thread --(seq, done, quarantines, want)--> cluster actor
                                       <--(granted items, quarantines, end)--
    env worker             LedgerClient(address of its node's agent).next()

The cluster actor is pinned to the driver's node, each agent to its node
(``NodeAffinitySchedulingStrategy``, not soft). An agent Ray reports dead (``RayActorError``
but not ``ActorUnavailableError``: the node or the agent is gone for good) is lost with all
of its node's items: each goes back through ``LedgerState.lose``, replayed in its own epoch.
Everything here is owned by the driver: if the driver dies, Ray ends the cluster actor and the
agents, the env workers' next ``next()`` raises ``LedgerClosedError``, and only a
``state_dict()`` saved before resumes the epoch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ._cluster_state import ClusterState, NodeState, SyncReply
from ._ledger import LedgerClient, checked_state
from ._ledger_service import Plan, _Service
from ._ledger_state import LedgerState
from ._readers import Supervised, acquire_reaper, describe_dataset, owner_tag, release_reaper

__all__ = ["ClusterEpisodeLedger"]

_logger = logging.getLogger("torchrl_ext")

#: Seconds an agent's sync thread waits between syncs when it wants nothing more.
SYNC_EVERY = 0.05
#: Seconds between the cluster actor's pings of each agent.
PING_EVERY = 0.5
#: Seconds one Ray call may take before it is counted slow (a ping) or sent again (a sync).
CALL_WAIT = 30.0
#: Seconds the agents get to start.
START_WAIT = 120.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as err:  # pragma: no cover - the extra is missing
        raise ImportError("ClusterEpisodeLedger needs Ray: pip install 'torchrl-ext[ray]'") from err
    return ray


def _socket_dir(token: str, node: str) -> str:
    """Where the agent of ``node`` listens: the same path for the agent and its env workers."""
    digest = hashlib.sha1(node.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"torchrl_ext-cl-{token}-{digest}")


def _node_client(token: str, authkey: bytes, dataset: Any) -> LedgerClient:
    """What a :class:`ClusterEpisodeLedger` unpickles into: a client of this node's agent."""
    ray = _ray()
    if not ray.is_initialized():
        raise RuntimeError(
            "a ClusterEpisodeLedger was unpickled in a process that is not connected to Ray: pass it "
            "to a Ray task or actor (which builds the env there), or give a local env ledger.client()"
        )
    node = ray.get_runtime_context().get_node_id()
    return LedgerClient(os.path.join(_socket_dir(token, node), "s"), authkey, dataset)


class _ClusterActor:
    """The cluster ledger's actor: one :class:`ClusterState` under a lock, agents watched."""

    def __init__(self, state: LedgerState, dataset: str) -> None:
        self.lock = threading.Lock()  # guards ``cluster`` and ``agents``
        self.cluster = ClusterState(state, dataset)  # guarded by ``lock``
        self.agents: dict[str, Any] = {}  # node -> its agent's handle; watch/_monitor write
        self.stop = threading.Event()  # set once by close()
        threading.Thread(target=self._monitor, name="torchrl_ext-cluster-watch", daemon=True).start()

    def watch(self, node: str, agent: Any) -> None:
        with self.lock:
            self.agents[node] = agent

    def sync(self, node: str, seq: int, done: list[Any], quarantines: list[Any], want: int) -> SyncReply:
        with self.lock:
            return self.cluster.sync(node, done, quarantines, want, seq)

    def call(self, method: str, *args: Any) -> Any:
        with self.lock:
            state = self.cluster.state
            if method == "stats":
                return self.cluster.stats()
            if method == "finished":
                return state.exhausted()
            if method == "quarantined":
                return dict(state.quarantined)
            return getattr(state, method)(*args)  # state_dict, load_state_dict, completed_in

    def close(self) -> None:
        self.stop.set()

    def _monitor(self) -> None:
        ray = _ray()
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        while not self.stop.wait(PING_EVERY):
            with self.lock:
                agents = dict(self.agents)
            pings = {node: agent.ping.remote() for node, agent in agents.items()}
            for node, ref in pings.items():
                try:
                    ray.get(ref, timeout=CALL_WAIT)
                except (ActorUnavailableError, GetTimeoutError):  # slow or reconnecting: not lost
                    continue
                except RayActorError as err:
                    self._lose(node, err)

    def _lose(self, node: str, err: BaseException) -> None:
        with self.lock:
            self.agents.pop(node, None)
            replayed, quarantined = self.cluster.lose_node(node)
        _logger.warning(
            "torchrl_ext cluster ledger: the agent of node %s is gone (%s); its %d episode(s) go back "
            "to the front of the queue",
            node,
            type(err).__name__,
            len(replayed),
        )
        for index, why in quarantined.items():
            _logger.warning(
                "torchrl_ext cluster ledger: episode %d is quarantined for the rest of the run: %s",
                index,
                why,
            )


class _NodeAgent:
    """One node's agent: today's ledger service over a :class:`NodeState`, synced with the
    cluster actor by one thread."""

    def __init__(
        self, cluster: Any, node: str, token: str, authkey: bytes, dataset: Any, config: dict[str, Any]
    ) -> None:
        self.cluster = cluster  # fixed: the cluster actor's handle
        self.node = node  # fixed
        self.directory = _socket_dir(token, node)  # fixed; removed by close
        self.seq = 0  # the number of the last sync; _sync writes under ``sync_lock``
        self.sync_lock = threading.Lock()  # one sync at a time (a resent one keeps its number)
        self.reaper = bool(config["num_readers"])  # whether this agent holds the reaper
        os.makedirs(self.directory, mode=0o700)
        fifo = acquire_reaper() if self.reaper else ""
        plan = Plan(
            self.directory,
            os.path.join(self.directory, "s"),
            authkey,
            config["num_readers"],
            config["prefetch"],
            config["context"],
            config["reader_nice"],
        )
        state = NodeState(len(dataset), config["epochs"], config["quarantine_after"])
        self.service = _Service(dataset, state, plan, Supervised(os.getpid(), True, owner_tag(), fifo))
        self.thread = threading.Thread(target=self._sync_loop, name="torchrl_ext-ledger-sync", daemon=True)
        self.thread.start()

    def ready(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, float | int]:
        result: dict[str, float | int] = self.service.call("stats", ())
        return result

    def pids(self) -> list[int]:
        result: list[int] = self.service.call("pids", ())
        return result

    def flush(self) -> None:
        """Report what this node completed and quarantined now (before a ``state_dict``)."""
        self._sync(want_more=False)

    def _sync(self, want_more: bool = True) -> int:
        """One sync with the cluster actor; returns how many items it granted."""
        ray = _ray()
        from ray.exceptions import GetTimeoutError

        service, state = self.service, self.service.state
        assert isinstance(state, NodeState)
        with self.sync_lock:
            with service.cond:
                depth = service.plan.prefetch * len(service.connections)
                want = state.wanted(depth) if want_more else 0
                done, quarantines = state.outbox()
            self.seq += 1
            while True:
                try:
                    reply = ray.get(
                        self.cluster.sync.remote(self.node, self.seq, done, quarantines, want),
                        timeout=CALL_WAIT,
                    )
                    break
                except GetTimeoutError:  # sent again with the same number: the same answer
                    if service.closing:
                        return 0
            with service.cond:
                items, quarantined, end = reply
                state.receive(items, quarantined, end, asked=want)
                service.cond.notify_all()
            return len(reply[0])

    def _sync_loop(self) -> None:
        service = self.service
        granted = 0
        while not service.closing:
            if not granted:
                with service.cond:
                    service.cond.wait(SYNC_EVERY)
            try:
                granted = self._sync()
            except Exception as err:  # the cluster actor is gone, or this node was declared lost
                if not service.closing:
                    _logger.warning("torchrl_ext cluster ledger: node %s stops serving: %s", self.node, err)
                    service.close()
                return

    def close(self) -> None:
        self.service.close()
        self.thread.join(CALL_WAIT)
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.reaper:
            self.reaper = False
            release_reaper()


class ClusterEpisodeLedger:
    """:class:`EpisodeLedger` for a Ray cluster: each episode of ``dataset`` to exactly one env
    worker per epoch, across every node.

    Build it in the Ray driver (after ``ray.init()``) and pass it to the Ray tasks or actors that
    build the envs: it unpickles there into a :class:`LedgerClient` of that node's agent, so an
    env written for :class:`EpisodeLedger` (``index, episode = self.episodes.next()`` in
    ``_reset``) runs unchanged.

    * **One bookkeeping.** The epochs, leases, completions, losses and quarantine live in one
      Ray actor (on the driver's node); one agent per node (each node alive when the ledger is
      built) is leased ``prefetch`` episodes per connected env worker at a time, serves that
      node's env workers on a local Unix socket exactly as :class:`EpisodeLedger` does, loads
      episodes on its node (``num_readers`` readers, spool on local disk) and reports
      completions and quarantines every ``SYNC_EVERY`` seconds.
    * **Losses.** An env worker's episode is replayed on its node, as on one machine. A node (its
      agent, and the env workers on it) that Ray reports gone loses every episode it held: each
      is replayed in its own epoch on the other nodes (a loss counted toward
      ``quarantine_after``). An episode whose load raises, or lost ``quarantine_after`` times on
      a node or with nodes, is quarantined cluster-wide. A completion the lost node had not yet
      reported is played again: completed exactly once, played at least once.
    * **The driver.** The cluster actor and the agents are the driver's: when it exits or dies,
      Ray ends them, env workers' ``next()`` raises :class:`LedgerClosedError`, and a
      ``state_dict()`` saved before is the only way to resume the epoch.

    ``stats()`` is the whole cluster's (the one-machine names, plus ``nodes``,
    ``nodes_lost``, ``granted``, ``held_by_nodes``); ``node_stats()`` each live node's.

    Example:
        >>> import ray, torch
        >>> _ = ray.init(num_cpus=1, include_dashboard=False)  # doctest: +SKIP
        >>> episodes = [torch.zeros(2)] * 3
        >>> with ClusterEpisodeLedger(episodes, shuffle=False, epochs=1) as ledger:  # doctest: +SKIP
        ...     sorted(index for index, _episode in ledger.client())
        [0, 1, 2]
    """

    def __init__(
        self,
        dataset: Any,
        num_readers: int = 0,
        shuffle: bool = True,
        seed: int | None = None,
        *,
        epochs: int | None = None,
        quarantine_after: int = 2,
        prefetch: int = 2,
        multiprocessing_context: str | None = None,
        reader_nice: int | None = 19,
    ) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = (shuffle, seed, epochs, quarantine_after)
        state = checked_state(dataset, num_readers, prefetch, options, "ClusterEpisodeLedger")
        if not ray.is_initialized():
            raise RuntimeError("ClusterEpisodeLedger is built in a Ray driver: call ray.init() first")
        self._closed = False
        self._num_episodes = state.num_episodes
        self._token = secrets.token_hex(4)  # fixed: names the agents' sockets
        self._authkey = secrets.token_bytes(32)  # fixed
        self._dataset = dataset if num_readers == 0 else None  # what a client loads itself from
        here = ray.get_runtime_context().get_node_id()
        actor_class = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(_ClusterActor)
        agent_class = ray.remote(num_cpus=0, max_restarts=0)(_NodeAgent)
        self._actor = actor_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
        ).remote(state, describe_dataset(dataset))
        config = {
            "num_readers": num_readers,
            "prefetch": prefetch,
            "context": multiprocessing_context,
            "reader_nice": reader_nice,
            "epochs": epochs,
            "quarantine_after": quarantine_after,
        }
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        self._agents: dict[str, Any] = {}  # node -> its agent; close() empties it
        try:
            for node in nodes:
                self._agents[node] = agent_class.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(self._actor, node, self._token, self._authkey, dataset, config)
            ray.get([agent.ready.remote() for agent in self._agents.values()], timeout=START_WAIT)
            ray.get([self._actor.watch.remote(n, a) for n, a in self._agents.items()], timeout=START_WAIT)
        except BaseException:
            self.close()
            raise

    def __reduce__(self) -> tuple[Any, ...]:
        return (_node_client, (self._token, self._authkey, self._dataset))

    def client(self) -> LedgerClient:
        """A client of this process's node's agent (one episode held per handle and process)."""
        return _node_client(self._token, self._authkey, self._dataset)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self.client())

    @property
    def num_episodes(self) -> int:
        return self._num_episodes

    @property
    def nodes(self) -> list[str]:
        """The node ids that have an agent (lost ones included)."""
        return list(self._agents)

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            from ._ledger import LedgerClosedError

            raise LedgerClosedError("the cluster episode ledger is closed")
        return _ray().get(self._actor.call.remote(method, *args), timeout=CALL_WAIT)

    @property
    def finished(self) -> bool:
        """Every episode of every epoch was handed out and completed (or quarantined), as the
        nodes last reported."""
        return bool(self._call("finished"))

    def node_stats(self) -> dict[str, dict[str, float | int]]:
        """Each live node's :meth:`EpisodeLedger.stats`, by node id (its env workers' counts)."""
        ray = _ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        refs = {node: agent.stats.remote() for node, agent in self._agents.items()}
        result = {}
        for node, ref in refs.items():
            try:
                result[node] = ray.get(ref, timeout=CALL_WAIT)
            except (RayActorError, GetTimeoutError):
                continue
        return result

    def stats(self) -> dict[str, float | int]:
        """The cluster's snapshot: ``epoch``, ``completed``, ``requeued`` (env worker and node
        losses), ``quarantined``, ``duplicates`` (within an epoch: always 0), ``coverage`` from
        the cluster actor; ``served``, ``in_flight``, ``readers``, ``readers_alive``,
        ``reader_restarts``, ``workers_connected``, ``read_bytes`` summed over the live nodes;
        ``data_wait_ms_p50``/``_p95`` the slowest node's; ``nodes``, ``nodes_lost``,
        ``granted`` (episodes leased to nodes) and ``held_by_nodes``."""
        total: dict[str, float | int] = dict(self._call("stats"))
        nodes = list(self.node_stats().values())
        for key in (
            "served",
            "in_flight",
            "readers",
            "readers_alive",
            "reader_restarts",
            "workers_connected",
            "read_bytes",
        ):
            total[key] = sum(node[key] for node in nodes)
        total["requeued"] = total["requeued"] + sum(node["requeued"] for node in nodes)
        for key in ("data_wait_ms_p50", "data_wait_ms_p95"):
            values = [node[key] for node in nodes if node[key] == node[key]]
            total[key] = max(values) if values else float("nan")
        return total

    def pids(self) -> dict[str, list[int]]:
        """Each live node's ledger processes: its agent's, then its readers'."""
        ray = _ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        result = {}
        for node, agent in self._agents.items():
            try:
                result[node] = ray.get(agent.pids.remote(), timeout=CALL_WAIT)
            except (RayActorError, GetTimeoutError):
                continue
        return result

    def quarantined(self) -> dict[int, str]:
        result: dict[int, str] = self._call("quarantined")
        return result

    def completed_in(self, epoch: int) -> frozenset[int]:
        """The indices completed in ``epoch`` as the nodes reported them."""
        result: frozenset[int] = self._call("completed_in", epoch)
        return result

    def state_dict(self) -> dict[str, Any]:
        """The cluster's epoch, position, seed and quarantine, once every live node reported what
        it completed; episodes held by nodes are replayed on resume."""
        ray = _ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        for agent in self._agents.values():
            try:
                ray.get(agent.flush.remote(), timeout=CALL_WAIT)
            except (RayActorError, GetTimeoutError):
                continue
        result: dict[str, Any] = self._call("state_dict")
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (before the first episode is handed out)."""
        self._call("load_state_dict", state_dict)

    def close(self) -> None:
        """Close every agent (env workers' next ``next()`` raises :class:`LedgerClosedError`)
        and end the cluster actor (idempotent)."""
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        if not ray.is_initialized():
            return
        refs = [agent.close.remote() for agent in self._agents.values()]
        try:
            ray.get(self._actor.close.remote(), timeout=CALL_WAIT)
        except Exception:  # gone already
            pass
        for ref in refs:
            try:
                ray.get(ref, timeout=CALL_WAIT)
            except Exception:  # its node is gone
                pass
        for handle in [*self._agents.values(), self._actor]:
            ray.kill(handle)
        for node in self._agents:  # a lost agent's socket directory, where it is on this machine
            shutil.rmtree(_socket_dir(self._token, node), ignore_errors=True)

    def __enter__(self) -> ClusterEpisodeLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
