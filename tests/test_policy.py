"""The restart policy: which env errors restart a slot (``restart_on_error`` types), the
``on_restart`` callback, the backoff between restarts of one slot, a bound on building the env
(``start_timeout``), seeded replacements and several losses replaced at once.

The ToyEnv (``tests/envs.py``) makes values checkable; its ``init_gate`` holds a worker inside
its factory until the test opens the gate (or forever: a hang while the env is built).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import start_kwargs
from tests.envs import OBS, make_env, make_noise_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, RestartRecord, WorkerStartTimeoutError
from torchrl_ext._policy import replacement_seed

#: The default start and fork on TorchRL 0.10.1 too; spawn where start-up is what is tested.
STARTS = [pytest.param("preloaded", marks=pytest.mark.compat), pytest.param("fork", marks=pytest.mark.compat)]


def _kill_between_calls(env: ManagedParallelEnv, slots: list[int]) -> list[int]:
    """SIGKILL the workers of ``slots`` and wait until the env has seen every death."""
    pids = [env.worker_pids[slot] for slot in slots]
    deaths = env.stats()["deaths"]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: env.stats()["deaths"] == deaths + len(slots), f"{len(slots)} death(s) seen")
    return pids


# --------------------------------------------------------------------------- restart_on_error
@pytest.mark.parametrize("method", STARTS)
def test_restart_on_error_types_restart_only_those(method: str) -> None:
    # Slot 1 raises ZeroDivisionError in every step: listed, it is restarted (the call returns).
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}],
        daemon_workers=False,
        max_restarts=1,
        restart_on_error=(KeyError, ZeroDivisionError),
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        _, td = env.step_and_maybe_reset(env.rand_action(td))
        (record,) = env.restarts
        assert record.slot == 1 and record.cause == "ZeroDivisionError"
    finally:
        env.close(raise_if_closed=False)
    # Not listed: the env's own error is raised, with its type, as without restarts.
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"raise_in": "step"}],
        daemon_workers=False,
        max_restarts=1,
        restart_on_error=KeyError,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        with pytest.raises(ZeroDivisionError, match="boom in step") as info:
            env.step_and_maybe_reset(env.rand_action(td))
        assert env.restarts == []
        assert any("restart_on_error=(<class 'KeyError'>,)" in note for note in info.value.__notes__)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("value", ["yes", (), (ValueError, "KeyError"), int, 1])
def test_restart_on_error_refuses_what_is_not_exception_types(value: Any) -> None:
    with pytest.raises(ValueError, match="restart_on_error must be True, False, an exception type"):
        ManagedParallelEnv(2, make_env, restart_on_error=value)


# --------------------------------------------------------------------------- on_restart
@pytest.mark.parametrize("method", STARTS)
def test_on_restart_gets_each_record_in_the_main_process_and_its_errors_are_logged(
    method: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[RestartRecord, int, bool]] = []

    def on_restart(record: RestartRecord) -> None:
        seen.append((record, os.getpid(), threading.current_thread() is threading.main_thread()))
        if len(seen) == 2:
            raise RuntimeError("a bug in the callback")

    env = ManagedParallelEnv(
        2, make_env, daemon_workers=False, max_restarts=3, on_restart=on_restart, **start_kwargs(method)
    )
    caplog.set_level(logging.ERROR, logger="torchrl_ext")
    try:
        td = env.reset()
        for round_ in range(2):
            _kill_between_calls(env, [round_ % 2])
            _, td = env.step_and_maybe_reset(env.rand_action(td))  # returns: the callback's error is logged
        assert [r for r, _pid, _main in seen] == env.restarts and len(seen) == 2
        assert all(pid == os.getpid() and main for _r, pid, main in seen)
        assert "on_restart raised" in caplog.text and "a bug in the callback" in caplog.text
    finally:
        env.close(raise_if_closed=False)


def test_on_restart_must_be_callable() -> None:
    with pytest.raises(ValueError, match="on_restart must be None or a callable"):
        ManagedParallelEnv(2, make_env, on_restart="print")


# --------------------------------------------------------------------------- backoff
@pytest.mark.parametrize("method", STARTS)
def test_restarts_in_a_row_of_one_slot_back_off(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        make_env,
        daemon_workers=False,
        max_restarts=5,
        restart_backoff=(0.2, 0.3),
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        for _ in range(3):
            _kill_between_calls(env, [1])
            _, td = env.step_and_maybe_reset(env.rand_action(td))
        assert [r.backoff for r in env.restarts] == [0.0, 0.2, 0.3]  # immediate, first, capped
        assert all(r.ready_after >= r.backoff for r in env.restarts)  # waited before the start
        _kill_between_calls(env, [0])  # another slot starts its own row
        env.step_and_maybe_reset(env.rand_action(td))
        assert env.restarts[-1].backoff == 0.0
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("value", [(1.0,), (2.0, 1.0), (-1.0, 1.0), "fast"])
def test_restart_backoff_refuses_what_is_not_first_and_cap(value: Any) -> None:
    with pytest.raises(ValueError, match="restart_backoff must be None or"):
        ManagedParallelEnv(2, make_env, restart_backoff=value)


# --------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("method", STARTS)
def test_a_replacement_is_seeded_from_the_env_seed_its_slot_and_incarnation(method: str) -> None:
    """Slot 1 is lost twice; each replacement's first observation is what its derived seed
    gives (the env draws it with torch), whatever the main process's RNG holds."""
    env = ManagedParallelEnv(
        2, make_noise_env, daemon_workers=False, max_restarts=3, restart_backoff=None, **start_kwargs(method)
    )
    try:
        env.set_seed(7)
        slot_seed = env._state.keeper.slots[1].seed[0]  # what set_seed sent slot 1
        td = env.reset()
        for incarnation in (1, 2):
            torch.manual_seed(1000 + incarnation)  # a forked replacement would inherit this
            _kill_between_calls(env, [1])
            root, td = env.step_and_maybe_reset(env.rand_action(td))
            record = env.restarts[-1]
            assert record.seed == replacement_seed(slot_seed, 1, incarnation)
            torch.manual_seed(record.seed)
            # The marked transition's observation is the replacement's first reset.
            assert torch.equal(root["next", "observation"][1], torch.rand(OBS))
    finally:
        env.close(raise_if_closed=False)


