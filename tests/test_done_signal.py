"""The blocking wait that replaces TorchRL's spinning one (``torchrl_ext/_done_signal.py``)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import select
import signal
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError, _done_signal
from torchrl_ext._channel import ParentChannel, RestartableChannel
from torchrl_ext._compat import HAS_DAEMON_KWARG
from torchrl_ext._done_signal import DEFAULT_SPIN, Answers, DoneSignal, NotifyingFlags, SpinRate
from torchrl_ext._options import Options
from torchrl_ext._step_path import STEP_AND_MAYBE_RESET, STEP_BYTES, WorkerPlan

# TorchRL 0.10 has no shared done flags: its own event-based wait is kept there.
needs_shared_flags = pytest.mark.skipif(not HAS_DAEMON_KWARG, reason="TorchRL < 0.11 has no shared flags")


#: What the sleeper's sleeps are raised to in the wake-up tests: far above WAKE_DEADLINE, so
#: that only a wake-up byte in the FIFO can end a sleep in time, never the sleeper's own polling.
NO_POLLING = 3600.0
#: How long a wake-up test waits for the sleeper to return.
WAKE_DEADLINE = 60.0


@pytest.fixture
def signal_(tmp_path: Path) -> Iterator[DoneSignal]:
    done = DoneSignal(str(tmp_path / "done.fifo"))
    yield done
    done.close()


@pytest.fixture
def no_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sleeper's first and longest sleeps become an hour (``_FIRST_SLEEP``, ``_SLICE``)."""
    monkeypatch.setattr(_done_signal, "_FIRST_SLEEP", NO_POLLING)
    monkeypatch.setattr(_done_signal, "_SLICE", NO_POLLING)


