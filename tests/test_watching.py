"""Seeing inside a running env: ``stats()`` (TorchRL's convention, for ``LoggerMonitor``)."""

from __future__ import annotations

import functools
import math
import os
import pickle
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torchrl.envs import EnvBase, StepCounter, TransformedEnv

from tests.conftest import start_kwargs
from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError, WorkerHungError, _platform

#: The default path and fork (what the issue names); spawn and forkserver start the same code.
STARTS = ["preloaded", pytest.param("fork", marks=pytest.mark.compat)]
LATENCIES = [f"{call}_ms_{q}" for call in ("step", "boundary", "reset") for q in ("p50", "p95", "max")]


def _env(method: str, **kwargs: Any) -> ManagedParallelEnv:
    return ManagedParallelEnv(2, make_env, daemon_workers=False, **start_kwargs(method), **kwargs)


@pytest.mark.parametrize("method", STARTS)
def test_stats_count_calls_and_their_latencies(method: str) -> None:
    env = _env(method)
    try:
        before = env.stats()
        assert before["steps"] == before["resets"] == before["reset_calls"] == 0 and before["workers"] == 2
        assert all(math.isnan(before[key]) for key in LATENCIES), before
        td = env.reset()
        for _ in range(3):
            td = env.step(env.rand_action(td))["next"]
        td = env.rollout(1, auto_reset=False, tensordict=td)[..., -1]["next"]  # step_and_maybe_reset
        stats = env.stats()
        assert stats["steps"] == 4 and stats["reset_calls"] == 1
        assert stats["resets"] == 2  # each worker's reset (the episodes last 5 steps: no end yet)
        assert stats["boundary_steps"] == 0 and math.isnan(stats["boundary_ms_max"])
        assert stats["workers_alive"] == 2 and stats["restarts"] == stats["deaths"] == 0
        for call in ("step", "reset"):
            p50, p95, top = (stats[f"{call}_ms_{q}"] for q in ("p50", "p95", "max"))
            assert 0 < p50 <= p95 <= top, stats
        assert stats["wait_s"] > 0
        assert math.isnan(stats["seconds_since_restart"])
        assert all(isinstance(v, int | float) for v in stats.values())
        env.rollout(1, auto_reset=False, tensordict=td)
        assert env.stats()["steps"] == 5
        # reset=True: this snapshot as it is, then the call counters and windows start over.
        assert env.stats(reset=True)["steps"] == 5
        after = env.stats(workers="both")
        assert after["steps"] == after["resets"] == after["reset_calls"] == after["wait_s"] == 0
        assert after["worker_0/resets"] == after["worker_1/resets"] == 0
        assert all(math.isnan(after[key]) for key in LATENCIES)
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- the views
#: In every view, as in TorchRL's multi-process collectors' ``stats(workers=...)``.
ALWAYS = {"workers", "workers_alive"}
#: The env's keys: ``"aggregate"`` and ``"both"`` only.
AGGREGATE = {
    "steps", "boundary_steps", "resets", "reset_calls", "wait_s", *LATENCIES,
    "restarts", "restarts_died", "restarts_hung", "restarts_error",
    "recycles", "recycles_memory", "recycles_episodes", "deaths", "hangs", "env_errors",
    "seconds_since_restart", "tree_rss_bytes", "tree_pss_bytes", "tree_uss_bytes", "descendants", "fds",
    "managed_step_path", "managed_steps",
}  # fmt: skip
#: In every view where the workers are forks of the preloaded server: whether it is a zygote.
SERVER = {"server_zygote"}
#: Each slot's keys once its tree was sampled: ``"per_worker"`` and ``"both"`` only.
SLOT_METRICS = (
    "alive", "resets", "restarts", "recycles",
    "pid", "rss_bytes", "pss_bytes", "uss_bytes", "descendants", "fds",
)  # fmt: skip
PER_WORKER = {f"worker_{i}/{metric}" for i in range(2) for metric in SLOT_METRICS}