def test_an_unseeded_env_gives_unseeded_replacements() -> None:
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, max_restarts=1, mp_start_method="fork")
    try:
        td = env.reset()
        _kill_between_calls(env, [0])
        env.step_and_maybe_reset(env.rand_action(td))
        assert env.restarts[0].seed is None
    finally:
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- several at once
@pytest.mark.parametrize("method", [*STARTS, "forkserver"])  # not spawn: conftest.NOT_SPAWNED
def test_workers_lost_together_are_started_together(method: str, tmp_path: Path) -> None:
    """Three workers lost between calls: their replacements all reach their factory before
    any is let through (a gate the test opens only once all three wait there), so none was
    waited for before the next was started."""
    gate = str(tmp_path / "gate")
    env = ManagedParallelEnv(
        3,
        functools.partial(make_env, init_gate=gate, pid_dir=str(tmp_path)),
        daemon_workers=False,
        max_restarts=3,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        Path(gate + ".armed").touch()  # from now on a new worker waits at the gate
        old = _kill_between_calls(env, [0, 1, 2])

        def open_gate() -> None:
            wait_until(lambda: len(list(tmp_path.glob("building-*"))) == 3, "3 replacements building at once")
            Path(gate).touch()

        opener = threading.Thread(target=open_gate, daemon=True)
        opener.start()
        root, td = env.step_and_maybe_reset(env.rand_action(td))
        opener.join()
        assert sorted(r.old_pid for r in env.restarts) == sorted(old)
        assert root["next", "worker_restarted"].all()
    finally:
        Path(gate).touch()
        env.close(raise_if_closed=False)


# --------------------------------------------------------------------------- start_timeout
def _gated(gate: str, method: str, **kwargs: Any) -> ManagedParallelEnv:
    """Two workers whose factory waits at ``gate`` (``tests.envs.make_env``'s ``init_gate``),
    with ``start_timeout=1.0`` unless given."""
    kwargs.setdefault("start_timeout", 1.0)
    factory_kwargs = {"init_gate": gate, **kwargs.pop("factory_kwargs", {})}
    return ManagedParallelEnv(
        2,
        functools.partial(make_env, **factory_kwargs),
        daemon_workers=False,
        **kwargs,
        **start_kwargs(method),
    )


@pytest.mark.parametrize("method", STARTS)
def test_a_replacement_that_hangs_building_its_env_is_killed_and_started_again(
    method: str, tmp_path: Path
) -> None:
    gate = str(tmp_path / "gate")  # never opened: the first replacement hangs in its factory
    env = _gated(gate, method, max_restarts=3, factory_kwargs={"pid_dir": str(tmp_path)})
    try:
        td = env.reset()
        Path(gate + ".once").touch()  # the next worker built hangs, once
        _kill_between_calls(env, [1])
        root, td = env.step_and_maybe_reset(env.rand_action(td))
        (record,) = env.restarts  # the kill's replacement hung: the record is its replacement's
        (hung,) = [int(p.name.split("-")[1]) for p in tmp_path.glob("building-*")]
        assert record.cause == "start_timeout" and record.old_pid == hung
        assert env.stats()["restarts_hung"] == 1
        assert root["next", "worker_restarted"][1].item()
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_a_replacement_that_always_hangs_ends_in_an_error_naming_the_factory(
    method: str, tmp_path: Path
) -> None:
    gate = str(tmp_path / "gate")
    env = _gated(gate, method, max_restarts=1)
    try:
        td = env.reset()
        Path(gate + ".armed").touch()
        _kill_between_calls(env, [1])
        with pytest.raises(WorkerStartTimeoutError) as info:
            env.step_and_maybe_reset(env.rand_action(td))
        err = info.value
        assert err.worker_index == 1 and err.timeout == 1.0 and err.factory == "tests.envs.make_env"
        assert "start_timeout=1s" in str(err) and "tests.envs.make_env" in str(err)
        assert err.stacks is not None and "__init__" in err.stacks  # where it waited
        assert pickle.loads(pickle.dumps(err)).factory == err.factory
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.parametrize("method", STARTS)
def test_a_first_start_that_hangs_is_bounded_and_retried_within_max_restarts(
    method: str, tmp_path: Path
) -> None:
    gate = str(tmp_path / "gate")
    Path(gate + ".armed").touch()
    env = _gated(gate, method)
    with pytest.raises(WorkerStartTimeoutError, match="did not build its env within start_timeout=1s"):
        env.reset()
    env.close(raise_if_closed=False)
    Path(gate + ".armed").unlink()
    Path(gate + ".once").touch()  # one worker hangs, once: the whole start is tried again
    env = _gated(gate, method, max_restarts=1)
    try:
        td = env.reset()
        assert td["observation"].shape == (2, OBS)
    finally:
        env.close(raise_if_closed=False)


def test_start_timeout_leaves_a_slow_healthy_spawn_start_alone() -> None:
    """Spawned workers import torch before their env exists; a bound above that is no error."""
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, mp_start_method="spawn", start_timeout=120.0)
    try:
        assert env.reset()["observation"].shape == (2, OBS)
    finally:
        env.close()


@pytest.mark.parametrize("value", [0, -1.0, "1s"])
def test_start_timeout_refuses_what_is_not_positive_seconds(value: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        ManagedParallelEnv(2, make_env, start_timeout=value)
