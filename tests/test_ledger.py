"""``EpisodeLedger``: each episode once per epoch across every env worker, lost episodes
replayed in their epoch, bad ones quarantined, resumable, nothing left behind.

The bookkeeping (``LedgerState``) is tested directly; the ledger through its own handle in
this process, then through ``ManagedParallelEnv`` on every start path and upstream
``ParallelEnv``; its exits in a child interpreter under the subreaper harness.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import Scenario, pid_alive, start_kwargs
from tests.ledger_envs import LENGTH, Episodes, make_ledger_env
from tests.polling import wait_until
from tests.test_exit import LINGER
from torchrl_ext import ManagedParallelEnv
from torchrl_ext.data import (
    EpisodeLedger,
    EpisodeSampler,
    EpochsExhausted,
    LedgerClient,
    LedgerClosedError,
    NoEpisodesError,
)
from torchrl_ext.data._ledger_state import LedgerState, no_episodes_message

ALL_STARTS = [
    pytest.param("preloaded", marks=pytest.mark.compat),
    pytest.param("fork", marks=pytest.mark.compat),
    "forkserver",
    "spawn",
]


@pytest.fixture
def ledger_log(tmp_path: Path) -> Iterator[Callable[[], list[str]]]:
    """What the ledger's process logs: a file handler on the package's logger, which a ledger
    built afterwards inherits (its process is forked), as it inherits an application's."""
    path = tmp_path / "ledger.log"
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("torchrl_ext")
    logger.addHandler(handler)
    try:
        yield lambda: path.read_text().splitlines()
    finally:
        logger.removeHandler(handler)
        handler.close()


def _play(state: LedgerState, holder: int = 1) -> tuple[int, int] | None:
    """One holder takes, leases and later completes items, as a worker's next() does."""
    state.complete(holder)
    item = state.take()
    if item is None:
        return None
    assert state.lease(holder) == item
    return item


# ----------------------------------------------------------------------------- the bookkeeping
@pytest.mark.compat
def test_each_index_once_per_epoch_in_the_samplers_order() -> None:
    state = LedgerState(10, shuffle=True, seed=3, epochs=2)
    played = []
    while (item := _play(state)) is not None:
        played.append(item)
    state.complete(1)
    sampler = EpisodeSampler(10, shuffle=True, seed=3)
    assert [i for e, i in played if e == 0] == sampler.epoch_order(0)
    assert [i for e, i in played if e == 1] == sampler.epoch_order(1)
    assert state.completed_in(0) == state.completed_in(1) == frozenset(range(10))
    assert state.exhausted() and state.duplicates == 0 and state.coverage(1) == 1.0


@pytest.mark.compat
def test_a_lost_item_goes_to_the_front_and_completes_in_its_own_epoch() -> None:
    state = LedgerState(4, shuffle=False, seed=0, epochs=2)
    for holder in (1, 2, 3, 4):  # every item of epoch 0 is held
        _play(state, holder)
    assert _play(state, 1) == (1, 0), "epoch 1 starts as soon as epoch 0 is handed out"
    assert state.lose(3) == (0, 2)
    assert _play(state, 5) == (0, 2), "the lost item comes back first, still of epoch 0"
    for holder in (2, 4, 5):
        state.complete(holder)
    assert state.completed_in(0) == frozenset(range(4)) and state.requeued == 1
    assert state.duplicates == 0


@pytest.mark.compat
def test_an_item_lost_quarantine_after_times_is_skipped_for_the_rest_of_the_run() -> None:
    state = LedgerState(3, shuffle=False, seed=0, epochs=2, quarantine_after=2)
    _play(state, 1)
    assert state.lose(1) == (0, 0)
    _play(state, 1)
    assert state.lose(1) is None, "the second loss quarantines"
    assert 0 in state.quarantined and "lost in flight 2 times" in state.quarantined[0]
    played = [item for item in iter(lambda: _play(state, 2), None)]
    assert played == [(0, 1), (0, 2), (1, 1), (1, 2)]
    state.complete(2)
    assert state.coverage(0) == state.coverage(1) == 1.0 and state.exhausted()