def _sampled(env: ManagedParallelEnv) -> dict[str, float | int]:
    """A ``"both"`` snapshot once the supervisor sampled both workers' trees (once a second)."""

    def both() -> dict[str, float | int] | None:
        stats = env.stats(workers="both")
        return stats if all(f"worker_{i}/pid" in stats for i in range(2)) else None

    return wait_until(both, "a sample of both workers' trees")


@pytest.mark.parametrize("method", STARTS)
def test_stats_views_are_torchrl_collectors_aggregate_per_worker_and_both(method: str) -> None:
    """``"aggregate"`` (the default) the env's keys, ``"per_worker"`` the slots' instead (no
    aggregate key), ``"both"`` the union; ``workers`` and ``workers_alive`` in each; no warning."""
    env = _env(method)
    try:
        env.rollout(3)
        both = _sampled(env)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a view is not the deprecated bool
            aggregate = env.stats(workers="aggregate")
            per_worker = env.stats(workers="per_worker")
            default = env.stats()
        always = ALWAYS | (SERVER if method == "preloaded" else set())
        assert set(aggregate) == set(default) == always | AGGREGATE, set(aggregate) ^ (always | AGGREGATE)
        assert set(per_worker) == always | PER_WORKER, set(per_worker) ^ (always | PER_WORKER)
        assert set(both) == always | AGGREGATE | PER_WORKER, set(both) ^ (always | AGGREGATE | PER_WORKER)
        assert per_worker["workers"] == aggregate["workers"] == 2 and per_worker["workers_alive"] == 2
        assert [per_worker[f"worker_{i}/pid"] for i in range(2)] == env.worker_pids
        assert [per_worker[f"worker_{i}/resets"] for i in range(2)] == [1, 1]
        assert aggregate["steps"] == both["steps"] == 3 and aggregate["resets"] == 2
        # reset=True clears the call counters whatever the view.
        assert env.stats(workers="per_worker", reset=True)["worker_0/resets"] == 1
        assert env.stats()["steps"] == 0
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_stats_bool_workers_is_deprecated_and_other_values_are_refused(method: str) -> None:
    """``True`` and ``False`` (the former argument) still return what they did, ``"both"`` and
    ``"aggregate"``, with a ``DeprecationWarning`` naming the replacement, pointed at the caller."""
    env = _env(method)
    try:
        env.rollout(3)
        both = set(_sampled(env))
        for value, view in ((True, "both"), (False, "aggregate")):
            with pytest.warns(DeprecationWarning, match=f"pass workers='{view}'") as caught:
                old = env.stats(workers=value)
            assert [w.filename for w in caught] == [__file__], [str(w.message) for w in caught]
            assert set(old) == set(env.stats(workers=view))
        with pytest.warns(DeprecationWarning):
            assert set(env.stats(workers=True)) == both  # as before: the env's keys and every slot's
        for bad in ("all", "per-worker", "Both", None, 1, ["both"]):
            with pytest.raises(
                ValueError, match=r"^workers must be one of 'aggregate', 'per_worker' or 'both', got "
            ):
                env.stats(workers=bad)  # type: ignore[arg-type]
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- resets, per worker
#: Episode lengths of the two workers' envs in the reset tests (different: their counts differ).
EPISODE_STEPS = (2, 3)


def make_short_episode_env(max_steps: int, **kwargs: Any) -> EnvBase:
    """The toy env, its episodes cut at ``max_steps`` steps by TorchRL's ``StepCounter``."""
    return TransformedEnv(make_env(**kwargs), StepCounter(max_steps))


def _short_episodes(method: str, **kwargs: Any) -> ManagedParallelEnv:
    return ManagedParallelEnv(
        2,
        make_short_episode_env,
        create_env_kwargs=[{"max_steps": n} for n in EPISODE_STEPS],
        daemon_workers=False,
        **start_kwargs(method),
        **kwargs,
    )


def _collect(env: Any, steps: int) -> list[Any]:
    """A collector's loop from a reset: ``steps`` calls of ``step_and_maybe_reset``."""
    td = env.reset()
    transitions = []
    for _ in range(steps):
        td.set("action", env.action_spec.rand())
        step, td = env.step_and_maybe_reset(td)
        transitions.append(step)
    return transitions


