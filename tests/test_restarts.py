"""Restarts (``max_restarts``, ``restart_window``, ``step_timeout``, ``restart_on_error``).

A lost worker's slot is replaced, the call in flight returns normally, the slot's transition is
marked (``("next", "worker_restarted")``), the other slots' data is what they computed, and the
lost worker's tree is gone. The ToyEnv (``tests/envs.py``) makes values checkable: episode ``e``
observes ``arange(4) + 100 * e + t`` at step ``t``, every env starts at episode 0, reward 1.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.collector_scenarios import (
    check_toy_batch,
    collector_classes,
    make_managed_env,
    make_policy,
    read_restart_logs,
)
from tests.conftest import Scenario, fd_count, pid_alive, shm_entries, start_kwargs
from tests.envs import OBS, ToyEnv, _claim, make_env
from tests.polling import wait_until
from tests.test_faults import assert_no_shm_growth
from torchrl_ext import ManagedParallelEnv, RestartRecord, WorkerDiedError, WorkerHungError

COLLECTORS = collector_classes()
pytestmark = pytest.mark.filterwarnings("ignore:The env passed to Collector is missing transforms")

FIRST_OBS = torch.arange(OBS, dtype=torch.float32)  # a fresh env's first reset: episode 0, t = 0

#: Longer than any reset of the test envs takes on a loaded 2-core machine (it bounds resets too).
STEP_TIMEOUT = 2.0

#: Every start; on TorchRL 0.10.1 (the compat suite) the two that import no torch per worker.
ALL_STARTS = [
    pytest.param("fork", marks=pytest.mark.compat),
    "forkserver",
    "spawn",
    pytest.param("preloaded", marks=pytest.mark.compat),
]
#: ALL_STARTS but spawn (see tests/conftest.NOT_SPAWNED).
NOT_SPAWNED_STARTS = [p for p in ALL_STARTS if p != "spawn"]


def _children_of(pid_dir: Path, pid: int) -> list[int]:
    """The DataLoader workers and simulators the worker ``pid`` recorded."""
    return [
        int(p.read_text())
        for p in pid_dir.iterdir()
        if p.name.split("-")[0] in ("dl", "sim") and f"-{pid}-" in p.name
    ]


def _kill_when(pid_dir: Path, what: str, pid: int, victim: int | None = None) -> threading.Thread:
    """SIGKILL ``victim`` (default: ``pid``) as soon as ``pid`` records ``what`` (``stepping``,
    ``resetting``)."""

    def run() -> None:
        wait_until(lambda: any(pid_dir.glob(f"{what}-{pid}-*")), f"worker {pid} {what}")
        os.kill(pid if victim is None else victim, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_marked(next_td: Any, slot: int) -> None:
    """``next_td`` (the "next" of one batch step) holds a marked transition at ``slot``."""
    assert next_td["worker_restarted"][slot].item() is True
    assert next_td["done"][slot].item() is True
    assert next_td["truncated"][slot].item() is True
    assert next_td["terminated"][slot].item() is False
    assert next_td["reward"][slot].item() == 0.0
    assert torch.equal(next_td["observation"][slot], FIRST_OBS)  # the fresh env's reset


def _assert_unmarked(next_td: Any, slot: int) -> None:
    assert next_td["worker_restarted"][slot].item() is False
    assert next_td["truncated"][slot].item() is False


@pytest.fixture
def captured_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    yield caplog


@pytest.mark.parametrize(
    "method", [pytest.param("fork", marks=pytest.mark.compat), "forkserver", "spawn", "preloaded"]
)
def test_worker_killed_mid_step_is_replaced_and_its_transition_marked(
    method: str, tmp_path: Path, captured_warnings: pytest.LogCaptureFixture
) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(
            make_env,
            loader="persistent",
            dl_context="fork",
            subprocess_kind="plain",
            pid_dir=str(tmp_path),
            step_sleep=0.05,
        ),
        # Worker 1 SIGKILLs itself inside its first step: the death is mid-step whatever the load.
        create_env_kwargs=[{}, {"die_once_at_step": 1, "die_flag": str(tmp_path / "die")}],
        daemon_workers=False,
        max_restarts=2,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        assert env.done_keys == ["done", "terminated", "truncated", "worker_restarted"]
        assert not td["worker_restarted"].any()
        victim = env.worker_pids[1]
        victim_children = _children_of(tmp_path, victim)
        assert len(victim_children) == 3  # 2 DataLoader workers, 1 simulator
        out = env.step(env.rand_action(td))  # returns normally
        nxt = out["next"]
        _assert_marked(nxt, 1)
        _assert_unmarked(nxt, 0)
        # The other slot's data is exactly what it computed: episode 0, step 1.
        assert torch.equal(nxt["observation"][0], FIRST_OBS + 1)
        assert nxt["reward"][0].item() == 1.0 and not nxt["done"][0].item()
        # The dead worker's tree went before its replacement started.
        assert not [pid for pid in victim_children if pid_alive(pid)]
        (record,) = env.restarts
        assert isinstance(record, RestartRecord)
        assert (record.slot, record.old_pid, record.cause, record.command) == (1, victim, -9, "step")
        assert record.new_pid == env.worker_pids[1] != victim and record.ready_after >= 0
        warnings = [r.getMessage() for r in captured_warnings.records if "restarted worker" in r.getMessage()]
        assert len(warnings) == 1 and str(record) in warnings[0] and "SIGKILL(-9)" in warnings[0]
        # The slot goes on: the marked slot is done, so a rollout resets it and both run on.
        rollout = env.rollout(6, break_when_any_done=False)
        assert not rollout["next", "worker_restarted"].any()
        assert len(_children_of(tmp_path, env.worker_pids[1])) == 3
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None and report.restarts == 1 and report.clean, str(report)


def lose_worker_between_calls(env: ManagedParallelEnv) -> tuple[Any, Any, int]:
    """Reset and step a 3-worker ToyEnv, SIGKILL worker 2, step again: that step returns with
    slot 2 marked, the others stepped on, and the fresh env's reset as slot 2's next root.
    Returns the step, the next root and the killed pid."""
    td = env.reset()
    _out, td = env.step_and_maybe_reset(env.rand_action(td))
    victim = env.worker_pids[2]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: not pid_alive(victim), "the worker is dead")
    out, root = env.step_and_maybe_reset(env.rand_action(td))
    _assert_marked(out["next"], 2)
    for slot in (0, 1):
        _assert_unmarked(out["next"], slot)
        assert torch.equal(out["next", "observation"][slot], FIRST_OBS + 2)
    assert torch.equal(root["observation"][2], FIRST_OBS)
    return out, root, victim


@pytest.mark.parametrize("method", NOT_SPAWNED_STARTS)
def test_worker_lost_between_calls_marks_the_next_step(method: str) -> None:
    env = ManagedParallelEnv(3, make_env, daemon_workers=False, max_restarts=1, **start_kwargs(method))
    try:
        _out, root, victim = lose_worker_between_calls(env)
        assert not root["worker_restarted"].any() and not root["done"].any()
        (record,) = env.restarts
        assert record.slot == 2 and record.old_pid == victim
        # The mark is cleared at the next step.
        out, root = env.step_and_maybe_reset(env.rand_action(root))
        assert not out["next", "worker_restarted"].any()
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 1)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", NOT_SPAWNED_STARTS)
def test_reset_in_flight_is_replayed_on_the_replacement(method: str, tmp_path: Path) -> None:
    # Worker 0 SIGKILLs itself inside its first reset (once: not the replacement).
    die = {"die_once_at_reset": 1, "die_flag": str(tmp_path / "die"), "pid_dir": str(tmp_path)}
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[die, {}],
        daemon_workers=False,
        max_restarts=1,
        **start_kwargs(method),
    )
    try:
        env.start()
        victim = env.worker_pids[0]
        td = env.reset()  # returns normally: the replacement ran the same reset
        assert list(tmp_path.glob(f"resetting-{victim}-*")), "the worker died inside its reset"
        assert torch.equal(td["observation"], torch.stack([FIRST_OBS, FIRST_OBS]))
        assert not td["worker_restarted"].any() and not td["done"].any()
        (record,) = env.restarts
        assert (record.slot, record.old_pid, record.command) == (0, victim, "reset")
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize(
    # not spawn: conftest.NOT_SPAWNED
    "method",
    [pytest.param("fork", marks=pytest.mark.compat), "forkserver", "preloaded"],
)
def test_hung_step_is_killed_then_restarted_or_raised(method: str, tmp_path: Path) -> None:
    # The hung worker holds a simulator (started in __init__: a reset, which step_timeout bounds
    # too, stays fast on a loaded machine).
    hangs = [{}, {"step_sleep": 3600.0, "pid_dir": str(tmp_path), "subprocess_kind": "plain"}]
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=hangs,
        daemon_workers=False,
        max_restarts=1,
        step_timeout=STEP_TIMEOUT,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        hung = env.worker_pids[1]
        hung_children = _children_of(tmp_path, hung)
        out = env.step(env.rand_action(td))
        _assert_marked(out["next"], 1)
        assert torch.equal(out["next", "observation"][0], FIRST_OBS + 1)
        (record,) = env.restarts
        assert (record.slot, record.old_pid, record.cause, record.command) == (1, hung, "hung", "step")
        assert "hung" in str(record)
        assert len(hung_children) == 1
        assert not pid_alive(hung) and not [p for p in hung_children if pid_alive(p)]
        # The replacement hangs too, and the budget is spent: WorkerHungError.
        with pytest.raises(WorkerHungError) as info:
            env.step(env.rand_action(out.exclude("next")))
        err = info.value
        assert isinstance(err, WorkerDiedError) and err.worker_index == 1 and err.timeout == STEP_TIMEOUT
        assert (
            f"step_timeout={STEP_TIMEOUT:g}s" in str(err)
            and "restarts so far (1)" in str(err)
            and "hung" in str(err)
        )
        with pytest.raises(WorkerHungError):  # the same error again, at once
            env.reset()
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_hung_step_without_restarts_raises_worker_hung_error() -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"step_sleep": 3600.0}],
        daemon_workers=False,
        step_timeout=STEP_TIMEOUT,
        mp_start_method="fork",
    )
    try:
        td = env.reset()
        hung = env.worker_pids[1]
        with pytest.raises(WorkerHungError) as info:
            env.step(env.rand_action(td))
        assert (info.value.worker_index, info.value.pid, info.value.last_command) == (1, hung, "step")
        assert "Raise `step_timeout`" in str(info.value)
        assert env.restarts == [] and not pid_alive(hung)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize(
    ("restart_on_error", "method"),
    [
        pytest.param(False, "fork", marks=pytest.mark.compat),
        pytest.param(True, "fork", marks=pytest.mark.compat),
        (True, "forkserver"),
        pytest.param(True, "preloaded", marks=pytest.mark.compat),
    ],
)
def test_env_errors_reraised_unless_restart_on_error(restart_on_error: bool, method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}],
        daemon_workers=False,
        max_restarts=1,
        restart_on_error=restart_on_error,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        if not restart_on_error:
            with pytest.raises(ZeroDivisionError, match="boom in step"):
                env.step(env.rand_action(td))
            assert env.restarts == []
            return
        out = env.step(env.rand_action(td))
        _assert_marked(out["next"], 1)
        (record,) = env.restarts
        assert (record.slot, record.cause, record.command) == (1, "ZeroDivisionError", "step")
        # The replacement raises too; no restart left: the env's own error, with its type.
        with pytest.raises(ZeroDivisionError, match="boom in step") as info:
            env.step(env.rand_action(out.exclude("next")))
        assert any("not restarted" in note for note in getattr(info.value, "__notes__", []))
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.parametrize("window", [None, 1e-6])
def test_restart_window_bounds_the_budget(window: float | None) -> None:
    env = ManagedParallelEnv(
        2, make_env, daemon_workers=False, max_restarts=1, restart_window=window, mp_start_method="fork"
    )
    try:
        td = env.reset()
        for kill in range(2):
            victim = env.worker_pids[0]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda victim=victim: not pid_alive(victim), "the worker is dead")
            if kill == 1 and window is None:
                with pytest.raises(WorkerDiedError) as info:
                    env.step_and_maybe_reset(env.rand_action(td))
                message = str(info.value)
                assert "max_restarts=1 within the env's life" in message and "restarts so far (1)" in message
                assert str(env.restarts[0]) in message
                return
            _out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert len(env.restarts) == 2  # each loss was alone in its (tiny) window
    finally:
        env.close(raise_if_closed=False)


def test_restart_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        ManagedParallelEnv(1, make_env, max_restarts=-1)
    with pytest.raises(ValueError, match="step_timeout"):
        ManagedParallelEnv(1, make_env, step_timeout=0)
    with pytest.raises(ValueError, match="restart_window"):
        ManagedParallelEnv(1, make_env, restart_window=-2.0)
    env = ManagedParallelEnv(1, make_env, max_restarts=1, use_buffers=False, mp_start_method="fork")
    with pytest.raises(ValueError, match="use_buffers"):
        env.reset()


@pytest.mark.compat
def test_without_restarts_specs_and_errors_are_unchanged() -> None:
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, mp_start_method="fork")
    try:
        assert env.done_keys == ["done", "terminated"]
        env.reset()
        os.kill(env.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.rollout(50)
        assert env.restarts == []
    finally:
        env.close(raise_if_closed=False)


#: Restarts of the leak test: 20, or 6 under spawn (each replacement imports torch, about 4 s
#: on 2 cores; one descriptor or /dev/shm entry per restart already fails at 6).
REPEATED_RESTARTS = {"spawn": 6}


@pytest.mark.parametrize("method", ALL_STARTS)
def test_twenty_restarts_leak_nothing(method: str, tmp_path: Path) -> None:
    cycles = REPEATED_RESTARTS.get(method, 20)
    env = ManagedParallelEnv(
        2,
        functools.partial(
            make_env, loader="persistent", dl_context="fork", subprocess_kind="plain", pid_dir=str(tmp_path)
        ),
        daemon_workers=False,
        max_restarts=20,
        restart_backoff=None,  # ten restarts in a row per slot: leaks are the point, not waits
        **start_kwargs(method),
    )
    td = env.reset()
    _out, td = env.step_and_maybe_reset(env.rand_action(td))
    fds, threads, shm = fd_count(), threading.active_count(), shm_entries()
    lost: list[int] = []
    try:
        for cycle in range(cycles):
            victim = env.worker_pids[cycle % 2]
            lost += [victim, *_children_of(tmp_path, victim)]
            os.kill(victim, signal.SIGKILL)
            _out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert len(env.restarts) == cycles
        assert not [pid for pid in lost if pid_alive(pid)]
        # No descriptor, thread or /dev/shm entry per restart (the supervisor closes a retired
        # worker's pidfd in its own thread: poll). The current workers' events are in use:
        # under spawn and forkserver their semaphores are named, and new since the snapshot.
        wait_until(lambda: fd_count() <= fds + 2, f"fds back to {fds} (now {fd_count()})")
        assert threading.active_count() <= threads + 1
        assert_no_shm_growth(shm, cycles=cycles, in_use=env.__dict__.get("_events") or [])
        me = psutil.Process()
        assert not [c for c in me.children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    finally:
        env.close(raise_if_closed=False)
    assert env.supervision_report is not None and env.supervision_report.restarts == cycles


@pytest.mark.compat
def test_set_seed_after_a_loss_seeds_the_replacement() -> None:
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, max_restarts=1, mp_start_method="fork")
    try:
        env.set_seed(3)  # ToyEnv: a seed picks the first episode
        reference = env.reset()
        os.kill(env.worker_pids[1], signal.SIGKILL)
        env.set_seed(3)  # the worker's loss shows up here: replaced, then every worker seeded again
        td = env.reset()
        assert len(env.restarts) == 1
        assert torch.equal(td["observation"], reference["observation"])
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- collectors
def _die_once(tmp_path: Path, at_step: int) -> dict[str, Any]:
    return {"die_once_at_step": at_step, "die_flag": str(tmp_path / f"die-{at_step}")}


@pytest.mark.compat
def test_single_process_collector_never_sees_the_loss(tmp_path: Path) -> None:
    env = make_managed_env(
        num_workers=2,
        loader="persistent",
        max_restarts=2,
        create_env_kwargs=[{}, _die_once(tmp_path, 7)],
    )
    collector = COLLECTORS["single"](env, make_policy(), frames_per_batch=20, total_frames=60)
    batches = list(collector)
    collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(2, 10)] * 3
    data = torch.cat(batches, dim=-1)
    marked = data["next", "worker_restarted"].squeeze(-1)
    assert marked.sum().item() == 1 and marked[1].any() and not marked[0].any()
    assert (data["next", "done"].squeeze(-1) | ~marked).all() and not data["next", "terminated"][marked].any()
    # Slot 0 ran undisturbed: one trajectory of 30 steps.
    assert check_toy_batch(data[:1], first=True) == 5
    assert len(env.restarts) == 1


@pytest.mark.compat
@pytest.mark.parametrize("kind", ["multisync", "multiasync"])
def test_multi_collectors_never_see_the_loss(kind: str, tmp_path: Path, restore_start_method: None) -> None:
    """Each collector worker's env logs its own restarts and the marked transitions it returned
    (``RestartLoggingEnv``): a ``MultiAsyncCollector`` stops at ``total_frames`` without
    delivering every batch its workers collected, so the claim is proven from the collector
    workers' own records, not from the delivered batches."""
    log_dir = tmp_path / "restart-logs"
    log_dir.mkdir()
    env_fn = functools.partial(
        make_managed_env,
        num_workers=2,
        loader="persistent",
        max_restarts=2,
        create_env_kwargs=[{}, _die_once(tmp_path, 4)],
        restart_log=str(log_dir),
    )
    collector = COLLECTORS[kind]([env_fn, env_fn], make_policy(), frames_per_batch=40, total_frames=160)
    try:
        workers = [proc.pid for proc in collector.procs]
        batches = list(collector)
    finally:
        collector.shutdown()
        for proc in collector.procs:
            proc.join(timeout=10)
    assert sum(b.numel() for b in batches) == 160
    # One die flag for all four env workers: exactly one of them died, at its 4th step.
    died = int((tmp_path / "die-4").read_text())
    logs = read_restart_logs(log_dir)
    assert len(workers) == 2 and set(workers) <= set(logs), (workers, sorted(logs))
    restarts = {pid: logs[pid][-1]["restarts"] for pid in workers}
    marks = {pid: [(line["step"], slot) for line in logs[pid] for slot in line["marked"]] for pid in workers}
    lost_in = [pid for pid in workers if restarts[pid]]
    # The loss was a restart, in one collector worker, of the env worker that died.
    assert len(lost_in) == 1 and len(restarts[lost_in[0]]) == 1, restarts
    (owner,) = lost_in
    ((slot, old_pid, new_pid, cause, command),) = restarts[owner]
    assert (slot, old_pid, cause) == (1, died, -9) and new_pid != died
    assert command in ("step", "step_and_maybe_reset"), command
    # That collector worker saw the loss as one marked transition: in the restarted slot, in
    # the step the worker died in (its 4th), and in no other step; the other saw no mark.
    restarted_at = next(line["step"] for line in logs[owner] if line["restarts"])
    assert restarted_at == 4 and marks[owner] == [(4, 1)], logs[owner]
    assert not [marks[pid] for pid in workers if pid != owner and marks[pid]], marks
    delivered = sum(int(b["next", "worker_restarted"].sum()) for b in batches)
    if kind == "multisync":  # every batch holds both workers' first 20 steps: the mark is in one
        assert delivered == 1
    else:  # the marked batch may be one that total_frames left undelivered
        assert delivered <= 1


