"""``python -m torchrl_ext sweep``: orphans of a dead owner are listed and ended, others are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from torchrl_ext._sweep import find_orphans, leftover_processes

ROOT = Path(__file__).resolve().parent.parent
SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


def _spawn_tagged(owner_pid: int, owner_ctime: float) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TORCHRL_EXT_OWNER=f"{owner_pid}:{owner_ctime:.6f}:test.1", TORCHRL_EXT_WORKER="0")
    return subprocess.Popen(SLEEPER, env=env)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "torchrl_ext", "sweep", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.compat
def test_sweep_lists_then_kills_orphans_of_a_dead_owner() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_ctime = psutil.Process(dead.pid).create_time()
    dead.wait()
    me = psutil.Process()
    orphan = _spawn_tagged(dead.pid, dead_ctime)  # owner gone
    reused = _spawn_tagged(me.pid, me.create_time() - 100.0)  # our pid, another create time
    mine = _spawn_tagged(me.pid, me.create_time())  # owner alive: not an orphan
    try:
        deadline = time.monotonic() + 30
        while {orphan.pid, reused.pid} - {t.process.pid for t in find_orphans()}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        listed = _run_cli()
        assert listed.returncode == 1
        assert str(orphan.pid) in listed.stdout and str(reused.pid) in listed.stdout
        assert f"pid {mine.pid} " not in listed.stdout
        killed = _run_cli("--kill", "--grace", "1")
        assert killed.returncode == 0, killed.stdout + killed.stderr
        assert orphan.wait(timeout=30) is not None and reused.wait(timeout=30) is not None
        assert mine.poll() is None
        assert mine.pid in {p.pid for p in leftover_processes()}
        again = _run_cli()
        assert again.returncode == 0 and "no orphaned" in again.stdout
    finally:
        for proc in (orphan, reused, mine):
            proc.kill()
            proc.wait()
