"""``python -m torchrl_ext sweep``: orphans of a dead owner are listed and ended, others are not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import NOT_SPAWNED, Scenario, child_env, pid_alive, start_kwargs
from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, _platform
from torchrl_ext._identity import clock, start_time
from torchrl_ext._reaper import Reaper, Registry
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
def test_sweep_lists_then_kills_orphans_of_a_dead_owner(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_ctime = start_time(psutil.Process(dead.pid))
    dead.wait()
    me = psutil.Process()
    orphan = _spawn_tagged(dead.pid, dead_ctime)  # owner gone
    reused = _spawn_tagged(me.pid, start_time(me) - 100.0)  # our pid, another create time
    mine = _spawn_tagged(me.pid, start_time(me))  # owner alive: not an orphan
    # Only these owners (and no runtime directories of other runs on this machine).
    scope = ["--owner", str(dead.pid), "--owner", str(me.pid), "--runtime-dir", str(tmp_path)]
    try:
        wait_until(
            lambda: not {orphan.pid, reused.pid} - {t.process.pid for t in find_orphans(str(tmp_path))},
            "both tagged processes are found as orphans",
        )
        listed = _run_cli(*scope)
        assert listed.returncode == 1
        assert str(orphan.pid) in listed.stdout and str(reused.pid) in listed.stdout
        assert f"pid {mine.pid} " not in listed.stdout
        killed = _run_cli("--kill", "--grace", "1", *scope)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        assert orphan.wait(timeout=30) is not None and reused.wait(timeout=30) is not None
        assert mine.poll() is None
        assert mine.pid in {p.pid for p in leftover_processes()}
        again = _run_cli(*scope)
        assert again.returncode == 0 and "no orphaned" in again.stdout
    finally:
        for proc in (orphan, reused, mine):
            proc.kill()
            proc.wait()


@pytest.mark.compat
@pytest.mark.parametrize("method", NOT_SPAWNED)
def test_leftover_processes_is_empty_once_every_env_closed(method: str) -> None:
    """The helpers that live as long as their owner are not leftovers: our preloaded server,
    and CPython's fork server, which is tagged with its owner when a managed env starts it."""
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, **start_kwargs(method))
    try:
        env.reset()
        assert set(env.worker_pids) <= {p.pid for p in leftover_processes()}
    finally:
        env.close()
    wait_until(lambda: not leftover_processes(), "no leftover once the env is closed")


def _registry_lists(path: Path, pids: set[int]) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return pids <= {int(pid) for pid, _ctime in data["seen"]}