# --------------------------------------------------------------------------- chaos
#: Kills of the chaos test, one every 2 s: with random.Random(0), 15 hit every slot at least
#: twice, one slot twice in a row.
CHAOS_KILLS = 15


def test_chaos_sigkill_every_two_seconds_under_a_collector(tmp_path: Path) -> None:
    """4 workers, each with a DataLoader(num_workers=2) and a simulator; a random worker is
    SIGKILLed every 2 s for 30 s while a collector runs. Every frame is delivered, every kill
    is one restart, and every marked transition is a restarted slot's."""
    env = make_managed_env(
        num_workers=4,
        loader="persistent",
        subprocess_kind="plain",
        pid_dir=str(tmp_path),
        method=None,
        max_restarts=1000,
        # A kill every 2 s is a row of restarts: backoff would hold each replacement for up
        # to 10 s, while this thread kills whatever pid a slot shows (the dead one, waiting).
        restart_backoff=None,
    )
    assert env.start_method == "preloaded"
    collector = COLLECTORS["single"](env, make_policy(), frames_per_batch=64, total_frames=-1)
    stop = threading.Event()
    kills: list[tuple[int, int]] = []
    killed_trees: list[int] = []
    rng = random.Random(0)

    def chaos() -> None:
        while not stop.wait(2.0):  # the chaos cadence, not a synchronisation
            if len(kills) >= CHAOS_KILLS:
                return
            slot = rng.randrange(4)
            pid = env.worker_pids[slot]
            try:
                proc = psutil.Process(pid)
                killed_trees.extend([pid, *_children_of(tmp_path, pid)])
                proc.kill()
            except psutil.Error:
                continue
            kills.append((slot, pid))

    monkey = threading.Thread(target=chaos, daemon=True)
    batches = []
    try:
        monkey.start()
        # Restarts happen in this thread, inside the collector's steps: once every kill has
        # its restart, every marked step is in a batch already yielded.
        for batch in collector:
            batches.append(batch)
            if not monkey.is_alive() and len(env.restarts) >= len(kills):
                break
    finally:
        stop.set()
        monkey.join()
        collector.shutdown()
    assert len(kills) == CHAOS_KILLS
    assert all(b.shape == batches[0].shape and b.numel() == 64 for b in batches)
    assert len(env.restarts) == len(kills)
    assert [(r.slot, r.old_pid) for r in env.restarts] == kills
    data = torch.cat(batches, dim=-1)
    marked = data["next", "worker_restarted"].squeeze(-1)
    # One mark per kill, in the killed slot (a kill that lands while the slot's replacement is
    # still starting adds a restart but no second mark).
    per_slot = marked.sum(-1).tolist()
    for slot in range(4):
        assert 1 <= per_slot[slot] <= sum(1 for s, _ in kills if s == slot) or not any(
            s == slot for s, _ in kills
        )
    assert int(marked.sum()) >= len(kills) - 2
    assert data["next", "done"].squeeze(-1)[marked].all()
    assert not data["next", "terminated"].squeeze(-1)[marked].any()
    assert not [pid for pid in killed_trees if pid_alive(pid)]