def _ends(transitions: list[Any]) -> tuple[list[int], int]:
    """Per worker, the episodes that ended in ``transitions``; and the transitions in which one did."""
    done = torch.stack([t["next", "done"].reshape(2) for t in transitions])
    return done.sum(0).tolist(), int(done.any(1).sum())


def _assert_latencies(stats: dict[str, float | int], call: str) -> None:
    p50, p95, top = (stats[f"{call}_ms_{q}"] for q in ("p50", "p95", "max"))
    assert 0 < p50 <= p95 <= top, stats


@pytest.mark.parametrize(
    ("method", "use_buffers"),
    [
        ("preloaded", True),
        pytest.param("fork", True, marks=pytest.mark.compat),
        pytest.param("fork", False, marks=pytest.mark.compat),  # TorchRL resets through _reset
    ],
)
def test_stats_count_each_workers_resets_inside_step_and_maybe_reset(method: str, use_buffers: bool) -> None:
    """A collector's loop: the workers reset their envs inside ``step_and_maybe_reset``."""
    env = _short_episodes(method, use_buffers=use_buffers)
    try:
        transitions = _collect(env, 12)
        ends, boundaries = _ends(transitions)
        assert ends == [12 // n for n in EPISODE_STEPS]  # 6 and 4: the envs' own episodes
        stats = env.stats(workers="both")
        assert stats["steps"] == 12 and stats["reset_calls"] == 1
        # Every worker's reset once: the first reset, then one per episode end.
        assert [stats[f"worker_{i}/resets"] for i in range(2)] == [1 + n for n in ends]
        assert stats["resets"] == 2 + sum(ends)
        assert stats["boundary_steps"] == boundaries == 8
        for call in ("step", "boundary", "reset"):
            _assert_latencies(stats, call)
        assert stats["boundary_ms_max"] <= stats["step_ms_max"]  # boundary steps are steps
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_a_partial_reset_counts_only_the_workers_it_resets(method: str) -> None:
    env = _env(method)
    try:
        td = env.reset()
        td = env.step(env.rand_action(td))["next"]
        td["_reset"] = torch.tensor([[True], [False]])
        env.reset(td)
        stats = env.stats(workers="both")
        assert (stats["reset_calls"], stats["resets"]) == (2, 3)
        assert (stats["worker_0/resets"], stats["worker_1/resets"]) == (2, 1)
        _assert_latencies(stats, "reset")
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_resets_a_transform_asks_for_at_episode_ends_are_counted_per_worker(method: str) -> None:
    """Around a ``TransformedEnv``, TorchRL's ``step_and_maybe_reset`` steps the env and then
    resets only the workers whose episode ended, through a partial ``reset`` call."""
    env = TransformedEnv(_short_episodes(method), StepCounter())
    try:
        transitions = _collect(env, 12)
        ends, boundaries = _ends(transitions)
        stats = env.base_env.stats(workers="both")
        assert stats["steps"] == 12 and stats["boundary_steps"] == 0
        assert stats["reset_calls"] == 1 + boundaries
        assert [stats[f"worker_{i}/resets"] for i in range(2)] == [1 + n for n in ends] == [7, 5]
        assert stats["resets"] == 12
        _assert_latencies(stats, "reset")
    finally:
        env.close(raise_if_closed=False)


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


@pytest.mark.parametrize("method", STARTS)
def test_stats_sample_each_workers_tree_dataloader_workers_included(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", dl_context="fork"),
        daemon_workers=False,
        **start_kwargs(method),
    )
    try:
        env.rollout(3)
        pids = env.worker_pids
        # Sampled by the supervisor's thread (at most once a second): poll until a sample has
        # both DataLoader workers of each worker and a PSS.
        stats = wait_until(
            lambda: (
                (s := env.stats(workers="both"))["descendants"] == 4
                and not math.isnan(s["tree_pss_bytes"])
                and s
            ),
            "a sample of both trees with their DataLoader workers",
        )
        for slot, pid in enumerate(pids):
            prefix = f"worker_{slot}/"
            assert stats[prefix + "pid"] == pid and stats[prefix + "alive"] == 1
            assert stats[prefix + "descendants"] == 2
            assert stats[prefix + "rss_bytes"] > psutil.Process(pid).memory_info().rss // 2
            assert stats[prefix + "fds"] >= len(_tree(pid))  # every process has fds open
            assert 0 < stats[prefix + "pss_bytes"] <= stats[prefix + "rss_bytes"]
        assert stats["tree_rss_bytes"] == sum(stats[f"worker_{i}/rss_bytes"] for i in range(2))
        assert stats["fds"] == sum(stats[f"worker_{i}/fds"] for i in range(2))
    finally:
        env.close(raise_if_closed=False)
    closed = env.stats(workers="both")
    assert closed["workers_alive"] == 0 and closed["tree_rss_bytes"] == 0
    assert closed["worker_0/alive"] == 0 and "worker_0/rss_bytes" not in closed


@pytest.mark.parametrize("method", STARTS)
def test_stats_count_losses_and_restarts_by_cause(method: str) -> None:
    env = _env(method, max_restarts=2)
    try:
        td = env.reset()
        victim = env.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: env.stats()["deaths"] == 1, "the death counted by the supervisor")
        step, _ = env.step_and_maybe_reset(env.rand_action(td))
        assert step["next", "worker_restarted"].reshape(2).tolist() == [False, True]  # marked
        stats = env.stats(workers="both")
        assert (stats["restarts"], stats["restarts_died"], stats["restarts_hung"]) == (1, 1, 0)
        # The mark is done, but no episode ended: the new worker's reset is the restart's.
        assert (stats["worker_0/resets"], stats["worker_1/resets"], stats["boundary_steps"]) == (1, 1, 0)
        assert stats["restarts_error"] == 0 and stats["hangs"] == stats["env_errors"] == 0
        assert stats["worker_1/restarts"] == 1 and stats["worker_0/restarts"] == 0
        assert stats["seconds_since_restart"] >= 0 and stats["workers_alive"] == 2
        assert env.restarts[0].old_pid == victim and env.worker_pids[1] != victim
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_stats_count_a_hang(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"step_sleep": 3600.0}],
        daemon_workers=False,
        max_restarts=1,
        step_timeout=2.0,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        env.step(env.rand_action(td))
        stats = env.stats()
        assert (stats["hangs"], stats["restarts_hung"], stats["deaths"]) == (1, 1, 0)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_stats_are_safe_to_read_from_another_thread_while_stepping() -> None:
    env = _env("fork")
    errors: list[BaseException] = []
    stop = threading.Event()
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                env.stats(workers="both")
                reads[0] += 1
            except BaseException as err:  # reported below
                errors.append(err)
                return

    thread = threading.Thread(target=reader)
    try:
        thread.start()
        wait_until(lambda: reads[0] > 0, "the reader's first snapshot")
        env.rollout(50, break_when_any_done=False)
        stop.set()
        thread.join()
        assert not errors and env.stats()["steps"] == 50
    finally:
        stop.set()
        thread.join()
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_collect_stats_false_measures_nothing() -> None:
    env = _env("fork", collect_stats=False)
    try:
        env.rollout(5)
        stats = env.stats()
        assert stats["steps"] == 0 and math.isnan(stats["step_ms_p50"]) and stats["tree_rss_bytes"] == 0
        assert stats["wait_s"] == 0
        assert stats["workers_alive"] == 2
    finally:
        env.close(raise_if_closed=False)


