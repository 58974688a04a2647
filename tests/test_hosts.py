"""Several envs per worker process (``envs_per_worker``, ``_hosts``).

A host's slots share one process (one pid), step on one message, and are lost together: each
is replaced by a process of its own (restarts), its transition marked, the others' data what
they computed. The ToyEnv (``tests/envs.py``) makes values checkable: episode ``e`` observes
``arange(4) + 100 * e + t`` at step ``t``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.conftest import pid_alive, start_kwargs
from tests.envs import OBS, make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError
from torchrl_ext._compat import torchrl_release
from torchrl_ext._hosts import Hosts

FIRST_OBS = torch.arange(OBS, dtype=torch.float32)
ALL_STARTS = ["fork", "forkserver", "spawn", "preloaded"]


def test_hosts_group_slots_and_break_up_once() -> None:
    hosts = Hosts(5, 2)
    assert hosts.groups == [(0, 1), (2, 3), (4,)]
    assert [hosts.role(s) for s in range(5)] == [None] * 5  # nothing stepped as one yet
    hosts.stepped_as_one = [True, False, True]
    assert [hosts.role(s) for s in range(5)] == ["host", "carried", None, None, None]
    assert hosts.hosted(1) == (0, 1) and hosts.hosted(4) == (4,)
    assert hosts.break_group(1) == [0, 1]
    assert hosts.break_group(0) == []  # already broken
    assert [hosts.role(s) for s in range(2)] == [None, None] and hosts.hosted(0) == (0,)


@pytest.mark.parametrize("method", ALL_STARTS)
def test_hosted_slots_share_a_process_and_step_as_upstream(method: str) -> None:
    env = ManagedParallelEnv(3, make_env, envs_per_worker=2, daemon_workers=False, **start_kwargs(method))
    try:
        td = env.reset()
        pids = env.worker_pids
        assert pids[0] == pids[1] != pids[2]
        for t in range(1, 4):
            out, td = env.step_and_maybe_reset(env.rand_action(td))
            for slot in range(3):
                assert torch.equal(out["next", "observation"][slot], FIRST_OBS + t)
        assert env.step_path[0] == "managed"
        out = env.step(env.rand_action(td))  # TorchRL's own step: every slot told itself
        assert torch.equal(out["next", "observation"], (FIRST_OBS + 4).expand(3, OBS))
    finally:
        env.close()
    assert not pid_alive(pids[0]) and not pid_alive(pids[2])


@pytest.mark.parametrize("method", ALL_STARTS)
def test_a_lost_host_loses_all_its_slots_each_replaced_alone(method: str) -> None:
    env = ManagedParallelEnv(
        3, make_env, envs_per_worker=2, daemon_workers=False, max_restarts=2, **start_kwargs(method)
    )
    try:
        td = env.reset()
        _out, td = env.step_and_maybe_reset(env.rand_action(td))
        host = env.worker_pids[0]
        os.kill(host, signal.SIGKILL)
        wait_until(lambda: not pid_alive(host), "the host is dead")
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        for slot in (0, 1):
            assert out["next", "worker_restarted"][slot].item() is True
            assert torch.equal(td["observation"][slot], FIRST_OBS)
        assert out["next", "worker_restarted"][2].item() is False
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 2)
        assert sorted((r.slot, r.old_pid) for r in env.restarts) == [(0, host), (1, host)]
        pids = env.worker_pids
        assert len(set(pids)) == 3 and host not in pids
        # Each slot is told its own steps now.
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert not out["next", "worker_restarted"].any()
        assert torch.equal(out["next", "observation"][0], FIRST_OBS + 1)
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 3)
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None and report.restarts == 2 and report.clean, str(report)


@pytest.mark.parametrize("method", ["fork", "forkserver", "preloaded"])  # not spawn: conftest.NOT_SPAWNED
def test_a_hung_hosted_slot_is_killed_with_its_host_and_both_restarted(method: str) -> None:
    env = ManagedParallelEnv(
        3,
        make_env,
        create_env_kwargs=[{}, {"step_sleep": 3600.0}, {}],
        envs_per_worker=2,
        daemon_workers=False,
        max_restarts=2,
        step_timeout=2.0,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        host = env.worker_pids[0]
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert out["next", "worker_restarted"].tolist() == [[True], [True], [False]]
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 1)
        records = sorted((r.slot, r.old_pid, r.cause) for r in env.restarts)
        assert records == [(0, host, "hung"), (1, host, "hung")]
        assert not pid_alive(host)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_without_restarts_a_lost_host_raises(method: str) -> None:
    env = ManagedParallelEnv(2, make_env, envs_per_worker=2, daemon_workers=False, **start_kwargs(method))
    try:
        td = env.reset()
        host = env.worker_pids[1]
        os.kill(host, signal.SIGKILL)
        wait_until(lambda: not pid_alive(host), "the host is dead")
        with pytest.raises(WorkerDiedError, match="SIGKILL") as info:
            env.step_and_maybe_reset(env.rand_action(td))
        assert "its process hosted slots 0, 1 (envs_per_worker), all lost with it" in str(info.value)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_an_env_error_in_a_hosted_slot_is_raised_as_the_env_raised_it(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}],
        envs_per_worker=2,
        daemon_workers=False,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        with pytest.raises(ZeroDivisionError, match="boom in step") as info:
            env.step_and_maybe_reset(env.rand_action(td))
        assert any("worker 1 " in note for note in info.value.__notes__)  # its own slot, not the host's first
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_envs_per_worker_needs_torchrl_0_11() -> None:
    if torchrl_release() >= (0, 11):
        ManagedParallelEnv(2, make_env, envs_per_worker=2).close(raise_if_closed=False)
        return
    with pytest.raises(ValueError, match=r"envs_per_worker=2 needs TorchRL >= 0\.11"):
        ManagedParallelEnv(2, make_env, envs_per_worker=2)


@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_restart_on_error_restarts_every_slot_of_the_host_with_the_envs_error(method: str) -> None:
    env = ManagedParallelEnv(
        3,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}, {}],
        envs_per_worker=2,
        daemon_workers=False,
        max_restarts=2,
        restart_on_error=True,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        host = env.worker_pids[0]
        out, td = env.step_and_maybe_reset(env.rand_action(td))
        assert out["next", "worker_restarted"].tolist() == [[True], [True], [False]]
        records = sorted((r.slot, r.old_pid, r.cause) for r in env.restarts)
        assert records == [(0, host, "ZeroDivisionError"), (1, host, "ZeroDivisionError")]
        stats = env.stats()
        assert stats["restarts_error"] == 2 and stats["env_errors"] == 2
        # Slot 1's replacement raises again, alone now, and the budget is spent: the env's error.
        with pytest.raises(ZeroDivisionError, match="boom in step"):
            env.step_and_maybe_reset(env.rand_action(td))
    finally:
        env.close(raise_if_closed=False)


def test_envs_per_worker_is_checked() -> None:
    with pytest.raises(ValueError, match="envs_per_worker must be an int >= 1"):
        ManagedParallelEnv(2, make_env, envs_per_worker=0)
    with pytest.raises(ValueError, match="cannot be combined with recycle_memory/recycle_every"):
        ManagedParallelEnv(2, make_env, envs_per_worker=2, recycle_every=3)


def test_stats_count_a_hosts_tree_once() -> None:
    env = ManagedParallelEnv(3, make_env, envs_per_worker=2, daemon_workers=False, mp_start_method="fork")
    try:
        env.reset()

        def sampled() -> bool:
            stats = env.stats(workers="both")
            return all(f"worker_{i}/rss_bytes" in stats for i in range(3))

        wait_until(sampled, "every slot's tree sampled")
        stats = env.stats(workers="both")
        assert stats["worker_0/pid"] == stats["worker_1/pid"] != stats["worker_2/pid"]  # one process
        assert stats["worker_0/rss_bytes"] == stats["worker_1/rss_bytes"]
        per_process = stats["worker_0/rss_bytes"] + stats["worker_2/rss_bytes"]
        assert stats["tree_rss_bytes"] == per_process
        assert stats["workers"] == 3 and stats["workers_alive"] == 3
    finally:
        env.close()