# --------------------------------------------------------------------------- the main process dies
@pytest.mark.compat
@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_sigkill_of_main_after_a_restart_leaves_nothing(
    scenario: Scenario, tmp_path: Path, method: str
) -> None:
    """The replacement (and its DataLoader workers and simulator) is known to the reaper: a
    SIGKILLed main process leaves nothing of it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    scenario.start(
        "restart_then_rollout_forever",
        "--method",
        method,
        "--subprocess",
        "setsid",
        "--pid-dir",
        str(pid_dir),
        "--max-restarts",
        "2",
    )
    ready = scenario.wait_ready(timeout=240)
    assert ready["restarts"] == 1 and ready["lost"] not in ready["workers"]
    replacement = ready["workers"][1]
    assert len(_children_of(pid_dir, replacement)) == 3
    scenario.wait_seen(ready["workers"])
    os.kill(ready["pid"], signal.SIGKILL)
    result = scenario.finish(timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert not result.leaked, f"processes outlived the main process: {result.leaked}"
    assert set(ready["workers"]) <= {s["pid"] for s in result.seen_before_death}
    everything = [int(p.read_text()) for p in pid_dir.iterdir() if p.name.split("-")[0] in ("dl", "sim")]
    assert len(everything) == 3 * 3  # 2 first workers and 1 replacement, 3 children each
    assert not [pid for pid in everything if pid_alive(pid)]


def test_loss_seen_through_an_indexed_view_marks_once() -> None:
    """TorchRL >= 0.14 views share their owner's workers: a loss handled by a view's call is
    marked in that call only, and the owner's next step is unmarked."""
    env = ManagedParallelEnv(3, make_env, daemon_workers=False, max_restarts=1, mp_start_method="fork")
    try:
        td = env.reset()
        view = env[1:3]
        assert view.done_keys == env.done_keys
        vtd = view.reset()
        os.kill(env.worker_pids[2], signal.SIGKILL)
        out, vtd = view.step_and_maybe_reset(view.rand_action(vtd))
        assert out["next", "worker_restarted"].squeeze(-1).tolist() == [False, True]
        assert torch.equal(out["next", "observation"][1], FIRST_OBS)
        # The view talks to the replacement too (it has lists of its own).
        out, vtd = view.step_and_maybe_reset(view.rand_action(vtd))
        assert not out["next", "worker_restarted"].any()
        assert torch.equal(out["next", "observation"][1], FIRST_OBS + 1)
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert not out["next", "worker_restarted"].any()
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 2)
        assert [r.slot for r in env.restarts] == [2]
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_worker_that_answered_then_died_is_marked_and_later_steps_are_in_step(
    method: str, tmp_path: Path
) -> None:
    """Worker 0 answers its step and is killed while worker 1 is still stepping: its done flag
    was set by the dead worker, and must not make the next waits return early."""
    gate = tmp_path / "gate"
    kwargs = [{}, {"step_gate": str(gate), "pid_dir": str(tmp_path)}]
    env = ManagedParallelEnv(
        2, make_env, create_env_kwargs=kwargs, daemon_workers=False, max_restarts=1, **start_kwargs(method)
    )
    try:
        td = env.reset()
        first, second = env.worker_pids

        def answered(slot: int) -> bool:
            flags = env.__dict__.get("_shm_done_flags")  # TorchRL >= 0.11; events before
            return bool(flags[slot]) if flags is not None else env._events[slot].is_set()

        def kill_first_while_second_steps() -> None:
            wait_until(lambda: any(tmp_path.glob(f"stepping-{second}-*")), "worker 1 is stepping")
            wait_until(lambda: answered(0), "worker 0 answered its step")
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: not pid_alive(first), "worker 0 is dead")
            gate.touch()  # only now may worker 1 answer

        killer = threading.Thread(target=kill_first_while_second_steps, daemon=True)
        killer.start()
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        killer.join()
        _assert_marked(out["next"], 0)
        assert torch.equal(td["observation"][0], FIRST_OBS)
        for t in range(1, 4):
            out, td = env.step_and_maybe_reset(env.rand_action(td))
            assert not out["next", "worker_restarted"].any()
            assert torch.equal(out["next", "observation"][0], FIRST_OBS + t)
            assert torch.equal(out["next", "observation"][1], FIRST_OBS + t + 1)
            assert out["next", "reward"][0].item() == 1.0
    finally:
        env.close(raise_if_closed=False)


