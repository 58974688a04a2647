"""ManagedParallelEnv as a drop-in: construction, DataLoader workers inside reset, process groups."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torchrl.envs import ParallelEnv

from tests.conftest import START_METHODS
from tests.envs import OBS, make_env
from torchrl_ext import DaemonicWorkerError, ManagedParallelEnv
from torchrl_ext._compat import HAS_DAEMON_KWARG


def _expected(episode: int, t: int = 0) -> torch.Tensor:
    return torch.arange(OBS, dtype=torch.float32) + 100.0 * episode + t


@pytest.mark.compat
def test_is_a_real_parallel_env() -> None:
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    try:
        assert isinstance(env, ParallelEnv)
        assert env.batch_size == torch.Size([2])
        assert env.daemon_workers is False
        assert "observation" in env.observation_spec
    finally:
        env.close(raise_if_closed=False)  # never started: closed already, as upstream


def test_daemon_alias_and_conflict() -> None:
    fn = functools.partial(make_env)
    with pytest.raises(ValueError, match="disagree"):
        ManagedParallelEnv(2, fn, daemon_workers=False, daemon=True)
    env = ManagedParallelEnv(2, fn, daemon=False)
    assert env.daemon_workers is False
    # Without either, the installed TorchRL's own default (daemonic on 0.10 only).
    assert ManagedParallelEnv(2, fn).daemon_workers is (not HAS_DAEMON_KWARG)
    assert ManagedParallelEnv(2, fn, daemon_workers=True).daemon_workers is True
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ManagedParallelEnv(2, fn, shutdown_timeout=0)


@pytest.mark.compat
@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_workers_inside_reset(method: str) -> None:
    """Worker 0 builds a DataLoader(num_workers=2) per reset, worker 1 keeps a persistent one."""
    fns = [functools.partial(make_env, loader="per_reset"), functools.partial(make_env, loader="persistent")]
    env = ManagedParallelEnv(2, fns, daemon_workers=False, mp_start_method=method)
    try:
        td = env.reset()
        for w in range(2):
            torch.testing.assert_close(td["observation"][w], _expected(0))
        pids = env.worker_pids
        for pid in pids:
            assert os.getpgid(pid) == pid, "each worker leads its own process group"
        if HAS_DAEMON_KWARG:
            assert all(p.daemon is False for p in env._workers)
        # 12 steps: episode 0 is 5 steps long, then auto-resets load episodes 1 and 2.
        out = env.rollout(12, break_when_any_done=False, auto_reset=False, tensordict=td)
        obs = out["next", "observation"]
        for w in range(2):
            for t in range(12):
                episode, step = divmod(t, 5)
                if step == 4:
                    continue  # the last step of an episode reports the pre-reset observation
                torch.testing.assert_close(obs[w, t], _expected(episode, step + 1))
    finally:
        env.close()
    report = env.supervision_report
    assert report is not None and report.clean, str(report)


@pytest.mark.compat
def test_daemonic_workers_get_our_error_with_the_fix() -> None:
    env = ManagedParallelEnv(
        2, functools.partial(make_env, loader="per_reset"), daemon_workers=True, mp_start_method="fork"
    )
    try:
        with pytest.raises(DaemonicWorkerError, match="daemon_workers=False") as info:
            env.reset()
        assert isinstance(info.value, AssertionError)
        assert "worker" in "".join(getattr(info.value, "__notes__", []))
    finally:
        env.close()


def test_transforms_and_seeding_still_work() -> None:
    from torchrl.envs import StepCounter, TransformedEnv

    env = TransformedEnv(
        ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method="fork"),
        StepCounter(),
    )
    try:
        env.set_seed(3)
        out = env.rollout(4)
        assert out["next", "step_count"][:, -1].tolist() == [[4], [4]]
        state = env.state_dict()
        assert isinstance(state, dict)
    finally:
        env.close()