def test_logger_monitor_logs_the_env_stats(tmp_path: Path) -> None:
    monitoring = pytest.importorskip("torchrl.record.loggers.monitoring")
    from torchrl.record import CSVLogger

    env = _env("fork")
    logger = CSVLogger(exp_name="envstats", log_dir=str(tmp_path))
    monitor = monitoring.LoggerMonitor(logger, background=False)
    try:
        monitor.watch(env, name="env", step="steps")
        env.rollout(4)
        logged = monitor.step()
        assert logged["env"]["env/steps"] == 4.0 and logged["env"]["env/resets"] == 2.0
        assert "env/step_ms_p95" in logged["env"] and "env/tree_rss_bytes" in logged["env"]
        assert not any(math.isnan(v) for v in logged["env"].values())  # NaN entries are left out
        monitor.stop()
        written = {p.stem for p in tmp_path.rglob("*.csv")}
        assert {"env/steps", "env/step_ms_p50"} <= written or {"steps", "step_ms_p50"} <= written, written
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- a hang's stacks
@pytest.mark.parametrize(
    # not spawn: conftest.NOT_SPAWNED
    "method",
    [pytest.param("fork", marks=pytest.mark.compat), "forkserver", "preloaded"],
)
def test_a_hung_workers_stacks_come_with_its_record_and_its_error(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"step_sleep": 3600.0}],
        daemon_workers=False,
        max_restarts=1,
        step_timeout=2.0,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        out = env.step(env.rand_action(td))  # slot 1 hangs: its stacks, then the restart
        (record,) = env.restarts
        assert record.cause == "hung" and record.stacks is not None
        # Every thread, the hung one inside the toy env's step, in its time.sleep.
        assert "Current thread" in record.stacks or "Thread 0x" in record.stacks, record.stacks
        assert "in _step" in record.stacks and "envs.py" in record.stacks, record.stacks
        with pytest.raises(WorkerHungError) as info:  # the replacement hangs too: no budget left
            env.step(env.rand_action(out.exclude("next")))
        stacks = info.value.stacks
        assert stacks is not None and "in _step" in stacks
        assert any("hung, every thread" in note and "in _step" in note for note in info.value.__notes__)
        assert pickle.loads(pickle.dumps(info.value)).stacks == stacks
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_stacks_of_a_worker_stuck_in_a_c_call_that_holds_the_gil() -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"hold_gil": True}],
        daemon_workers=False,
        step_timeout=2.0,
        mp_start_method="fork",
    )
    try:
        td = env.reset()
        with pytest.raises(WorkerHungError) as info:
            env.step(env.rand_action(td))
        assert info.value.stacks is not None and "in _step" in info.value.stacks, info.value.stacks
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- OOM kills named
def cannot_make_memory_cgroup() -> str | None:
    """Why no memory cgroup can be made under this process's own here (``None``: one can)."""
    parent = _platform.memory_cgroup(os.getpid())
    if parent is None:
        return "no memory cgroup here (cgroup v2, or v1's memory controller) to count OOM kills in"
    probe = Path(parent) / f"torchrl-ext-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as err:
        return f"cannot create a memory cgroup under {parent} ({err.strerror}): needs root"
    try:
        if not ((probe / "memory.max").exists() or (probe / "memory.limit_in_bytes").exists()):
            return f"the memory controller is not enabled for {parent}'s children"
    finally:
        probe.rmdir()
    return None


