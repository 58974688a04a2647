"""The blocking wait that replaces TorchRL's spinning one (``torchrl_ext/_done_signal.py``)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv, WorkerDiedError
from torchrl_ext._compat import HAS_DAEMON_KWARG
from torchrl_ext._done_signal import DoneSignal, NotifyingFlags

# TorchRL 0.10 has no shared done flags: its own event-based wait is kept there.
needs_shared_flags = pytest.mark.skipif(not HAS_DAEMON_KWARG, reason="TorchRL < 0.11 has no shared flags")


@pytest.fixture
def signal_(tmp_path: Path) -> Iterator[DoneSignal]:
    done = DoneSignal(str(tmp_path / "done.fifo"))
    yield done
    done.close()


def _set_later(flags: NotifyingFlags, indices: list[int], started: threading.Event) -> None:
    started.wait()
    for i in indices:
        flags[i] = 1


@pytest.mark.parametrize("spin", [0.0, 2.5e-4])
def test_wait_returns_once_every_flag_is_set_and_clears_them(signal_: DoneSignal, spin: float) -> None:
    raw = multiprocessing.RawArray("b", 3)
    flags = NotifyingFlags(raw, signal_.path)
    checks = threading.Event()

    def check() -> None:
        checks.set()  # the waiter is about to sleep: now let the "workers" answer

    setter = threading.Thread(target=_set_later, args=(flags, [0, 2], checks))
    setter.start()
    signal_.wait_for(raw, [0, 2], timeout=60.0, spin=spin, check=check)
    setter.join()
    assert list(raw) == [0, 0, 0]


def test_waiting_process_wakes_for_a_flag_set_in_another_process(signal_: DoneSignal) -> None:
    raw = multiprocessing.get_context("fork").RawArray("b", 2)
    ctx = multiprocessing.get_context("fork")

    def worker() -> None:
        flags = NotifyingFlags(raw, signal_.path)
        flags[1] = 1
        os._exit(0)

    proc = ctx.Process(target=worker)
    proc.start()
    try:
        signal_.wait_for(raw, [1], timeout=60.0, spin=0.0, check=lambda: None)
        assert raw[1] == 0
    finally:
        proc.join(30)


def test_check_runs_before_sleeping_and_its_error_propagates(signal_: DoneSignal) -> None:
    raw = multiprocessing.RawArray("b", 1)

    def check() -> None:
        raise WorkerDiedError(0, 1234, -9, "step")

    with pytest.raises(WorkerDiedError):
        signal_.wait_for(raw, [0], timeout=60.0, spin=0.0, check=check)


def test_timeout_raises_like_torchrl(signal_: DoneSignal) -> None:
    raw = multiprocessing.RawArray("b", 1)
    with pytest.raises(RuntimeError, match="BATCHED_PIPE_TIMEOUT"):
        signal_.wait_for(raw, [0], timeout=0.01, spin=0.0, check=lambda: None)


def test_notify_wakes_a_sleeper_that_then_rechecks(signal_: DoneSignal) -> None:
    raw = multiprocessing.RawArray("b", 1)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 1:
            raw[0] = 1  # set without a wake-up byte: only notify() can end the sleep
            signal_.notify()

    signal_.wait_for(raw, [0], timeout=60.0, spin=0.0, check=check)
    assert raw[0] == 0


def test_notifying_flags_survive_a_missing_reader(tmp_path: Path) -> None:
    raw = multiprocessing.RawArray("b", 1)
    flags = NotifyingFlags(raw, str(tmp_path / "nobody.fifo"))
    flags[0] = 1
    assert flags[0] == 1 and len(flags) == 1


@pytest.mark.compat
@pytest.mark.parametrize("spin_wait", [0.0, None, float("inf")])
def test_rollouts_are_correct_with_every_wait(spin_wait: float | None) -> None:
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, mp_start_method="fork", spin_wait=spin_wait)
    try:
        env.set_seed(0)
        td = env.rollout(12, break_when_any_done=False)
        assert td.shape == (2, 12)
        # ToyEnv: observation = episode tensor + steps taken, done every 5 steps.
        assert td["next", "reward"].sum().item() == 24
        assert torch.equal(td["next", "done"][:, 4].flatten(), torch.tensor([True, True]))
    finally:
        env.close()


def test_spin_wait_is_validated() -> None:
    with pytest.raises(ValueError, match="spin_wait"):
        ManagedParallelEnv(1, make_env, spin_wait=-1.0)


@needs_shared_flags
def test_worker_death_wakes_a_main_process_asleep_in_a_long_step(tmp_path: Path) -> None:
    """The main thread sleeps (no spinning) through a step that never ends; the death still
    becomes WorkerDiedError (the supervisor wakes the sleeper), not TorchRL's 10000 s timeout."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path), step_sleep=3600.0),
        daemon_workers=False,
        mp_start_method="fork",
        spin_wait=0.0,
    )
    env.reset()
    victim = env.worker_pids[0]

    def kill_when_stepping() -> None:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(f"stepping-{victim}-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_stepping)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError) as info:
            env.rand_step()
        assert info.value.pid == victim
    finally:
        killer.join()
        env.close()
