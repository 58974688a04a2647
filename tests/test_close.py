"""close(): bounded, raises on a closed env as upstream does, works after a death, escalates on
stubborn workers."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import START_METHODS, pid_alive, wait_until
from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv, WorkerDiedError


def _pids(pid_dir: Path, prefix: str) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob(f"{prefix}-*")]


@pytest.mark.compat
def test_close_healthy_twice_reports_graceful(tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", subprocess_kind="plain", pid_dir=str(tmp_path)),
        daemon_workers=False,
        mp_start_method="fork",
    )
    env.rollout(3)
    children = _pids(tmp_path, "dl") + _pids(tmp_path, "sim")
    assert len(children) == 6, "2 DataLoader workers and 1 simulator per worker"
    env.close()
    first = env.supervision_report
    with pytest.raises(RuntimeError, match="trying to close a closed environment"):
        env.close()  # as upstream: raise_if_closed defaults to True
    env.close(raise_if_closed=False)  # does nothing
    report = env.supervision_report
    assert report is first
    assert report is not None and report.clean, str(report)
    assert [w.outcome for w in report.workers] == ["graceful", "graceful"]
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.mark.compat
def test_close_after_worker_was_sigkilled(tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", pid_dir=str(tmp_path)),
        daemon_workers=False,
        mp_start_method="fork",
    )
    env.rollout(2)
    victim = env.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        env.rollout(2)
    env.close()  # no error although a worker died
    env.close(raise_if_closed=False)
    report = env.supervision_report
    assert report is not None
    outcomes = {w.index: w for w in report.workers}
    assert outcomes[1].outcome == "died" and outcomes[1].exitcode == -signal.SIGKILL
    assert outcomes[0].outcome == "graceful"


def test_close_escalates_on_blocking_close_and_ignored_sigterm(tmp_path: Path) -> None:
    fns = [
        functools.partial(make_env, block_close=True),
        functools.partial(make_env, block_close=True, ignore_sigterm=True),
    ]
    env = ManagedParallelEnv(2, fns, daemon_workers=False, mp_start_method="fork", shutdown_timeout=2.0)
    env.rollout(2)
    env.close()
    report = env.supervision_report
    assert report is not None
    assert [w.outcome for w in report.workers] == ["terminated", "killed"]
    assert not report.clean


def test_shutdown_warns_on_escalation(caplog: pytest.LogCaptureFixture) -> None:
    env = ManagedParallelEnv(
        1,
        functools.partial(make_env, block_close=True),
        daemon_workers=False,
        mp_start_method="fork",
        shutdown_timeout=1.0,
    )
    env.rollout(1)
    pid = env.worker_pids[0]
    with caplog.at_level("WARNING", logger="torchrl_ext"):
        env.close()
    assert any(
        f"worker 0 (pid {pid})" in r.getMessage() and "SIGTERM" in r.getMessage() for r in caplog.records
    )


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


def _recycle_pid(pid: int, attempts: int = 50) -> subprocess.Popen[str] | None:
    """Start a stranger that gets ``pid`` and leads a new session, so its process group id is
    ``pid`` (a recycled group). ``None`` if the kernel does not let us choose the pid."""
    for _ in range(attempts):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(
            [sys.executable, "-c", _STRANGER], start_new_session=True, stdout=subprocess.PIPE, text=True
        )
        if proc.pid == pid:
            return proc
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return None


@pytest.mark.compat
@pytest.mark.parametrize("method", START_METHODS)
def test_close_leaves_a_stranger_in_a_recycled_process_group_alone(method: str) -> None:
    """A worker dies; its pid, which was its process group's id, is then reused by a stranger
    that leads a new group. ``close()`` must not signal that group (live-anchor rule)."""
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
        if stranger is None:
            pytest.skip("cannot choose the next pid here (/proc/sys/kernel/ns_last_pid needs root)")
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