#: Checked by tests/test_docs.py: a guarantee row may not claim what this machine skips.
MACHINE_SKIPS: dict[str, Callable[[str | None], str | None]] = {
    "test_an_oom_kill_is_named_in_the_record_and_the_error": lambda method: cannot_make_memory_cgroup(),
    "test_an_oom_kill_without_restarts_says_so_and_a_kill_by_hand_does_not": (
        lambda method: cannot_make_memory_cgroup()
    ),
}


@pytest.fixture
def memory_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A fresh memory cgroup under this process's own (skipped where none can be made)."""
    reason = cannot_make_memory_cgroup()
    if reason is not None:
        pytest.skip(reason)
    path = Path(str(_platform.memory_cgroup(os.getpid()))) / f"torchrl-ext-test-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    try:
        yield path
    finally:
        # Its processes were OOM-killed (or move back with the test's end); then it can go.
        wait_until(lambda: not (path / "cgroup.procs").read_text().split(), f"{path} empty", timeout=30)
        path.rmdir()


def _limit_and_join(cgroup: Path, pid: int, headroom_mb: int) -> int:
    """Cap ``cgroup`` at ``pid``'s RSS plus ``headroom_mb`` MiB, then move ``pid`` into it."""
    limit = psutil.Process(pid).memory_info().rss + (headroom_mb << 20)
    name = "memory.max" if (cgroup / "memory.max").exists() else "memory.limit_in_bytes"
    (cgroup / name).write_text(str(limit))
    (cgroup / "cgroup.procs").write_text(str(pid))
    return limit