class Sleeps:
    """Records each sleep (``select`` call) of ``_done_signal``'s waits in this process."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.fds: list[int] = []
        self._select = select.select

    def select(self, rlist: list[int], *rest: Any) -> Any:
        self.fds.append(rlist[0])
        self.entered.set()
        return self._select(rlist, *rest)

    def release(self) -> None:
        """End the newest sleep with a byte written straight into its FIFO."""
        os.write(self.fds[-1], b"x")


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Sleeps:
    recorder = Sleeps()
    monkeypatch.setattr(_done_signal, "select", recorder)
    return recorder


def _wait_in_thread(signal_: DoneSignal, flags: Any, indices: list[int], spin: float, check: Any) -> None:
    """Run ``signal_.wait_for`` in a thread and fail unless it returns within WAKE_DEADLINE.

    On failure the sleeper is released by a byte written straight into its FIFO (not through
    the code under test) and stopped by its next check, so that no thread is left behind.
    """
    errors: list[BaseException] = []
    abandoned = threading.Event()

    def guarded_check() -> None:
        if abandoned.is_set():
            raise RuntimeError("the test gave up waiting")
        check()

    def wait() -> None:
        try:
            signal_.wait_for(flags, indices, timeout=NO_POLLING, spin=spin, check=guarded_check)
        except BaseException as err:
            errors.append(err)

    waiter = threading.Thread(target=wait, name="test-sleeper")
    waiter.start()
    try:
        wait_until(lambda: not waiter.is_alive(), "the sleeper was woken", timeout=WAKE_DEADLINE)
    finally:
        if waiter.is_alive():
            abandoned.set()
            fd = os.open(signal_.path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
        waiter.join()
    if errors:
        raise errors[0]


def _set_later(flags: NotifyingFlags, indices: list[int], started: threading.Event) -> None:
    started.wait()
    for i in indices:
        flags[i] = 1


@pytest.mark.parametrize("spin", [0.0, 2.5e-4])
def test_wait_returns_once_every_flag_is_set_and_clears_them(
    signal_: DoneSignal, no_polling: None, spin: float
) -> None:
    """Flags set from another thread once the waiter is about to sleep: only the wake-up byte
    that ``NotifyingFlags`` writes can end the sleep within the deadline."""
    raw = multiprocessing.RawArray("b", 3)
    flags = NotifyingFlags(raw, signal_.path)
    checks = threading.Event()

    def check() -> None:
        checks.set()  # the waiter is about to sleep: now let the "workers" answer

    setter = threading.Thread(target=_set_later, args=(flags, [0, 2], checks))
    setter.start()
    try:
        _wait_in_thread(signal_, raw, [0, 2], spin, check)
    finally:
        checks.set()
        setter.join()
    assert checks.is_set()
    assert list(raw) == [0, 0, 0]


def test_waiting_process_wakes_for_a_flag_set_in_another_process(
    signal_: DoneSignal, no_polling: None, sleeps: Sleeps
) -> None:
    """A forked "worker" sets its flag only once the waiter sleeps: the byte it writes into
    the FIFO is what wakes the waiter."""
    ctx = multiprocessing.get_context("fork")
    raw = ctx.RawArray("b", 2)
    go = ctx.Event()

    def worker() -> None:
        flags = NotifyingFlags(raw, signal_.path)
        if go.wait(WAKE_DEADLINE):
            flags[1] = 1
        os._exit(0)

    proc = ctx.Process(target=worker)
    proc.start()  # before the waiter thread exists: fork a single-threaded process
    try:
        release = threading.Thread(target=lambda: sleeps.entered.wait(WAKE_DEADLINE) and go.set())
        release.start()
        _wait_in_thread(signal_, raw, [1], 0.0, lambda: None)
        release.join()
        assert sleeps.entered.is_set() and raw[1] == 0
    finally:
        go.set()
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


def test_the_wait_says_how_it_ended(signal_: DoneSignal) -> None:
    """Answered (the flags cleared), stopped by a true check (the flags left as they are), or
    late with late="return" (no error): a value, never an exception raised through the check."""
    raw = multiprocessing.RawArray("b", 2)
    raw[0] = raw[1] = 1
    assert signal_.wait_for(raw, [0, 1], timeout=60.0, spin=0.0, check=lambda: False) == "answered"
    assert list(raw) == [0, 0]
    raw[0] = 1
    assert signal_.wait_for(raw, [0, 1], timeout=60.0, spin=0.0, check=lambda: True) == "stopped"
    assert list(raw) == [1, 0], "a stopped wait clears no flag: the caller reads who answered"
    assert signal_.wait_for(raw, [1], timeout=0.01, spin=0.0, check=lambda: False, late="return") == "late"


def test_the_event_wait_says_how_it_ended() -> None:
    """TorchRL < 0.11's events: the same three endings as the flags' wait."""
    events = [threading.Event(), threading.Event()]
    answers = Answers(None, events)
    events[0].set()
    events[1].set()
    assert answers.wait_events([0, 1], float("inf"), 60.0, lambda: False) == "answered"
    assert not any(event.is_set() for event in events)
    events[0].set()
    assert answers.wait_events([0, 1], float("inf"), 60.0, lambda: True) == "stopped"
    assert events[0].is_set() and not events[1].is_set()
    assert answers.wait_events([1], 0.0, 0.01, lambda: False, late="return") == "late"
    with pytest.raises(RuntimeError, match="BATCHED_PIPE_TIMEOUT"):
        answers.wait_events([1], 0.0, 0.01, lambda: False)


def test_notify_wakes_a_sleeper_that_then_rechecks(signal_: DoneSignal, no_polling: None) -> None:
    raw = multiprocessing.RawArray("b", 1)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 1:
            raw[0] = 1  # set without a wake-up byte: only notify() can end the sleep
            signal_.notify()

    _wait_in_thread(signal_, raw, [0], 0.0, check)
    assert raw[0] == 0 and len(calls) == 1


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


def test_spinning_stops_once_it_stops_paying_and_a_probe_brings_it_back() -> None:
    rate = SpinRate()
    assert rate.worth_trying() and rate.steady()
    while rate.hits >= 0.5:  # misses: spinning stops paying
        rate.record(False)
    skipped = 0
    while not rate.worth_trying():
        skipped += 1
    assert skipped == _done_signal._PROBE_EVERY  # then one probe, counted like any wait
    rate.record(True)  # the probe saw its answer: spinning pays again
    assert rate.worth_trying() and not rate.steady()


class Pipe:
    """A command pipe's ``poll``: the next command arrives after ``after`` polls."""

    def __init__(self, after: int | None) -> None:
        self.after = after
        self.polls = 0

    def poll(self, timeout: float) -> bool:
        assert timeout == 0  # a spin never blocks
        self.polls += 1
        return self.after is not None and self.polls > self.after


def _plan(spin: float) -> WorkerPlan:
    return WorkerPlan(lambda: None, TensorDict(), None, [0], 0, spin)


def test_a_worker_spins_for_its_next_command_until_it_arrives() -> None:
    plan, pipe = _plan(spin=3600.0), Pipe(after=5)
    plan.await_command(pipe.poll)
    assert pipe.polls == 6