class _BlockingEnv(ToyEnv):
    """A ToyEnv whose ``block_in`` method (``"state_dict"`` or ``"load_state_dict"``), the first
    time a worker built with it calls it (once per ``gate`` file), records that the call arrived
    (``in_<method>-<pid>-<pid>`` in ``pid_dir``) and then blocks until the worker is killed: a
    loss that lands, deterministically, while the call is in flight."""

    def __init__(self, block_in: str | None = None, gate: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block_in = block_in
        self.gate = gate

    def _block_in(self, method: str) -> None:
        if method == self.block_in and self._in_worker() and self.gate and _claim(self.gate):
            assert self.pid_dir, "the blocking call records its arrival in pid_dir"
            self._record(f"in_{method}", os.getpid())
            threading.Event().wait()  # until SIGKILL

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._block_in("state_dict")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._block_in("load_state_dict")
        return super().load_state_dict(*args, **kwargs)


def _make_blocking_env(**kwargs: Any) -> _BlockingEnv:
    return _BlockingEnv(**kwargs)


def _lost_slots(env: ManagedParallelEnv) -> list[int]:
    """The slots whose loss the supervisor has recorded and no call has handled yet."""
    supervisor = env._state.supervisor
    return [] if supervisor is None else [loss.index for loss in supervisor.losses()]


def _lose_before_the_call(env: ManagedParallelEnv, slot: int) -> int:
    """SIGKILL worker ``slot`` and wait until the supervisor has recorded its loss (no call
    in flight): the next call starts with a loss to handle. Returns the victim's pid."""
    victim = env.worker_pids[slot]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: _lost_slots(env) == [slot], f"the supervisor recorded the loss of worker {slot}")
    assert env.restarts == []
    return victim


