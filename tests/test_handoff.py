"""TorchRL >= 0.15's shared-buffer hand-off (#4341): ``metadata_from_workers=True``.

There the workers start on TorchRL's direct loop, send their specs, and only then get the
shared buffers ("buffers", answered "started"); an unset ``use_buffers`` is resolved to True
once the specs are in. Every replacement and recycling standby takes part in that hand-off as
the first workers did (``_starting.hand_off``). The scenarios of ``test_restarts`` and
``test_recycle``, on this path. Before 0.15 TorchRL refuses buffers with
``metadata_from_workers`` (the contract suite checks ours refuses alike).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import pid_alive, start_kwargs
from tests.envs import make_env
from tests.test_restarts import FIRST_OBS, STEP_TIMEOUT, _assert_marked, lose_worker_between_calls
from torchrl_ext import ManagedParallelEnv, _compat

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        _compat.torchrl_release() < (0, 15),
        reason="TorchRL < 0.15 has no shared-buffer hand-off (metadata_from_workers needs use_buffers=False)",
    ),
]

#: ``use_buffers`` as given: unset (TorchRL resolves it from the specs) or explicit.
BUFFERS = [None, True]


def _handoff_kwargs(method: str, use_buffers: bool | None) -> dict[str, Any]:
    given = {} if use_buffers is None else {"use_buffers": use_buffers}
    return {"metadata_from_workers": True, "daemon_workers": False, **given, **start_kwargs(method)}


@pytest.mark.parametrize(
    ("method", "use_buffers"),
    [
        ("preloaded", None),
        ("preloaded", True),
        ("fork", None),
        ("fork", True),
        ("forkserver", None),  # spawn: make test's 0.15 suite leaves spawn cases to the main suite
    ],
)
def test_sigkilled_worker_is_replaced_through_the_handoff(method: str, use_buffers: bool | None) -> None:
    env = ManagedParallelEnv(3, make_env, max_restarts=2, **_handoff_kwargs(method, use_buffers))
    try:
        _out, root, victim = lose_worker_between_calls(env)
        assert _compat.Upstream(env).use_buffers is True
        (record,) = env.restarts
        assert (record.slot, record.old_pid, record.cause) == (2, victim, -9)
        assert record.new_pid == env.worker_pids[2] != victim
        # Later steps run through the replacement's shared buffer: its data is its env's.
        out, root = env.step_and_maybe_reset(env.rand_action(root))
        assert not out["next", "worker_restarted"].any()
        assert torch.equal(out["next", "observation"][2], FIRST_OBS + 1)
        assert torch.equal(out["next", "observation"][0], FIRST_OBS + 3)
        rollout = env.rollout(8, break_when_any_done=False)
        assert not rollout["next", "worker_restarted"].any()
        stats = env.stats()
        assert stats["restarts"] == stats["restarts_died"] == 1 and stats["workers_alive"] == 3
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None and report.restarts == 1 and report.clean, str(report)


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_hung_step_is_restarted_through_the_handoff(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"step_sleep": 3600.0}],
        max_restarts=1,
        step_timeout=STEP_TIMEOUT,
        **_handoff_kwargs(method, None),
    )
    try:
        td = env.reset()
        hung = env.worker_pids[1]
        out = env.step(env.rand_action(td))
        _assert_marked(out["next"], 1)
        assert torch.equal(out["next", "observation"][0], FIRST_OBS + 1)
        (record,) = env.restarts
        assert (record.slot, record.old_pid, record.cause) == (1, hung, "hung")
        assert not pid_alive(hung)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_env_error_is_restarted_through_the_handoff(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}],
        max_restarts=1,
        restart_on_error=True,
        **_handoff_kwargs(method, True),
    )
    try:
        td = env.reset()
        out = env.step(env.rand_action(td))
        _assert_marked(out["next"], 1)
        (record,) = env.restarts
        assert (record.slot, record.cause, record.command) == (1, "ZeroDivisionError", "step")
        with pytest.raises(ZeroDivisionError, match="boom in step"):  # the replacement raises too
            env.step(env.rand_action(out.exclude("next")))
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_recycled_standbys_take_the_handoff(method: str, tmp_path: Path) -> None:
    """recycle_every=1: each episode runs in a standby started ahead, which got its slot's
    buffers by the hand-off and reset its env ahead (NOTE [prepared reset])."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path)),
        recycle_every=1,
        **_handoff_kwargs(method, None),
    )
    try:
        td = env.reset()
        first = env.worker_pids
        for _ in range(3):  # three episodes per slot: every one in a fresh worker
            steps = []
            for _ in range(5):
                step, td = env.step_and_maybe_reset(env.rand_action(td))
                steps.append(step.clone())
            for step in steps:
                assert torch.equal(step["next", "observation"], step["observation"] + 1)
            assert steps[-1]["next", "done"].all()
            assert torch.equal(td["observation"], FIRST_OBS.expand(2, FIRST_OBS.numel()))
        records = env.restarts
        assert len(records) == 6 and all(r.recycled and r.cause == "episodes" for r in records)
        assert set(first).isdisjoint(env.worker_pids)
    finally:
        env.close()