def test_sweep_finds_forked_escapees_through_the_registry(scenario: Scenario, tmp_path: Path) -> None:
    """Owner and reaper SIGKILLed together: a process forked (no exec) by a worker into a session
    of its own carries no visible tag and no worker's process group, yet the sweep finds it
    through the registry the reaper left, ends it and removes the runtime directory."""
    pid_dir, runtime_base = tmp_path / "pids", tmp_path / "runtime"
    pid_dir.mkdir()
    runtime_base.mkdir()
    scenario.start(
        "rollout_forever",
        "--subprocess",
        "forked_setsid",
        "--pid-dir",
        str(pid_dir),
        linger=90.0,
        env_vars={"TMPDIR": str(runtime_base)},  # its runtime directory goes there
    )
    ready = scenario.wait_ready()
    main = psutil.Process(int(ready["pid"]))
    wait_until(lambda: len(list(pid_dir.glob("sim-*"))) == 2, "both workers started their escapee")
    escapees = {int(p.read_text()) for p in pid_dir.glob("sim-*")}
    reapers = [p for p in main.children(recursive=True) if "_reaper.py" in " ".join(p.cmdline())]
    assert len(reapers) == 2, reapers  # the shim and the reaper
    fifo = next(arg for arg in reapers[0].cmdline() if arg.endswith("reaper.fifo"))
    runtime_dir = Path(fifo).parent
    assert runtime_dir.parent == runtime_base
    registry = runtime_dir / "registry.json"
    wait_until(lambda: _registry_lists(registry, escapees), "the reaper recorded the escapees")

    for proc in [*reapers, main]:  # a node-wide kill: the reaper goes with its owner
        proc.kill()
    wait_until(
        lambda: not [pid for pid in ready["workers"] if pid_alive(pid)],
        "the workers died with their owner (parent-death signal)",
    )
    assert all(psutil.pid_exists(pid) for pid in escapees), "the escapees should have outlived everything"
    assert not {o.process.pid for o in find_orphans(str(tmp_path)) if o.found_by == "tag"} & escapees

    scope = ["--owner", str(main.pid), "--runtime-dir", str(runtime_base)]
    listed = _run_cli(*scope)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    for pid in escapees:
        assert f"pid {pid} (owner pid {main.pid}, found by registry)" in listed.stdout, listed.stdout
    killed = _run_cli("--kill", "--grace", "1", *scope)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert f"removed runtime directory {runtime_dir}" in killed.stdout, killed.stdout
    assert not runtime_dir.exists()
    result = scenario.finish(timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert not result.leaked, result.leaked
    assert escapees <= {int(s["pid"]) for s in result.survivors}


def test_registry_forgets_descendants_that_ended(tmp_path: Path) -> None:
    """A new DataLoader per reset starts processes every episode: the reaper's registry keeps
    only those still running, so it does not grow with the length of training."""
    worker_code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
        "while True: time.sleep(1)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        child = int(worker.stdout.readline())
        fifo = tmp_path / "reaper.fifo"
        os.mkfifo(fifo)
        me = psutil.Process()
        reaper = Reaper(me.pid, start_time(me), str(fifo))
        try:
            reaper.workers[worker.pid] = (start_time(psutil.Process(worker.pid)), worker.pid)
            reaper.snapshot()
            reaper.write_registry()
            assert _registry_lists(tmp_path / "registry.json", {child})
            os.kill(child, signal.SIGKILL)
            wait_until(lambda: not psutil.pid_exists(child), "the worker reaped its child")
            reaper.snapshot()
            reaper.write_registry()
            data = json.loads((tmp_path / "registry.json").read_text())
            assert data["seen"] == [] and data["workers"][0][0] == worker.pid
        finally:
            os.close(reaper.fifo_fd)
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.compat
def test_registry_group_of_a_dead_worker_needs_a_live_anchor() -> None:
    """An old registry names a worker whose pid now leads nothing, while a stranger lives in a
    process group of that id (a daemon that double-forked: its session leader exited). The sweep
    leaves the stranger alone, unless the registry saw it (then it is ours, by identity)."""
    code = (
        "import os, sys, time\n"
        "os.setsid()\n"
        "if os.fork():\n"
        "    os._exit(0)\n"
        "print(os.getpid(), flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    was_subreaper = _platform.is_child_subreaper()
    _platform.set_child_subreaper(True)  # the stranger is re-parented to us, not to PID 1
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    stranger: psutil.Process | None = None
    try:
        assert leader.stdout is not None
        stranger = psutil.Process(int(leader.stdout.readline()))
        leader.wait()
        assert os.getpgid(stranger.pid) == leader.pid and not psutil.pid_exists(leader.pid)
        me = psutil.Process()
        owner = (me.pid, start_time(me) - 100.0)  # a dead owner, as in a registry left behind
        workers = {leader.pid: (clock() - 86400.0, leader.pid)}  # yesterday's worker
        unanchored = Registry(*owner, workers, [])
        assert stranger not in unanchored.leftovers()
        anchored = Registry(*owner, workers, [(stranger.pid, start_time(stranger))])
        assert stranger in anchored.leftovers()
    finally:
        leader.kill()
        leader.wait()
        if stranger is not None:
            stranger.kill()
            try:
                os.waitpid(stranger.pid, 0)  # our child now (we are its subreaper)
            except ChildProcessError:
                pass
        if not was_subreaper:
            _platform.set_child_subreaper(False)


@pytest.mark.compat
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the identity clock: /proc")
def test_a_wall_clock_step_leaves_the_reapers_owner_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtual machine resumed from a snapshot, or an NTP step, moves the wall clock, and with
    it psutil's ``create_time()`` of every process (it adds the boot time as read now). An owner
    identified before the step is the same live process after it: its reaper must not take it
    for dead (it did, and killed a live test run's workers, after a VM snapshot)."""
    from psutil import _pslinux

    me = psutil.Process()
    fifo = tmp_path / "reaper.fifo"
    os.mkfifo(fifo)
    reaper = Reaper(me.pid, start_time(me), str(fifo))
    try:
        assert reaper.owner_alive()
        before = psutil.Process(me.pid).create_time()
        booted = _pslinux.boot_time
        monkeypatch.setattr(_pslinux, "boot_time", lambda: booted() + 37.0)
        assert psutil.Process(me.pid).create_time() == pytest.approx(before + 37.0, abs=0.02)  # stepped
        assert reaper.owner_alive()
        assert start_time(psutil.Process(me.pid)) == start_time(me)
    finally:
        os.close(reaper.fifo_fd)


_DIES_AFTER_ITS_REAPER_EXITED = """
import os, sys
from torchrl_ext import _reaper_client

fifo = _reaper_client.acquire()
print(os.path.dirname(fifo), flush=True)


class _DiesInstead:  # the owner dies after its reaper exited, before it removed the directory
    @staticmethod
    def rmtree(*args, **kwargs):
        os._exit(0)


_reaper_client.shutil = _DiesInstead
_reaper_client.LINGER = 0
_reaper_client.release()
"""


@pytest.mark.compat
def test_an_owner_dying_after_its_reaper_exited_leaves_no_runtime_directory() -> None:
    """The last env of an owner closed, its reaper was told to exit and did, and the owner died
    before it removed its runtime directory: the reaper removed it on its way out. (Before, only
    the owner removed it then, and a dead owner's directory stayed until a ``sweep``.)"""
    proc = subprocess.run(
        [sys.executable, "-c", _DIES_AFTER_ITS_REAPER_EXITED],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    runtime_dir = Path(proc.stdout.strip())
    assert runtime_dir.name.startswith("torchrl_ext-"), proc.stdout
    wait_until(lambda: not runtime_dir.exists(), "the dead owner's runtime directory is removed")
