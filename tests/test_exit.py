"""However the program ends, nothing is left: child interpreters under a subreaper harness.

Each scenario runs ``tests/scenarios.py`` in its own interpreter with a hard timeout. The
harness records every process still alive after the scenario's main process died and kills
(and reports as leaked) whatever outlives ``linger`` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import psutil
import pytest

from tests.conftest import Scenario, pid_alive
from tests.polling import wait_until
from torchrl_ext._identity import start_time
from torchrl_ext._reaper import Reaper

LINGER = 5.0  # the guarantee is 2 s; slack for a loaded 2-core CI machine
#: The compat suite (TorchRL 0.10.1) runs a child interpreter per case: it takes the exits and
#: the kills that end everything, under fork, and leaves the variations to the main suite.
COMPAT = pytest.mark.compat


def _at_least(count: int, paths: Iterable[Path]) -> list[Path] | None:
    found = list(paths)
    return found if len(found) >= count else None


def _is_mp_helper(cmdline: str) -> bool:
    return "multiprocessing.resource_tracker" in cmdline or "multiprocessing.forkserver" in cmdline


def _assert_nothing_leaked(result: object) -> None:
    leaked = result.leaked
    assert not leaked, f"processes outlived the main process by {LINGER}s: {leaked}"


_REAPER_KILLED = re.compile(
    r"torchrl_ext reaper: owner process \d+ died; killed (\d+) leftover process\(es\): (.*)"
)


def _reaper_killed(stderr: str) -> set[int] | None:
    """The pids the reaper's warning names (``None``: it logged none)."""
    found = _REAPER_KILLED.search(stderr)
    if found is None:
        return None
    return {int(pid) for pid in re.findall(r"(\d+) \(", found.group(2))}


@pytest.mark.parametrize(
    ("name", "returncode", "stderr_has", "method"),
    [
        pytest.param("exit_without_close", 0, None, "fork", marks=COMPAT),
        pytest.param("exception_at_top_level", 1, "user error at top level", "fork", marks=COMPAT),
        pytest.param("sys_exit", 3, None, "fork", marks=COMPAT),
        # TorchRL's default start method too (a child interpreter per case: one case only).
        ("exit_without_close", 0, None, "spawn"),
        # The default path: the exit hook closes the env, then stops the preloaded server (a
        # fork of the main process here, and, with TORCHRL_EXT_ZYGOTE=0, a new interpreter).
        ("exit_without_close", 0, None, "preloaded"),
        ("exit_without_close", 0, None, "interpreter"),
    ],
)
def test_interpreter_exit_closes_open_envs(
    scenario: Scenario, name: str, returncode: int, stderr_has: str, method: str
) -> None:
    scenario.start(name, "--method", method, "--subprocess", "plain", linger=LINGER)
    result = scenario.finish(timeout=120)
    assert result.returncode == returncode, result.stderr
    if stderr_has:
        assert stderr_has in result.stderr
    _assert_nothing_leaked(result)
    # The atexit hook closed the env: nothing of it was left when the main process ended
    # (multiprocessing's resource tracker, which spawn starts, ends by itself just after).
    assert not [s for s in result.survivors if not _is_mp_helper(s["cmdline"])], result.survivors


@pytest.mark.parametrize(
    ("sig", "returncode", "stderr_has", "method"),
    [
        pytest.param(signal.SIGTERM, -signal.SIGTERM, None, "fork", marks=COMPAT),
        # An uncaught KeyboardInterrupt ends Python with 1, or "by" SIGINT (-2) when CPython's
        # unhandled-KeyboardInterrupt exit path applies: either way it was raised, and reported.
        (signal.SIGINT, (1, -signal.SIGINT), "KeyboardInterrupt", "fork"),
        (signal.SIGHUP, -signal.SIGHUP, None, "fork"),
        # TorchRL's default start method too (a child interpreter per case: one case only).
        (signal.SIGTERM, -signal.SIGTERM, None, "spawn"),
    ],
)
def test_signals_close_envs_then_chain(
    scenario: Scenario, sig: int, returncode: int | tuple[int, ...], stderr_has: str, method: str
) -> None:
    scenario.start(
        "rollout_forever", "--method", method, "--subprocess", "plain", "--step-sleep", "0.02", linger=LINGER
    )
    ready = scenario.wait_ready()
    os.kill(ready["pid"], sig)
    result = scenario.finish(timeout=120)
    expected = returncode if isinstance(returncode, tuple) else (returncode,)
    assert result.returncode in expected, result.stderr
    if stderr_has:
        assert stderr_has in result.stderr
    _assert_nothing_leaked(result)
    assert "leftover" not in result.stderr, result.stderr  # the close ended everything


