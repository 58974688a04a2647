"""close(): bounded, raises on a closed env as upstream does, works after a death, escalates on
stubborn workers."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import WORKER_STARTS, pid_alive, start_kwargs
from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError, _identity, _platform, _shutdown
from torchrl_ext._channel import ParentChannel
from torchrl_ext._compat import HAS_DAEMON_KWARG
from torchrl_ext._record import WorkerRecord
from torchrl_ext._tag import Tag

#: ``shutdown_timeout`` of tests that expect a graceful close: the close message phase (60 %)
#: then lasts long enough for a worker to close its DataLoader on a loaded machine; a close
#: that needs less returns as soon as the workers have exited. (The DataLoader workers of
#: these tests are forked, whatever the env workers' start method: spawning them costs a
#: torch import each and proves nothing more about closing.)
GRACEFUL_TIMEOUT = 60.0
#: ``shutdown_timeout`` of the escalation test, and how far past it the report may end: the
#: system calls after the last wait (no wait runs past the deadline).
SHUTDOWN_TIMEOUT = 5.0
DEADLINE_SLACK = 0.5


def _pids(pid_dir: Path, prefix: str) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob(f"{prefix}-*")]


def _our_zombie(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.ppid() == os.getpid() and proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.compat
@pytest.mark.parametrize("method", WORKER_STARTS)
def test_close_healthy_twice_reports_graceful(method: str, tmp_path: Path) -> None:
    """On the preloaded path the DataLoader gets no ``multiprocessing_context``: the workers'
    default (fork) applies, as it would for a user's DataLoader."""
    env = ManagedParallelEnv(
        2,
        functools.partial(
            make_env,
            loader="persistent",
            dl_context=None if method == "preloaded" else "fork",
            subprocess_kind="plain",
            pid_dir=str(tmp_path),
        ),
        daemon_workers=False,
        shutdown_timeout=GRACEFUL_TIMEOUT,
        **start_kwargs(method),
    )
    try:
        env.rollout(3)
        children = _pids(tmp_path, "dl") + _pids(tmp_path, "sim")
        assert len(children) == 6, "2 DataLoader workers and 1 simulator per worker"
        assert all(pid_alive(p) for p in children)
        env.close()
    finally:
        env.close(raise_if_closed=False)
    first = env.supervision_report
    with pytest.raises(RuntimeError, match="trying to close a closed environment"):
        env.close()  # as upstream: raise_if_closed defaults to True
    env.close(raise_if_closed=False)  # does nothing
    report = env.supervision_report
    assert report is first
    assert report is not None and report.clean, str(report)
    assert [w.outcome for w in report.workers] == ["graceful", "graceful"]
    assert not [p for p in children if pid_alive(p)]
    assert not [p for p in children if _our_zombie(p)], "close() leaves no defunct child to the main process"


class ForkserverExitCode255(AssertionError):
    """The one assertion the known forkserver race trips: the report's exit code is 255."""


#: Known defect (docs/guarantees.md): a forkserver child's exit status reaches its parent once,
#: through ``Popen.poll``, which is not thread-safe: when the supervisor thread and the main
#: thread (TorchRL 0.10's wait checks ``is_alive()``) poll a dying worker at the same moment,
#: one of them reads EOF and multiprocessing records exit code 255. Seen on TorchRL 0.10.1
#: under load; not strict, as it is a race. It covers only :class:`ForkserverExitCode255`,
#: which the test raises for that exit code alone, after every other check has passed: any
#: other failure of the case fails the run.
_RACY_FORKSERVER_EXITCODE = pytest.mark.xfail(
    not HAS_DAEMON_KWARG,
    strict=False,
    raises=ForkserverExitCode255,
    reason="library bug: concurrent Popen.poll() of a forkserver worker can record exit code 255",
)