def _what_was_lost(err: WorkerDiedError) -> tuple[Any, ...]:
    return (err.worker_index, err.pid, err.exitcode, err.last_command)


#: Where the loss lands: "before" the call (recorded by the supervisor when the call starts:
#: the slot is replaced first and the call returns normally), or "during" it (the worker is
#: killed inside the env method the call runs: the call raises the loss, and the next call
#: replaces the slot).
LOSS_TIMES = ["before", "during"]


@pytest.mark.compat
@pytest.mark.parametrize("when", LOSS_TIMES)
def test_calls_answered_on_the_pipes_stay_in_step_after_a_loss(when: str, tmp_path: Path) -> None:
    """A loss before or during ``state_dict()`` (answers come back on the pipes) leaves no
    answer of it for a later call to read: ``set_seed`` and forwarded attributes get their own
    answers. During: worker 0 is killed inside its env's ``state_dict()``; worker 1 has been
    asked too, and the answer it owes on its pipe must be dropped, not read by a later call."""
    blocks = {"block_in": "state_dict" if when == "during" else None}
    env = ManagedParallelEnv(
        2,
        functools.partial(_make_blocking_env, gate=str(tmp_path / "gate"), pid_dir=str(tmp_path)),
        create_env_kwargs=[blocks, {}],  # worker 0 (and its replacement, once) blocks
        daemon_workers=False,
        max_restarts=2,
        shutdown_timeout=2.0,
        mp_start_method="fork",
    )
    try:
        env.reset()
        if when == "before":
            victim = _lose_before_the_call(env, 0)
            state = env.state_dict()  # returns normally: the slot was replaced first
            assert sorted(state) == ["worker0", "worker1"]
            assert [(r.slot, r.old_pid, r.command) for r in env.restarts] == [(0, victim, "reset")]
        else:
            victim = env.worker_pids[0]
            _kill_when(tmp_path, "in_state_dict", victim)
            with pytest.raises(WorkerDiedError) as info:
                env.state_dict()
            assert _what_was_lost(info.value) == (0, victim, -9, "state_dict")
            assert env.restarts == [] and _lost_slots(env) == [0]  # raised, not replaced yet
        env.rollout(3)
        assert [(r.slot, r.old_pid) for r in env.restarts] == [(0, victim)]
        assert env.restarts[0].command == ("reset" if when == "before" else "state_dict")
        assert env.set_seed(1) == env.set_seed(1)
        assert list(env.step_sleep) == [0.0, 0.0]  # forwarded to the workers
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.parametrize("when", LOSS_TIMES)
def test_load_state_dict_never_returns_normally_without_reaching_every_worker(
    when: str, tmp_path: Path
) -> None:
    """Before: ``load_state_dict`` replaces the lost slot first and loads the state everywhere.
    During: worker 1 is killed inside its env's ``load_state_dict`` (TorchRL waits out its
    answer, ``shutdown_timeout``, and would return): the call raises the loss; the next one
    replaces the slot first."""
    blocks = {"block_in": "load_state_dict" if when == "during" else None}
    env = ManagedParallelEnv(
        2,
        functools.partial(
            _make_blocking_env, offset=True, gate=str(tmp_path / "gate"), pid_dir=str(tmp_path)
        ),
        create_env_kwargs=[{}, blocks],  # worker 1 (and its replacement, once) blocks
        daemon_workers=False,
        max_restarts=2,
        shutdown_timeout=2.0,  # TorchRL >= 0.13 waits this long for a lost worker's answer
        mp_start_method="fork",
    )
    try:
        env.reset()
        state = env.state_dict()
        for worker in state.values():
            worker["offset"] = torch.full((OBS,), 7.0)
        if when == "before":
            victim = _lose_before_the_call(env, 1)
            env.load_state_dict(state)  # returns normally: the slot was replaced first
            # What the victim was last asked: the state_dict() above.
            assert [(r.slot, r.old_pid, r.command) for r in env.restarts] == [(1, victim, "state_dict")]
        else:
            victim = env.worker_pids[1]
            _kill_when(tmp_path, "in_load_state_dict", victim)
            with pytest.raises(WorkerDiedError) as info:
                env.load_state_dict(state)
            assert _what_was_lost(info.value) == (1, victim, -9, "load_state_dict")
            assert env.restarts == [] and _lost_slots(env) == [1]  # raised, not replaced yet
            env.load_state_dict(state)  # the slot is replaced first
            assert [(r.slot, r.old_pid, r.command) for r in env.restarts] == [(1, victim, "load_state_dict")]
        assert all(torch.equal(w["offset"], torch.full((OBS,), 7.0)) for w in env.state_dict().values())
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.parametrize("persistent", [False, True])
def test_replacement_dying_while_it_builds_its_env(persistent: bool, tmp_path: Path) -> None:
    """A replacement that dies before TorchRL's handshake is a loss like any other: replaced
    again (within the budget), and never an endless loop, however short the window."""
    armed = tmp_path / "armed"
    die = {"die_in_init_if": str(armed), "die_flag": None if persistent else str(tmp_path / "died")}
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, **die),
        daemon_workers=False,
        max_restarts=2,
        restart_window=1e-6,
        mp_start_method="fork",
    )
    try:
        td = env.reset()
        armed.touch()
        victim = env.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        if persistent:
            with pytest.raises(WorkerDiedError, match="2 replacement\\(s\\) in a row were lost"):
                env.step(env.rand_action(td))
            return
        out = env.step(env.rand_action(td))
        _assert_marked(out["next"], 1)
        (record,) = env.restarts  # the replacement that died while building has no record
        assert record.old_pid != victim and record.old_pid == int((tmp_path / "died").read_text())
    finally:
        env.close(raise_if_closed=False)