@pytest.mark.timeout(600)  # up to three child interpreters, each importing torch
@pytest.mark.parametrize(
    ("method", "runs"),
    # Runs: the preloaded server was reported in about 2 runs of 3, CPython's fork server in
    # every run; fork, which has no server, never.
    [pytest.param("fork", 2, marks=COMPAT), ("preloaded", 3), ("forkserver", 1)],
)
def test_sigterm_close_leaves_the_reaper_nothing_to_report(method: str, runs: int, tmp_path: Path) -> None:
    """After SIGTERM the handler closes the env and the process dies by the signal: the reaper,
    which sees its owner die, finds only the owner's fork server (preloaded or CPython's), which
    ends by itself with its owner, and reports nothing (it used to catch the server mid-exit,
    kill it and report it as a leftover)."""
    for run in range(runs):
        scenario = Scenario(tmp_path / f"run{run}")
        scenario.tmp_path.mkdir()
        try:
            scenario.start(
                "rollout_forever",
                "--method",
                method,
                "--subprocess",
                "plain",
                "--step-sleep",
                "0.02",
                linger=LINGER,
            )
            ready = scenario.wait_ready()
            os.kill(ready["pid"], signal.SIGTERM)
            result = scenario.finish(timeout=120)
        finally:
            scenario.kill()
        assert result.returncode == -signal.SIGTERM, result.stderr
        _assert_nothing_leaked(result)
        assert "leftover" not in result.stderr, f"run {run}: {result.stderr}"


def test_user_sigterm_handler_still_called(scenario: Scenario) -> None:
    scenario.start("user_handler", "--method", "fork", "--step-sleep", "0.02", linger=LINGER)
    ready = scenario.wait_ready()
    os.kill(ready["pid"], signal.SIGTERM)
    result = scenario.finish(timeout=120)
    assert result.returncode == 7, result.stderr
    assert (scenario.ready_file.parent / (scenario.ready_file.name + ".handler")).read_text() == str(
        int(signal.SIGTERM)
    )
    _assert_nothing_leaked(result)