@pytest.mark.compat
@pytest.mark.parametrize(
    # not spawn: conftest.NOT_SPAWNED
    "method",
    ["fork", pytest.param("forkserver", marks=_RACY_FORKSERVER_EXITCODE), "preloaded"],
)
def test_close_after_worker_was_sigkilled(method: str, tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", dl_context="fork", pid_dir=str(tmp_path)),
        daemon_workers=False,
        shutdown_timeout=GRACEFUL_TIMEOUT,
        **start_kwargs(method),
    )
    try:
        env.rollout(2)
        victim = env.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.rollout(2)
        env.close()  # no error although a worker died
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None
    outcomes = {w.index: w for w in report.workers}
    assert sorted(outcomes) == [0, 1], str(report)
    assert (outcomes[1].pid, outcomes[1].outcome) == (victim, "died"), str(report)
    assert outcomes[0].outcome == "graceful", str(report)
    # Last, and alone: the exit code, which the known race (above) can turn into 255.
    exitcode = outcomes[1].exitcode
    if exitcode == 255 and method == "forkserver" and not HAS_DAEMON_KWARG:
        raise ForkserverExitCode255(f"the known race: exit code 255 instead of -9\n{report}")
    assert exitcode == -signal.SIGKILL, str(report)


@pytest.mark.parametrize(
    "method",
    # On TorchRL 0.10.1 under fork only: two spawned env starts and two 5 s closes cost it 40 s.
    [pytest.param("fork", marks=pytest.mark.compat), "forkserver"],  # not spawn: conftest.NOT_SPAWNED
)
def test_close_escalates_on_blocking_close_and_ignored_sigterm(
    method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker 0's env blocks in ``close()``: SIGTERM ends it. Worker 1's also ignores SIGTERM:
    SIGKILL ends it. Each escalation is logged, naming the worker, its pid and the signal."""
    fns = [
        functools.partial(make_env, block_close=True),
        functools.partial(make_env, block_close=True, ignore_sigterm=True),
    ]
    # SIGTERM goes out at 60 % of the timeout: 1 s is left for the SIGTERMed worker to be seen
    # exiting before SIGKILL would follow at 80 %, slack for a loaded machine.
    env = ManagedParallelEnv(
        2, fns, daemon_workers=False, mp_start_method=method, shutdown_timeout=SHUTDOWN_TIMEOUT
    )
    try:
        env.rollout(2)
        pids = env.worker_pids
        with caplog.at_level("WARNING", logger="torchrl_ext"):
            env.close()
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None
    assert [w.outcome for w in report.workers] == ["terminated", "killed"], str(report)
    assert not report.clean
    # shutdown_timeout is an upper bound: no wait of the close runs past its deadline but the
    # reaping of the SIGKILLed worker, bounded by its own KILLED_REAP_WAIT (the slack is the
    # system calls after the last wait, on a loaded machine).
    assert report.duration <= SHUTDOWN_TIMEOUT + _shutdown.KILLED_REAP_WAIT + DEADLINE_SLACK, str(report)
    messages = [r.getMessage() for r in caplog.records]
    for index, sent in [(0, "sending SIGTERM"), (1, "sending SIGTERM"), (1, "sending SIGKILL")]:
        assert any(f"worker {index} (pid {pids[index]})" in m and sent in m for m in messages), messages
    assert not any(f"worker 0 (pid {pids[0]})" in m and "sending SIGKILL" in m for m in messages), messages


@pytest.mark.compat
def test_escalated_close_reaps_the_loader_workers(tmp_path: Path) -> None:
    """Both workers block in ``close()`` and need SIGTERM; their 4 DataLoader workers die with
    them (same process group). Nothing of them may be left, not even a zombie."""
    env = ManagedParallelEnv(
        2,
        functools.partial(
            make_env, loader="persistent", dl_context="fork", block_close=True, pid_dir=str(tmp_path)
        ),
        daemon_workers=False,
        mp_start_method="fork",
        shutdown_timeout=2.0,
    )
    try:
        env.rollout(2)
        loaders = _pids(tmp_path, "dl")
        assert len(loaders) == 4
        env.close()
    finally:
        env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None and [w.outcome for w in report.workers] == ["terminated", "terminated"]
    try:
        wait_until(
            lambda: not [pid for pid in loaders if _our_zombie(pid)],
            "the DataLoader workers of the SIGTERMed workers were reaped",
            timeout=30,
        )
    finally:
        for pid in loaders:  # whatever the outcome, leave no zombie to the next test
            if _our_zombie(pid):
                os.waitpid(pid, 0)


def test_context_manager_closes() -> None:
    with ManagedParallelEnv(
        1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork"
    ) as env:
        env.rollout(2)
        pid = env.worker_pids[0]
    assert env.is_closed
    report = env.supervision_report
    assert report is not None and report.clean and report.workers[0].pid == pid


# A stranger's service: it leads its own session and group and starts a helper in that group.
_STRANGER = (
    "import subprocess, sys, time\n"
    "helper = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'])\n"
    "print(helper.pid, flush=True)\n"
    "while True: time.sleep(1)\n"
)


NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def cannot_choose_next_pid() -> str | None:
    """Why this machine cannot choose the next pid (``None``: it can): writing
    ``/proc/sys/kernel/ns_last_pid`` needs root (CAP_SYS_ADMIN over the pid namespace) and a
    writable ``/proc/sys``. Tried by writing back its current value, which changes nothing
    (the kernel never hands out a pid in use). The recycled-group test skips exactly when this
    says so, and tests/test_docs.py refuses a guarantee row that claims a skipped case."""
    try:
        last = NS_LAST_PID.read_text().strip()
        with NS_LAST_PID.open("w") as fh:
            fh.write(last)
    except OSError as err:
        return f"cannot choose the next pid here ({NS_LAST_PID}: {err.strerror or err}; it needs root)"
    return None


#: Tests of this module that skip on some machines: test name -> the check that says why for a
#: start method (``None``: it runs). tests/test_docs.py calls these for the start methods each
#: guarantee row claims, so that no row claims a case this machine skips.
MACHINE_SKIPS: dict[str, Callable[[str | None], str | None]] = {
    # Under every start method alike.
    "test_close_leaves_a_stranger_in_a_recycled_process_group_alone": lambda method: cannot_choose_next_pid(),
}


def _recycle_pid(pid: int, attempts: int = 50) -> subprocess.Popen[str]:
    """Start a stranger that gets ``pid`` and leads a new session, so its process group id is
    ``pid`` (a recycled group). Only where :func:`cannot_choose_next_pid` says it can: a
    failure here fails the test (it would otherwise prove nothing, silently)."""
    for _ in range(attempts):
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(
            [sys.executable, "-c", _STRANGER], start_new_session=True, stdout=subprocess.PIPE, text=True
        )
        if proc.pid == pid:
            return proc
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    raise AssertionError(
        f"pid {pid} was not given to any of {attempts} new processes (taken again meanwhile?)"
    )


@pytest.mark.compat
@pytest.mark.parametrize("method", ["fork", "forkserver"])  # not spawn: conftest.NOT_SPAWNED
def test_close_leaves_a_stranger_in_a_recycled_process_group_alone(method: str) -> None:
    """A worker dies; its pid, which was its process group's id, is then reused by a stranger
    that leads a new group. ``close()`` must not signal that group (live-anchor rule)."""
    reason = MACHINE_SKIPS["test_close_leaves_a_stranger_in_a_recycled_process_group_alone"](method)
    if reason is not None:
        pytest.skip(reason)
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method=method)
    stranger = None
    try:
        env.rollout(2)
        victim = env.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.rollout(2)
        wait_until(lambda: not psutil.pid_exists(victim), "the dead worker is reaped")
        stranger = _recycle_pid(victim)
        assert stranger.stdout is not None
        helper = int(stranger.stdout.readline())
        assert os.getpgid(stranger.pid) == os.getpgid(helper) == victim
        env.close()
        assert stranger.poll() is None, "close() signalled a stranger in a recycled process group"
        assert pid_alive(helper), "close() signalled a stranger's child in a recycled process group"
        report = env.supervision_report
        assert report is not None and report.leftovers_killed == 0, str(report)
    finally:
        env.close(raise_if_closed=False)
        if stranger is not None:
            os.killpg(stranger.pid, signal.SIGKILL)
            stranger.wait()
            stranger.stdout.close()  # type: ignore[union-attr]


class _ScriptedWorker:
    """A worker record for ``close_workers`` alone: it is seen gone from its ``looks_alive + 1``-th
    look after the close message's phase ended (the moment a real worker can exit in: between
    two looks of the shutdown), and records the signals sent to it."""

    def __init__(self, looks_alive: int, graceful_until: float) -> None:
        self.index, self.pid, self.create_time = 0, 4_194_305, 0.0  # above Linux's largest pid: nobody's
        self.finished, self.descendants_killed, self.exitcode = False, 0, None
        self.descendants: dict[int, object] = {}
        self.signals: list[int] = []
        self._looks_alive, self._graceful_until = looks_alive, graceful_until
        self._read, self._write = os.pipe()  # a sentinel that never turns readable
        self.sentinel = self._read
        self.channel = self.process = self

    def send(self, message: object) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def exited(self) -> bool:
        return False

    def gone(self) -> bool:
        if time.monotonic() < self._graceful_until:
            return False
        self._looks_alive -= 1
        return self._looks_alive < 0

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def read_exitcode(self, wait: float = 1.0) -> int | None:
        return 0

    def close_fds(self) -> None:
        os.close(self._read)
        os.close(self._write)


@pytest.mark.parametrize("looks_alive", range(6))
def test_a_worker_exiting_between_two_looks_gets_the_outcome_of_what_was_sent(looks_alive: int) -> None:
    """However late in a phase a worker exits, its outcome says which signal it needed: none
    ("graceful"), SIGTERM ("terminated") or SIGKILL ("killed"). (Before, a worker seen alive at
    the end of the close message's phase and gone at the next look was left without an outcome
    and reported "killed" although nothing was sent: a CI flake on forkserver.)"""
    t0, timeout = time.monotonic(), 0.5
    worker = _ScriptedWorker(looks_alive, t0 + _shutdown.CLOSE_MESSAGE_SHARE * timeout)
    try:
        outcome, swept = _shutdown.close_workers(
            [worker],  # type: ignore[list-item]
            Tag(4_194_305, 0.0, "4194305.1"),  # an owner nobody is: the sweep's tag scan finds nothing
            "scripted",
            "test",
            t0,
            timeout,
        )
    finally:
        worker.close_fds()
    expected = {(): "graceful", (signal.SIGTERM,): "terminated"}
    sent = tuple(worker.signals)
    assert outcome.get(0, "killed") == expected.get(sent, "killed"), (outcome, sent)
    assert swept == 0


class _LookedTooEarly:
    """A started process whose first ``exitcode`` look is the one taken just before it exited
    (the race: its status is then seen through its pidfd, which does not collect it)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self._looks = 0

    @property
    def exitcode(self) -> int | None:
        self._looks += 1
        return None if self._looks == 1 else self._process.exitcode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._process, name)