def _seen_in(env: ManagedParallelEnv, slot: int, cgroup: Path) -> None:
    """Wait until the supervisor's sampler (once a second) has read the worker's new cgroup: the
    OOM count it compares at the death is that cgroup's (v1 counts a kill in that cgroup only)."""
    supervisor = env._state.supervisor
    assert supervisor is not None
    wait_until(lambda: supervisor._worker(slot).cgroup == str(cgroup), f"worker {slot} seen in {cgroup}")


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_an_oom_kill_is_named_in_the_record_and_the_error(method: str, memory_cgroup: Path) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"grow_mb_per_step": 32}],
        daemon_workers=False,
        max_restarts=1,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        victim = env.worker_pids[1]
        limit = _limit_and_join(memory_cgroup, victim, headroom_mb=100)
        _seen_in(env, 1, memory_cgroup)
        # Slot 1 keeps 32 MiB more per step: the kernel's OOM killer ends it within a few steps.
        for _ in range(40):
            if env.restarts:
                break
            td = env.step_and_maybe_reset(env.rand_action(td))[1]
        (record,) = env.restarts
        assert record.old_pid == victim and record.cause == -signal.SIGKILL
        assert record.oom is not None and record.oom.cgroup == str(memory_cgroup)
        assert record.oom.limit is not None and abs(record.oom.limit - limit) < 1 << 20  # page-rounded
        assert env.stats()["deaths"] == 1
    finally:
        env.close(raise_if_closed=False)


def test_an_oom_kill_without_restarts_says_so_and_a_kill_by_hand_does_not(memory_cgroup: Path) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"grow_mb_per_step": 32}],
        daemon_workers=False,
        mp_start_method="fork",
    )
    try:
        td = env.reset()
        _limit_and_join(memory_cgroup, env.worker_pids[1], headroom_mb=100)
        _seen_in(env, 1, memory_cgroup)
        with pytest.raises(WorkerDiedError) as info:
            for _ in range(40):
                td = env.step_and_maybe_reset(env.rand_action(td))[1]
        err = info.value
        assert err.exitcode == -signal.SIGKILL and err.oom is not None
        assert "kernel's OOM killer" in str(err) and str(memory_cgroup) in str(err)
        assert pickle.loads(pickle.dumps(err)).oom == err.oom
    finally:
        env.close(raise_if_closed=False)
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, mp_start_method="fork")
    try:
        td = env.reset()
        os.kill(env.worker_pids[0], signal.SIGKILL)  # in the test's own cgroup: no OOM kill counted
        with pytest.raises(WorkerDiedError) as info:
            wait_until(lambda: env.stats()["deaths"] == 1, "the death noticed")
            env.step(env.rand_action(td))
        assert info.value.oom is None and "likely out of memory" in str(info.value)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_the_first_sample_of_the_trees_is_the_watchers_not_the_starts(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start records each worker's descendants itself, but leaves the trees' first sample
    for ``stats()`` (a page walk per worker) to the supervisor's thread, which takes it at once
    while the first reset runs: stats are sampled without the start waiting for them."""
    from torchrl_ext import _stats

    sampled_in: list[str] = []
    real = _stats.TreeSampler.maybe_sample

    def recording(self: Any, workers: Any) -> bool:
        sampled_in.append(threading.current_thread().name)
        return real(self, workers)

    monkeypatch.setattr(_stats.TreeSampler, "maybe_sample", recording)
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, **start_kwargs(method))
    try:
        env.reset()
        stats = wait_until(
            lambda: (s := env.stats())["tree_rss_bytes"] > 0 and s, "the first sample of the trees"
        )
        assert stats["workers_alive"] == 2
        supervisors = [name for name in sampled_in if name.startswith("torchrl_ext-supervisor")]
        assert sampled_in and supervisors == sampled_in, sampled_in
    finally:
        env.close(raise_if_closed=False)
