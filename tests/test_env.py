"""ManagedParallelEnv as a drop-in: construction, DataLoader workers inside reset, process groups."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
import torch
from tensordict import TensorDictBase
from torchrl.envs import ParallelEnv

from tests.conftest import NOT_SPAWNED, START_METHODS, start_kwargs
from tests.envs import OBS, make_env
from torchrl_ext import DaemonicWorkerError, ManagedParallelEnv
from torchrl_ext._compat import HAS_DAEMON_KWARG, default_start_method, torchrl_release


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


@pytest.mark.compat
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
    # A long close-message phase: spawned DataLoader workers take seconds to exit when loaded.
    env = ManagedParallelEnv(2, fns, daemon_workers=False, mp_start_method=method, shutdown_timeout=60.0)
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


@pytest.mark.compat
def test_transforms_and_seeding_still_work() -> None:
    """Under ``TransformedEnv``: the same seed gives the same rollout (and reaches the workers:
    ToyEnv's seed picks its first episode), another seed another one; ``state_dict()`` /
    ``load_state_dict()`` carry values, the transforms' and each worker env's, both ways."""
    from torchrl.envs import Compose, RewardScaling, StepCounter, TransformedEnv

    env = TransformedEnv(
        ManagedParallelEnv(
            2, functools.partial(make_env, offset=True), daemon_workers=False, mp_start_method="fork"
        ),
        Compose(StepCounter(), RewardScaling(loc=0.0, scale=1.0)),
    )
    try:

        def rollout(seed: int) -> TensorDictBase:
            env.set_seed(seed)
            out = env.rollout(4)
            assert out["next", "step_count"][:, -1].tolist() == [[4], [4]]
            return out

        first = rollout(3)
        torch.testing.assert_close(first["observation"][0, 0], _expected(3))  # worker 0: episode 3
        assert not torch.equal(rollout(5)["observation"], first["observation"])
        again = rollout(3)
        # Everything but the actions (random: no policy), which ToyEnv ignores.
        assert (again.exclude("action") == first.exclude("action")).all(), "the same seed, another rollout"

        # The transforms' state: what is saved is what a load gives back.
        saved = {k: v.clone() for k, v in env.state_dict().items()}
        assert saved["transforms.1.scale"].item() == 1.0, saved
        env.load_state_dict({**saved, "transforms.1.scale": torch.tensor(2.0)})
        assert env.state_dict()["transforms.1.scale"].item() == 2.0
        env.load_state_dict(saved)
        assert all(torch.equal(v, saved[k]) for k, v in env.state_dict().items())

        # Each worker env's state, read back from the workers.
        workers = env.base_env
        assert {k: v["offset"].tolist() for k, v in workers.state_dict().items()} == {
            "worker0": [0.0] * OBS,
            "worker1": [0.0] * OBS,
        }
        loaded = {
            "worker0": {"offset": torch.full((OBS,), 1000.0)},
            "worker1": {"offset": torch.arange(OBS) + 0.5},
        }
        workers.load_state_dict(loaded)
        back = workers.state_dict()
        assert all(torch.equal(back[w]["offset"], loaded[w]["offset"]) for w in loaded), back
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.xfail(
    # The releases with the bug: shared done flags from 0.11 on; torchrl-nightly 2026.10.27 (after
    # 0.14, with upstream's rewrite #4341) no longer has it, and this test passes there.
    (0, 11) <= torchrl_release() <= (0, 14),
    # Not strict: whether a wait that returns early reads stale results depends on the machine's
    # load (it passed once under two busy suites); on the releases without the bug it must pass.
    strict=False,
    reason=(
        "TorchRL 0.11 to 0.14 (upstream ParallelEnv too): a worker answers load_state_dict by setting "
        "its shared done flag *and* its event; the main process waits on the event only, so the "
        "flag stays set and the next wait returns before the worker has answered: every result "
        "after load_state_dict is one command late"
    ),
)
def test_rollout_after_load_state_dict_uses_the_loaded_state() -> None:
    """Steps long enough (1 s) that a wait which returns early reads the previous results: with
    0.2 s steps a main process slowed down by a loaded machine read the new results anyway, and
    the strict xfail passed (seen once with two suites sharing 2 cores)."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, offset=True, step_sleep=1.0),
        daemon_workers=False,
        mp_start_method="fork",
    )
    try:
        env.set_seed(0)
        before = env.rollout(3, break_when_any_done=False)
        offsets = torch.stack([torch.full((OBS,), 1000.0), torch.full((OBS,), 2000.0)])
        env.load_state_dict({f"worker{w}": {"offset": offsets[w]} for w in range(2)})
        env.set_seed(0)
        after = env.rollout(3, break_when_any_done=False)
        for key in ["observation", ("next", "observation")]:
            torch.testing.assert_close(after[key], before[key] + offsets[:, None])
    finally:
        env.close(raise_if_closed=False)