@pytest.mark.compat
def test_an_exit_status_seen_through_the_pidfd_is_still_collected() -> None:
    """A child that exits between ``read_exitcode``'s look through multiprocessing and its look
    through the pidfd is collected all the same: left uncollected, it stayed this process's
    zombie (a retired worker after close(), seen once by the leak check under load)."""
    ctx = multiprocessing.get_context("fork")
    process = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    ours, theirs = ctx.Pipe()
    create_time = _identity.start_time(psutil.Process(process.pid))
    record = WorkerRecord(0, _LookedTooEarly(process), process.pid, create_time, ParentChannel(ours))
    try:
        if record.pidfd is None or _platform.peek_exit_status(record.pidfd) is not None:
            pytest.skip("needs pidfds and waitid(P_PIDFD)")
        pidfd = record.pidfd
        os.kill(process.pid, signal.SIGKILL)
        wait_until(lambda: _platform.peek_exit_status(pidfd) is not None, "the child's exit is visible")
        assert record.read_exitcode(wait=1.0) == -signal.SIGKILL
        with pytest.raises(ChildProcessError):  # collected: nothing left to wait for
            os.waitpid(process.pid, os.WNOHANG)
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        if record.pidfd is not None:
            os.close(record.pidfd)
        ours.close()
        theirs.close()


@pytest.mark.compat
@pytest.mark.parametrize("method", WORKER_STARTS)
def test_close_returns_once_every_worker_it_ended_is_reaped(method: str) -> None:
    """A worker that needs SIGKILL at a short ``shutdown_timeout`` is still exiting when the
    deadline comes: ``close()`` waits for its death (within ``KILLED_REAP_WAIT``), so the
    ``Process`` objects it leaves say so, as upstream's do (TorchRL's own
    ``test_metadata_from_workers_shutdown_is_bounded``). Before, the close returned while the
    SIGKILLed worker was alive (``is_alive()`` True, ``exitcode`` None)."""
    env = ManagedParallelEnv(
        2,
        # 2 GiB of touched pages: the kernel takes a while to free them once SIGKILL lands.
        functools.partial(make_env, block_close=True, ignore_sigterm=True, hold_mb=2048),
        daemon_workers=False,
        shutdown_timeout=0.1,
        **start_kwargs(method),
    )
    try:
        env.rollout(2)
        workers = list(env._workers)
        env.close()
        assert [w.is_alive() for w in workers] == [False, False]
        assert None not in [w.exitcode for w in workers]
    finally:
        env.close(raise_if_closed=False)