def test_a_worker_spins_no_longer_than_its_limit_then_stops_while_that_misses() -> None:
    plan, pipe = _plan(spin=1e-4), Pipe(after=None)
    misses = 0
    while True:
        before = pipe.polls
        plan.await_command(pipe.poll)  # returns: the caller then sleeps on the pipe
        if pipe.polls == before:
            break
        misses += 1
    assert misses == 7  # the hit rate fell below one half: waits sleep from now on
    for _ in range(_done_signal._PROBE_EVERY - 1):  # the wait that broke the loop was one
        plan.await_command(pipe.poll)
    assert pipe.polls == before  # until the probe
    plan.await_command(pipe.poll)
    assert pipe.polls > before


@pytest.mark.parametrize(
    ("spin_wait", "expected"), [(None, DEFAULT_SPIN), (0.0, 0.0), (1e-3, 1e-3), (float("inf"), 0.0)]
)
def test_workers_spin_for_commands_as_spin_wait_says(spin_wait: float | None, expected: float) -> None:
    assert Options.validated(spin_wait=spin_wait).command_spin == expected
    pipe = Pipe(after=None)
    _plan(spin=Options.validated(spin_wait=spin_wait).command_spin).await_command(pipe.poll)
    assert (pipe.polls > 0) == (expected > 0)


@pytest.mark.parametrize("channel_type", [ParentChannel, RestartableChannel])
def test_the_step_fan_out_writes_what_a_connection_would_with_the_same_books(channel_type: type) -> None:
    """A channel sends the step message in one write of bytes framed once (``STEP_WIRE``): the
    worker receives what ``Connection.send`` of the same message delivers, and the channel keeps
    its books: the last command, the last message and the answers owed (none: the done flag
    answers a step), the slot's hook (which sees every command). A closed connection is not
    written to (its descriptor number may be another file's by then)."""
    ours, theirs = multiprocessing.Pipe()
    with ours, theirs:
        ours.send(STEP_AND_MAYBE_RESET)
        by_connection = theirs.recv_bytes()
        channel = channel_type(ours)
        channel.send(STEP_AND_MAYBE_RESET)
        assert theirs.recv_bytes() == by_connection == STEP_BYTES
        assert ForkingPickler.loads(by_connection) == STEP_AND_MAYBE_RESET
        assert not theirs.poll()  # one message, nothing more
        assert channel.last_command == "step_and_maybe_reset"
        if channel_type is RestartableChannel:
            assert channel.owed == 0 and channel.last_message == STEP_AND_MAYBE_RESET
            seen: list[Any] = []
            channel.hook = lambda message: seen.append(message) or (None, None)  # handled: not sent
            channel.send(STEP_AND_MAYBE_RESET)
            assert seen == [STEP_AND_MAYBE_RESET] and not theirs.poll()
    closed = channel_type(ours)
    if channel_type is RestartableChannel:
        closed.send(STEP_AND_MAYBE_RESET)  # a lost worker's pipe: the loss is handled at the wait
    else:
        with pytest.raises(OSError):
            closed.send(STEP_AND_MAYBE_RESET)


def test_spin_wait_is_validated() -> None:
    with pytest.raises(ValueError, match="spin_wait"):
        ManagedParallelEnv(1, make_env, spin_wait=-1.0)


@needs_shared_flags
def test_worker_death_wakes_a_main_process_asleep_in_a_long_step(
    tmp_path: Path, no_polling: None, sleeps: Sleeps
) -> None:
    """The main thread sleeps (no spinning) through a step that never ends; the death still
    becomes WorkerDiedError (the supervisor wakes the sleeper), not TorchRL's 10000 s timeout.
    The sleeper's own polling is off: it sleeps an hour unless woken."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path), step_sleep=3600.0),
        daemon_workers=False,
        mp_start_method="fork",
        spin_wait=0.0,
        shutdown_timeout=2.0,  # the survivor never finishes its step: close() must SIGTERM it
    )
    env.reset()
    victim = env.worker_pids[0]
    failures: list[BaseException] = []
    stepped = threading.Event()

    def kill_when_asleep() -> None:
        try:
            wait_until(lambda: list(tmp_path.glob(f"stepping-{victim}-*")), "the victim is in its step")
            wait_until(sleeps.entered.is_set, "the main thread sleeps in the step")
        except BaseException as err:
            failures.append(err)
        os.kill(victim, signal.SIGKILL)  # in any case: the step must end
        try:
            wait_until(stepped.is_set, "the death woke the main thread", timeout=WAKE_DEADLINE)
        except BaseException as err:
            failures.append(err)
            sleeps.release()  # not left asleep for an hour: fail now

    sleeps.entered.clear()  # the reset may have slept already
    killer = threading.Thread(target=kill_when_asleep)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError) as info:
            try:
                env.rand_step()
            finally:
                stepped.set()
        assert info.value.pid == victim
    finally:
        killer.join()
        env.close(raise_if_closed=False)
    assert not failures, failures