@pytest.mark.compat
def test_quarantine_drops_the_copies_of_other_epochs_already_taken() -> None:
    state = LedgerState(2, shuffle=False, seed=0, epochs=2, quarantine_after=1)
    assert [state.take() for _ in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    state.lease(1)
    assert state.lose(1) is None and 0 in state.quarantined
    assert list(state.pending) == [(0, 1), (1, 1)], "epoch 1's copy of episode 0 is not handed out"


@pytest.mark.compat
def test_a_resumed_state_continues_the_epoch_without_repeating() -> None:
    state = LedgerState(12, shuffle=True, seed=5, epochs=1)
    first = [_play(state, 1) for _ in range(5)]  # 4 completed, the 5th held at the save
    _play(state, 2)  # held too
    saved = pickle.loads(pickle.dumps(state.state_dict()))
    resumed = LedgerState(12, shuffle=True, seed=999, epochs=1)
    resumed.load_state_dict(saved)
    rest = [item for item in iter(lambda: _play(resumed, 1), None)]
    resumed.complete(1)
    completed_before = {i for _e, i in first[:4]}
    assert not completed_before & {i for _e, i in rest}, "nothing completed before the save repeats"
    assert completed_before | {i for _e, i in rest} == set(range(12))
    assert resumed.completed_in(0) == frozenset(range(12)) and resumed.duplicates == 0


@pytest.mark.compat
def test_load_state_dict_refuses_another_dataset_or_a_started_state() -> None:
    saved = LedgerState(5, seed=0).state_dict()
    with pytest.raises(ValueError, match="5 episodes; this one has 6"):
        LedgerState(6, seed=0).load_state_dict(saved)
    started = LedgerState(5, seed=0)
    _play(started)
    with pytest.raises(RuntimeError, match="before the ledger hands out"):
        started.load_state_dict(saved)


@pytest.mark.compat
@pytest.mark.parametrize("epochs", [None, 2])
def test_a_state_whose_every_episode_is_quarantined_can_serve_none_and_covers_nothing(
    epochs: int | None,
) -> None:
    state = LedgerState(3, shuffle=False, seed=0, epochs=epochs, quarantine_after=1)
    assert state.can_serve() and state.coverage(0) == 0.0
    for reason in ("ValueError: a", "ValueError: b", "ValueError: c"):
        item = state.take()
        assert item is not None
        state.quarantine(item, reason)
    assert state.take() is None and not state.can_serve()
    assert state.coverage(0) == 0.0 and state.done == 0, "nothing completed is no coverage"
    assert not state.exhausted() or epochs is not None
    assert state.first_causes() == [(0, "ValueError: a"), (1, "ValueError: b"), (2, "ValueError: c")]


@pytest.mark.compat
def test_the_no_episodes_message_names_the_dataset_and_the_first_causes() -> None:
    empty = no_episodes_message("Logs('/data/missing')", 0)
    assert "Logs('/data/missing') has no episode" in empty and "folder that does not exist" in empty
    causes = [(f"episode {i} (/d/{i}.csv)", f"ValueError: bad {i}") for i in range(5)]
    dead = no_episodes_message("Logs('/d')", 5, causes)
    assert "Logs('/d')" in dead and "all 5 are quarantined" in dead
    assert "episode 0 (/d/0.csv): ValueError: bad 0" in dead and "bad 2" in dead
    assert "bad 3" not in dead and "2 more" in dead


# --------------------------------------------------------------------------- the ledger itself
@pytest.mark.compat
@pytest.mark.parametrize("num_readers", [0, 1, 2])
def test_the_same_seed_hands_out_the_same_order(num_readers: int) -> None:
    orders = []
    for _ in range(2):
        with EpisodeLedger(Episodes(9), num_readers=num_readers, seed=7, epochs=2) as ledger:
            got = list(ledger)
            assert all(torch.equal(ep, torch.full((LENGTH,), float(i))) for i, ep in got)
            orders.append([i for i, _ep in got])
            stats = ledger.stats()
            assert ledger.finished and stats["completed"] == 18 and stats["duplicates"] == 0
    sampler = EpisodeSampler(9, seed=7)
    assert orders[0] == orders[1] == sampler.epoch_order(0) + sampler.epoch_order(1)


@pytest.mark.compat
def test_stats_is_a_flat_snapshot() -> None:
    with EpisodeLedger(Episodes(4), num_readers=2, seed=0) as ledger:
        list(islice(ledger, 6))
        stats = ledger.stats()
        assert set(stats) >= {
            "epoch",
            "served",
            "completed",
            "requeued",
            "quarantined",
            "duplicates",
            "coverage",
            "readers_alive",
            "data_wait_ms_p50",
            "data_wait_ms_p95",
            "read_bytes",
        }
        assert all(isinstance(v, int | float) for v in stats.values())
        assert stats["epoch"] == 1 and stats["served"] == 6 and stats["completed"] == 5
        assert stats["coverage"] == 0.25 and stats["readers_alive"] == 2
        assert len(ledger.pids()) == 3


@pytest.mark.compat
@pytest.mark.parametrize("num_readers", [0, 2])
def test_an_episode_whose_load_raises_is_quarantined_named_once_and_the_run_goes_on(
    num_readers: int, ledger_log: Callable[[], list[str]]
) -> None:
    with EpisodeLedger(Episodes(6, corrupt=(3,)), num_readers=num_readers, seed=1, epochs=2) as ledger:
        got = [i for i, _ep in ledger]
        assert sorted(got) == [0, 0, 1, 1, 2, 2, 4, 4, 5, 5]
        assert list(ledger.quarantined()) == [3] and "truncated log in episode 3" in ledger.quarantined()[3]
        assert ledger.stats()["quarantined"] == 1 and ledger.stats()["coverage"] == 1.0
    named = [line for line in ledger_log() if "quarantined" in line]
    assert len(named) == 1 and "episode 3 (/logs/episode-003.bin)" in named[0], named


@pytest.mark.compat
def test_an_episode_that_kills_its_reader_is_quarantined_after_two_losses(
    ledger_log: Callable[[], list[str]],
) -> None:
    with EpisodeLedger(Episodes(5, crash=(2,)), num_readers=2, seed=0, epochs=1, shuffle=False) as ledger:
        assert [i for i, _ep in ledger] == [0, 1, 3, 4]
        stats = ledger.stats()
        assert stats["reader_restarts"] == 2 and stats["readers_alive"] == 2
        assert "lost 2 times" in ledger.quarantined()[2]
    died = [line for line in ledger_log() if "reader pid" in line and "died" in line]
    assert len(died) == 2 and all("SIGKILL(-9)" in m and "episode 2" in m for m in died), died


@pytest.mark.compat
def test_a_resumed_ledger_continues_the_epoch_without_repeating() -> None:
    with EpisodeLedger(Episodes(10), num_readers=2, seed=4, epochs=1) as ledger:
        first = [i for i, _ep in islice(ledger, 4)]  # 3 completed; the 4th is held at the save
        saved = ledger.state_dict()
        assert ledger.stats()["completed"] == 3
    with EpisodeLedger(Episodes(10), num_readers=2, seed=None, epochs=1) as resumed:
        resumed.load_state_dict(saved)
        rest = [i for i, _ep in resumed]
        assert resumed.completed_in(0) == frozenset(range(10))
    assert rest[0] == first[3], "the episode held at the save is replayed first"
    assert not set(first[:3]) & set(rest) and sorted(first[:3] + rest) == list(range(10))


@pytest.mark.compat
def test_a_closed_ledger_says_so_and_pickles_into_a_client() -> None:
    ledger = EpisodeLedger(Episodes(3), num_readers=1, seed=0)
    client = pickle.loads(pickle.dumps(ledger))
    assert isinstance(client, LedgerClient)
    assert client.next()[0] in range(3)
    pids = ledger.pids()
    ledger.close()
    ledger.close()  # idempotent
    wait_until(lambda: not any(pid_alive(p) for p in pids), "the ledger's processes are gone")
    with pytest.raises(LedgerClosedError):
        client.next()
    with pytest.raises(LedgerClosedError):
        ledger.next()


@pytest.mark.compat
def test_epochs_end_with_a_clear_signal() -> None:
    with EpisodeLedger(Episodes(2), num_readers=1, seed=0, epochs=1) as ledger:
        ledger.next(), ledger.next()
        with pytest.raises(EpochsExhausted, match="every episode of the ledger's 1 epoch"):
            ledger.next()


class _Folder:
    """A dataset of the files in a folder, named by it (as a user's dataset is)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = sorted(root.glob("*.csv"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(1)

    def __repr__(self) -> str:
        return f"_Folder({str(self.root)!r})"


@pytest.mark.compat
def test_a_ledger_over_no_episode_says_so_and_names_its_dataset(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(NoEpisodesError, match="has no episode") as info:
        EpisodeLedger(_Folder(missing), num_readers=2)
    assert str(missing) in str(info.value) and "episode ledger" in str(info.value)
    assert not isinstance(info.value, EpochsExhausted | ValueError)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before, "nothing started"


@pytest.mark.compat
@pytest.mark.parametrize(("num_readers", "epochs"), [(0, None), (2, None), (2, 1)])
def test_a_ledger_whose_every_episode_is_quarantined_raises_its_own_error(
    num_readers: int, epochs: int | None
) -> None:
    dataset = Episodes(3, corrupt=(0, 1, 2))
    with EpisodeLedger(dataset, num_readers=num_readers, shuffle=False, epochs=epochs) as ledger:
        for _ in range(2):  # every next() from then on, never EpochsExhausted
            with pytest.raises(NoEpisodesError) as info:
                ledger.next()
            message = str(info.value)
            assert "Episodes of 3 episode(s), the first at /logs/episode-000.bin" in message
            assert "all 3 are quarantined" in message
            assert "episode 0 (/logs/episode-000.bin): ValueError: truncated log in episode 0" in message
        with pytest.raises(NoEpisodesError):
            list(ledger)  # iterating does not end quietly either
        stats = ledger.stats()
        assert stats["completed"] == 0 and stats["quarantined"] == 3 and stats["coverage"] == 0.0


def _never_answers(*args: Any) -> None:
    """A ledger process that starts and then says nothing (a stand-in for one that hangs)."""
    args[-1].enter()  # its Supervised: its own group, dies with its parent
    threading.Event().wait()


@pytest.mark.compat
def test_a_ledger_whose_process_never_answers_fails_to_build_within_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchrl_ext.data import _ledger

    monkeypatch.setattr(_ledger, "serve", _never_answers)
    monkeypatch.setattr(_ledger, "START_WAIT", 1.0)
    monkeypatch.setattr(_ledger, "_CLOSE_WAIT", 1.0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="could not start: no answer within 1 s"):
        EpisodeLedger(Episodes(3), num_readers=1, multiprocessing_context="fork")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before, "its process is ended"


@pytest.mark.compat
def test_a_connection_that_never_says_hello_is_closed_within_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from multiprocessing.connection import Client

    from torchrl_ext.data import _ledger_service

    monkeypatch.setattr(_ledger_service, "HELLO_WAIT", 0.5)  # the ledger's process is forked
    with EpisodeLedger(Episodes(3), num_readers=0, seed=0) as ledger:
        address, authkey, _dataset = ledger.client().__reduce__()[1]
        silent = Client(address, family="AF_UNIX", authkey=authkey)
        try:
            assert silent.poll(30), "the ledger still holds a connection that said nothing"
            with pytest.raises(EOFError):
                silent.recv()
        finally:
            silent.close()
        assert ledger.next()[0] in range(3), "the ledger serves on"


# ----------------------------------------------------------------------------- with env workers
def _play_until_finished(
    env: Any, ledger: EpisodeLedger, kill_in_epochs: tuple[int, ...] = ()
) -> list[tuple[int, int]]:
    """Step ``env`` until the ledger is finished; SIGKILL worker 0 mid-episode (at t=1) once in
    each epoch of ``kill_in_epochs``. Returns the ``(epoch, index)`` each victim held."""
    killed: list[tuple[int, int]] = []
    td = env.reset()
    for _ in range(400):
        index, epoch, t = (int(v) for v in td["observation"][0])
        due = [e for e in kill_in_epochs if e not in {k[0] for k in killed}]
        if due and epoch == due[0] and t == 1 and index >= 0:
            killed.append((epoch, index))
            victim = env.worker_pids[0]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda v=victim: not pid_alive(v), "the worker is dead")
        _out, td = env.step_and_maybe_reset(env.rand_action(td))
        if ledger.finished:
            return killed
    raise AssertionError(f"the ledger never finished: {ledger.stats()}")


@pytest.mark.parametrize("method", ALL_STARTS)
def test_two_epochs_each_episode_once_while_a_worker_is_killed_mid_episode(method: str) -> None:
    ledger = EpisodeLedger(Episodes(24), num_readers=2, seed=0, epochs=2)
    env = ManagedParallelEnv(
        3, make_ledger_env, create_env_kwargs={"episodes": ledger}, max_restarts=4, **start_kwargs(method)
    )
    try:
        killed = _play_until_finished(env, ledger, kill_in_epochs=(0, 1))
        env.close()
        assert [k[0] for k in killed] == [0, 1] and len(env.restarts) == 2
        stats = ledger.stats()
        for epoch, index in killed:
            assert index in ledger.completed_in(epoch), "the killed episode completed in its epoch"
        assert ledger.completed_in(0) == ledger.completed_in(1) == frozenset(range(24))
        assert stats["duplicates"] == 0 and stats["requeued"] == 2 and stats["served"] == 50
    finally:
        env.close(raise_if_closed=False)
        ledger.close()


@pytest.mark.parametrize("method", ALL_STARTS[:2])
def test_an_episode_that_kills_every_worker_loading_it_is_quarantined(method: str) -> None:
    """``num_readers=0``: workers load episodes themselves, and episode 5 SIGKILLs whoever
    loads it. Two workers die with it (``max_restarts`` replaces them); then it is quarantined
    and every other episode of both epochs is played once."""
    ledger = EpisodeLedger(Episodes(12, crash=(5,)), num_readers=0, seed=0, epochs=2)
    env = ManagedParallelEnv(
        3, make_ledger_env, create_env_kwargs={"episodes": ledger}, max_restarts=4, **start_kwargs(method)
    )
    try:
        _play_until_finished(env, ledger)
        env.close()
        stats = ledger.stats()
        assert len(env.restarts) == 2 and "lost in flight 2 times" in ledger.quarantined()[5]
        rest = frozenset(range(12)) - {5}
        assert ledger.completed_in(0) == ledger.completed_in(1) == rest
        assert stats["duplicates"] == 0 and stats["quarantined"] == 1 and stats["coverage"] == 1.0
    finally:
        env.close(raise_if_closed=False)
        ledger.close()


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_recycled_workers_complete_the_episodes_they_played(method: str) -> None:
    """``recycle_every=2``: every worker retires at an episode boundary, its last episode played
    to the end, and closes: that episode completes; none is replayed."""
    ledger = EpisodeLedger(Episodes(12), num_readers=2, seed=0, epochs=2)
    env = ManagedParallelEnv(
        3, make_ledger_env, create_env_kwargs={"episodes": ledger}, recycle_every=2, **start_kwargs(method)
    )
    try:
        _play_until_finished(env, ledger)
        assert env.stats()["recycles"] >= 3
        env.close()
        stats = ledger.stats()
        assert ledger.completed_in(0) == ledger.completed_in(1) == frozenset(range(12))
        assert stats["duplicates"] == 0 and stats["requeued"] == 0 and stats["served"] == 24
    finally:
        env.close(raise_if_closed=False)
        ledger.close()


@pytest.mark.parametrize("method", ALL_STARTS)
def test_an_env_that_replays_on_epochs_exhausted_fails_loudly_on_a_dead_dataset(method: str) -> None:
    """``LedgerEnv`` catches ``EpochsExhausted`` to replay (as the docs' example does): a dataset
    whose every episode fails to load must still end the run, with the ledger's error."""
    ledger = EpisodeLedger(Episodes(4, corrupt=(0, 1, 2, 3)), num_readers=2, seed=0, epochs=1)
    env = ManagedParallelEnv(
        2, make_ledger_env, create_env_kwargs={"episodes": ledger}, **start_kwargs(method)
    )
    try:
        with pytest.raises(Exception) as info:
            env.rollout(6, break_when_any_done=False)
        assert "NoEpisodesError" in repr(info.value) or isinstance(info.value, NoEpisodesError)
        assert "all 4 are quarantined" in str(info.value)
    finally:
        env.close(raise_if_closed=False)
        ledger.close()


@pytest.mark.compat
@pytest.mark.parametrize("num_readers", [0, 2])
def test_upstream_parallel_env_with_daemonic_workers(num_readers: int) -> None:
    from torchrl.envs import ParallelEnv

    ledger = EpisodeLedger(Episodes(12), num_readers=num_readers, seed=0, epochs=1)
    env = ParallelEnv(2, make_ledger_env, create_env_kwargs={"episodes": ledger}, mp_start_method="fork")
    try:
        _play_until_finished(env, ledger)
        env.close()
        assert ledger.completed_in(0) == frozenset(range(12)) and ledger.stats()["duplicates"] == 0
    finally:
        env.close(raise_if_closed=False)
        ledger.close()


# ------------------------------------------------------------------------------------ its exits
@pytest.mark.parametrize(
    ("how", "method"),
    [
        pytest.param("SIGKILL", "preloaded", marks=pytest.mark.compat),
        pytest.param("SIGKILL", "fork", marks=pytest.mark.compat),
        ("SIGTERM", "preloaded"),
        ("SIGINT", "preloaded"),
        ("exit_without_close", "preloaded"),
    ],
)
def test_no_exit_of_the_owner_leaves_a_ledger_process_behind(
    scenario: Scenario, tmp_path: Path, how: str, method: str
) -> None:
    name = "exit_without_close" if how == "exit_without_close" else "replay_forever"
    scenario.start(name, "--method", method, module="tests.ledger_scenarios", linger=LINGER)
    ready = scenario.wait_ready()
    assert len(ready["ledger"]) == 3 and set(ready["ledger"]) <= set(ready["tree"])
    if how != "exit_without_close":
        os.kill(ready["pid"], getattr(signal, how))
    result = scenario.finish()
    if how == "exit_without_close":
        assert result.returncode == 0, result.stderr[-3000:]
    if how == "SIGTERM":
        assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    if how != "SIGKILL":  # a close ended the ledger's processes as its own: nothing to report
        assert "leftover" not in result.stderr, result.stderr[-3000:]
    assert not result.leaked, f"processes outlived the owner by {LINGER}s: {result.leaked}"
    assert not any(psutil.pid_exists(pid) and pid_alive(pid) for pid in ready["ledger"])
    runtime = [p for p in Path(tempfile.gettempdir()).glob(f"torchrl_ext-{ready['pid']}-*")]
    assert not runtime, f"the owner's runtime directory is left: {runtime}"