@pytest.mark.parametrize(
    ("method", "busy"),
    [
        pytest.param("fork", "sleep", marks=COMPAT),
        ("forkserver", "sleep"),
        ("spawn", "sleep"),
        ("preloaded", "sleep"),
        ("interpreter", "sleep"),
        ("fork", "gil"),
        ("fork", "portable"),
    ],
)
def test_sigkill_of_main_mid_long_step_leaves_nothing(
    scenario: Scenario, method: str, busy: str, tmp_path: Path
) -> None:
    """Workers busy in a long step (sleeping, or inside one C call that holds the GIL), each
    holding 2 DataLoader workers and a setsid subprocess. ``portable``: sleeping, with the
    Linux-only calls off (``TORCHRL_EXT_PORTABLE=1``: no parent-death signal, no subreaper, no
    pidfds), the guarantee documented for macOS."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    busy_args = ["--hold-gil"] if busy == "gil" else ["--step-sleep", "60"]
    env_vars = {"TORCHRL_EXT_PORTABLE": "1"} if busy == "portable" else None
    scenario.start(
        "rollout_forever",
        "--method",
        method,
        "--subprocess",
        "setsid",
        *busy_args,
        "--pid-dir",
        str(pid_dir),
        linger=LINGER,
        env_vars=env_vars,
    )
    ready = scenario.wait_ready(timeout=240)
    # NOTE [zygote]: a single-threaded program's server is a fork of it.
    assert ready["server_kind"] == {"preloaded": "zygote", "interpreter": "interpreter"}.get(method), ready
    # Kill the main process like the OOM killer would, once both workers are inside the step.
    wait_until(lambda: len(list(pid_dir.glob("stepping-*"))) >= 2, "both workers in the step", timeout=120)
    scenario.wait_seen(ready["workers"])
    os.kill(ready["pid"], signal.SIGKILL)
    result = scenario.finish(timeout=120)
    assert result.returncode == -signal.SIGKILL
    _assert_nothing_leaked(result)
    seen = {s["pid"] for s in result.seen_before_death}
    assert set(ready["workers"]) <= seen
    children = {int(p.read_text()) for p in pid_dir.glob("*-*-*") if not p.name.startswith("stepping")}
    assert len(children) == 2 * 3, "each worker held 2 DataLoader workers and a setsid simulator"
    assert not [pid for pid in children if pid_alive(pid)]
    # The Linux-only calls were made, or not: the parent-death signal each worker armed, and
    # whether the reaper waited on a pidfd or polled.
    pdeathsig = {int(p.read_text()) for p in pid_dir.glob("pdeathsig-*")}
    from torchrl_ext import _platform

    if busy == "portable":
        assert pdeathsig == {0}, pdeathsig
    elif _platform.has_prctl():
        assert pdeathsig == {int(signal.SIGKILL)}, pdeathsig
    polls = busy == "portable" or not _platform.has_pidfd()
    reapers = [s["cmdline"] for s in result.seen_before_death if "_reaper.py" in s["cmdline"]]
    assert reapers and all(cmd.endswith(" poll") == polls for cmd in reapers), reapers
    # What the env could not end is reported: the simulators (outside every worker's group, no
    # parent-death signal) at least; the fork server, which ends with its owner, never.
    killed = _reaper_killed(result.stderr)
    simulators = {int(p.read_text()) for p in pid_dir.glob("sim-*")}
    assert killed is not None and simulators <= killed, (simulators, result.stderr)
    assert ready.get("server") not in killed, (ready, result.stderr)


def test_direct_children_killed_then_main_exits_leaves_nothing(scenario: Scenario, tmp_path: Path) -> None:
    """Ray's default on ``ray.kill(actor)``: SIGKILL the actor's direct children, then exit.
    The reaper is not a direct child (it runs behind a shim), so it still ends the escapees."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    scenario.start(
        "kill_children_then_exit", "--subprocess", "setsid", "--pid-dir", str(pid_dir), linger=LINGER
    )
    scenario.wait_ready()
    result = scenario.finish(timeout=120)
    assert result.returncode == 1
    _assert_nothing_leaked(result)
    escapees = [int(p.read_text()) for p in pid_dir.glob("sim-*")]
    assert len(escapees) == 2, "each worker started a setsid simulator"
    assert not [pid for pid in escapees if pid_alive(pid)]