def _chain(err: BaseException) -> str:
    """Every message of ``err`` and its causes (the worker's traceback is the cause)."""
    parts = []
    cur: BaseException | None = err
    while cur is not None:
        parts.append(str(cur))
        cur = cur.__cause__
    return "\n".join(parts)


@pytest.mark.compat
@pytest.mark.parametrize("method", NOT_SPAWNED)
def test_a_call_the_env_does_not_have_raises_attribute_error(method: str) -> None:
    """``env.no_such_method()`` is forwarded to the workers, whose loop ends on the error: the
    call itself raises the ``AttributeError`` (upstream raises a bare ``EOFError`` and then
    cannot close), and the env still closes."""
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, **start_kwargs(method))
    try:
        env.reset()
        with pytest.raises(AttributeError) as raised:
            env.no_such_method()
        assert "no_such_method" in _chain(raised.value), _chain(raised.value)
    finally:
        env.close()
    assert env.supervision_report is not None
    assert {w.outcome for w in env.supervision_report.workers} <= {"died", "graceful"}


@pytest.mark.parametrize("method", ["fork", "preloaded"])
def test_a_failed_forwarded_call_is_a_loss_with_restarts(method: str) -> None:
    """With ``max_restarts``, the forwarded call raises the env's error and the lost workers
    are replaced at the next call (without ``restart_on_error``: the error reached its caller)."""
    env = ManagedParallelEnv(
        2, functools.partial(make_env), daemon_workers=False, max_restarts=2, **start_kwargs(method)
    )
    try:
        env.reset()
        with pytest.raises(AttributeError):
            env.no_such_method()
        out = env.rollout(3, break_when_any_done=False)
        assert out.batch_size == torch.Size([2, 3])
        assert sorted(r.slot for r in env.restarts) == [0, 1]
        assert {r.cause for r in env.restarts} == {"AttributeError"}
    finally:
        env.close()


@pytest.mark.parametrize("method", NOT_SPAWNED)
def test_a_worker_lost_after_the_next_command_was_sent_is_judged_by_the_call_it_raised_in(
    method: str,
) -> None:
    """Worker 1's env raises in the forwarded call only once the next command (the rollout's
    reset) is on its pipe: its loss is seen with ``reset`` as its channel's last command. What
    decides (a forwarded call's error is a loss, ``restart_on_error`` or not) is the call the
    worker says it raised in, so both slots are replaced and the rollout runs. (Before the
    reset is sent, replacing slot 0 waits up to ``shutdown_timeout`` for worker 1's answer to
    the call, which never comes: hence the short one.)"""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env),
        daemon_workers=False,
        max_restarts=2,
        shutdown_timeout=2.0,
        **start_kwargs(method),
    )
    try:
        env.reset()
        with pytest.raises(AttributeError):
            env.raise_after_the_next_command(env.worker_pids[0])
        out = env.rollout(3, break_when_any_done=False)
        assert out.batch_size == torch.Size([2, 3])
        assert sorted(r.slot for r in env.restarts) == [0, 1]
        assert {r.cause for r in env.restarts} == {"AttributeError"}
        assert {r.command for r in env.restarts} == {"raise_after_the_next_command"}
    finally:
        env.close()


@pytest.mark.compat
def test_a_pickled_env_keeps_its_options_and_leaves_the_start_to_where_it_lands() -> None:
    """A copy (what a collector worker receives) carries the options, no records, and starts
    its workers by TorchRL's start method there, not by the sender's preloaded server."""
    env = ManagedParallelEnv(
        2, functools.partial(make_env), daemon_workers=False, max_restarts=2, shutdown_timeout=3.0
    )
    copy = pickle.loads(pickle.dumps(env))
    try:
        assert env.start_method == "preloaded"
        assert isinstance(copy, ManagedParallelEnv)
        assert (copy.shutdown_timeout, copy.restarts, copy.daemon_workers) == (3.0, [], False)
        assert copy.start_method == default_start_method(None) != "preloaded"
    finally:
        copy.close(raise_if_closed=False)
        env.close(raise_if_closed=False)