@pytest.mark.compat
@pytest.mark.parametrize("method", ["fork", "preloaded", "interpreter"])
def test_sigkill_of_main_while_dataloaders_start(scenario: Scenario, tmp_path: Path, method: str) -> None:
    """The main process is SIGKILLed in the middle of the workers' first reset: each worker has
    started its simulator and built its DataLoader iterator, whose 2 workers are inside their
    ``worker_init_fn`` (which never returns), so no batch has been delivered. Those DataLoader
    workers never reach torch's loop, whose watchdog would notice their parent is gone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    scenario.start(
        "kill_during_start",
        "--method",
        method,
        "--subprocess",
        "setsid",
        "--hang-loader-start",
        "--pid-dir",
        str(pid_dir),
        linger=LINGER,
    )
    ready = scenario.wait_ready()
    starting = wait_until(
        lambda: _at_least(4, pid_dir.glob("dlstart-*")),
        "all 4 DataLoader workers are inside their worker_init_fn",
        timeout=180,
    )
    # The phase at the kill: iterators built, loader workers starting, no batch yet (and none
    # can come later: the worker_init_fn never returns).
    assert len(list(pid_dir.glob("iter-*"))) == 2, "each worker built its DataLoader iterator"
    assert not list(pid_dir.glob("batch-*")), "a DataLoader delivered a batch: past the start"
    scenario.wait_seen(int(p.read_text()) for p in [*starting, *pid_dir.glob("sim-*")])
    os.kill(ready["pid"], signal.SIGKILL)
    result = scenario.finish(timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    _assert_nothing_leaked(result)
    assert not list(pid_dir.glob("batch-*"))
    loader_workers = {int(p.read_text()) for p in starting}
    simulators = {int(p.read_text()) for p in pid_dir.glob("sim-*")}
    assert len(loader_workers) == 4 and len(simulators) == 2
    seen = {s["pid"] for s in result.seen_before_death}
    assert loader_workers | simulators <= seen
    assert not [pid for pid in loader_workers | simulators if pid_alive(pid)]


def test_env_started_from_a_short_lived_thread_dies_with_main(scenario: Scenario) -> None:
    scenario.start(
        "thread_start", "--method", "fork", "--subprocess", "plain", "--step-sleep", "0.05", linger=LINGER
    )
    ready = scenario.wait_ready()
    assert ready["steps"] == 3, "workers survived the end of the thread that started them"
    os.kill(ready["pid"], signal.SIGKILL)
    result = scenario.finish(timeout=120)
    _assert_nothing_leaked(result)


def _progress(path: Path, timeout: float = 60.0) -> dict[str, Any]:
    def read() -> dict[str, Any] | None:
        try:  # written by os.replace, but the test may look before the first write
            return cast(dict[str, Any], json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    return wait_until(read, f"{path} is readable", timeout=timeout)


@pytest.mark.compat
@pytest.mark.parametrize("exit_with_parent", ["on", "off"])
def test_env_owner_whose_parent_dies(scenario: Scenario, exit_with_parent: str) -> None:
    """A multiprocessing child owns an env; its parent dies without clean-up. With
    ``exit_with_parent`` (the default there) the child closes its env and ends; without, it
    keeps stepping until told to stop, then closes cleanly."""
    scenario.start("parent_of_env_owner", "--exit-with-parent", exit_with_parent, linger=60.0)
    ready = scenario.wait_ready()
    child, progress, stop = int(ready["child"]), Path(ready["progress"]), Path(ready["stop"])
    workers = _progress(progress)["workers"]
    assert len(workers) == 2
    if exit_with_parent == "off":
        # The child outlives its parent and keeps stepping (its parent is now the harness).
        wait_until(
            lambda: _progress(progress)["ppid"] != ready["pid"] and not psutil.pid_exists(int(ready["pid"])),
            "the parent died",
        )
        steps = int(_progress(progress)["steps"])
        wait_until(
            lambda: int(_progress(progress)["steps"]) > steps,
            "the env kept stepping after its owner's parent died",
        )
        stop.touch()
    result = scenario.finish(timeout=120)
    assert result.returncode == 0, result.stderr
    _assert_nothing_leaked(result)
    survivor = {int(s["pid"]): s for s in result.survivors}
    assert child in survivor, result.survivors
    if exit_with_parent == "on":
        assert "died: closing 1 managed env(s)" in result.stderr, result.stderr
        assert result.exit_codes.get(child) == -signal.SIGTERM, result.exit_codes
    else:
        assert "died" not in result.stderr, result.stderr
        assert result.exit_codes.get(child) == 0, result.exit_codes
    assert not [pid for pid in workers if psutil.pid_exists(int(pid))]


def _bootstrapping(main_pid: int, method: str) -> list[int] | None:
    """Pids of processes started for the env that are still bootstrapping (they have not
    reached our worker set-up, which tags them with a worker index): spawned children under
    spawn, children of CPython's fork server under forkserver."""
    try:
        procs = psutil.Process(main_pid).children(recursive=True)
    except psutil.Error:
        return None
    found = []
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline())
            parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
            env = proc.environ()
        except psutil.Error:
            continue
        if method == "spawn" and "--multiprocessing-fork" not in cmd:
            continue
        if method == "forkserver" and "multiprocessing.forkserver" not in parent:
            continue
        if "TORCHRL_EXT_WORKER" not in env or method == "forkserver":
            found.append(proc.pid)
    return found or None


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_sigkill_of_main_while_workers_bootstrap(scenario: Scenario, tmp_path: Path, method: str) -> None:
    """The main process is SIGKILLed while the processes it started for the env are still
    bootstrapping (importing torch, before any code of ours runs in them): the reaper knows them
    from the moment their pid exists (NOTE [tagged at birth]) and SIGKILLs them; none lives on
    to finish its start-up and exit by itself."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    scenario.start("kill_during_start", "--method", method, "--pid-dir", str(pid_dir), linger=LINGER)
    ready = scenario.wait_ready()
    targets = wait_until(
        lambda: _bootstrapping(ready["pid"], method),
        f"a process of the env is bootstrapping under {method}",
        timeout=120,
    )
    assert not list(pid_dir.glob("pdeathsig-*")), "an env was built already: past the bootstrap"
    os.kill(ready["pid"], signal.SIGKILL)
    result = scenario.finish(timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    _assert_nothing_leaked(result)
    killed = _reaper_killed(result.stderr) or set()
    for pid in targets:
        # Killed by the reaper (SIGKILL); one that finished its start-up would have seen its
        # owner gone and exited with 1, seconds later. Under forkserver, a worker the reaper
        # killed while CPython's fork server still ran is reaped by that server, so this harness
        # never sees its status: then the reaper's warning must name it.
        code = result.exit_codes.get(pid)
        if code is None:
            assert pid in killed, (pid, killed, result.exit_codes, result.stderr)
        else:
            assert code == -signal.SIGKILL, (pid, result.exit_codes, result.survivors)


def _write_messages(fifo: Path, *messages: dict[str, Any]) -> None:
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the reaper holds it open for reading
    try:
        os.write(fd, "".join(json.dumps(m) + "\n" for m in messages).encode())
    finally:
        os.close(fd)


def test_reaper_waits_for_helpers_and_names_what_it_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At its owner's death the reaper kills what the owner left at once and names it; a helper
    (a fork server: it ends by itself once its owner is gone) gets time to end and is not counted,
    even when it is also watched as a worker, as the preloaded server is."""
    sleeper = "import time\nwhile True: time.sleep(1)"
    owner = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE)
    ended = tmp_path / "helper-ended"
    # Reads the owner's stdout: EOF once the owner is gone; then ends by itself, a moment later.
    helper_code = f"import sys, time\nsys.stdin.read()\ntime.sleep(0.3)\nopen({str(ended)!r}, 'w').close()\n"
    helper = subprocess.Popen([sys.executable, "-c", helper_code], stdin=owner.stdout, process_group=0)
    assert owner.stdout is not None
    owner.stdout.close()
    leftover = subprocess.Popen([sys.executable, "-c", sleeper], process_group=0)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    fifo = runtime / "reaper.fifo"
    os.mkfifo(fifo)
    caplog.set_level(logging.WARNING, logger="torchrl_ext.reaper")
    procs = {p.pid: psutil.Process(p.pid) for p in (owner, helper, leftover)}
    reaper = Reaper(owner.pid, start_time(procs[owner.pid]), str(fifo))
    thread = threading.Thread(target=reaper.run)
    thread.start()
    try:
        ctime = start_time(procs[helper.pid])
        _write_messages(
            fifo,
            {
                "op": "watch",
                "pid": leftover.pid,
                "ctime": start_time(procs[leftover.pid]),
                "pgid": leftover.pid,
            },
            {"op": "watch", "pid": helper.pid, "ctime": ctime, "pgid": helper.pid},
            {"op": "helper", "pid": helper.pid, "ctime": ctime},
        )
        owner.kill()
        owner.wait()
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        for proc in (owner, helper, leftover):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert ended.exists(), "the helper was killed instead of ending by itself"
    messages = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert len(messages) == 1 and _reaper_killed(messages[0]) == {leftover.pid}, messages
    assert "killed 1 leftover process(es)" in messages[0], messages
