"""The demo's last part: upstream ``ParallelEnv`` and ``ManagedParallelEnv`` side by side on the
same env, each on its own default start path and each in a fresh interpreter of its own, so that
both starts are measured the same way and whatever a side leaves behind is counted, not printed
after the demo's own output:

* **cold start**: the first env of the interpreter, from its constructor to the first reset
  returning (torch and TorchRL already imported): upstream spawns its workers (each imports
  torch), ours starts the preloaded server (one import of torch) and forks them.
* **a worker SIGKILLed**: what the next call raises, and how many of the dead worker's
  DataLoader workers are still alive ``LINGER`` seconds later.
* **at the interpreter's exit**: the semaphores multiprocessing's ``resource_tracker`` reports
  as leaked (read from the interpreter's captured stderr), and the processes it started that are
  still alive ``AFTER_EXIT`` seconds after it exited. While a trial runs, this process is a child
  subreaper, so that those processes come to it: it counts them, then ends and reaps them, and
  the demo leaves nothing.

Run by ``examples/heavy_reset.py``; ``python examples/compare.py --side upstream|managed ...`` is
the trial's own interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

import torchrl_ext
from torchrl_ext import ManagedParallelEnv, _platform

#: Seconds after the kill at which the dead worker's DataLoader workers are counted.
LINGER = 3.0
#: Seconds after a trial's interpreter exited at which the processes it left are counted.
AFTER_EXIT = 3.0
#: Seconds after its exit until which the processes it left may end by themselves (then: killed).
GONE_CAP = 30.0
#: Seconds a trial's interpreter may run (upstream's spawns re-import torch: tens of seconds).
TRIAL_TIMEOUT = 600.0
#: The resource tracker's warning at interpreter exit.
_LEAKED = re.compile(r"There appear to be (\d+) leaked (\w+) objects")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


# ----------------------------------------------------------------- in the trial's interpreter
def trial(cls: type[Any], make_env: Callable[[], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Cold start, then a worker's SIGKILL (see the module doc)."""
    t = time.perf_counter()
    env = cls(2, make_env, **kwargs)
    td = env.reset()
    cold_s = time.perf_counter() - t
    # Not getattr(env, ...): upstream forwards a name it lacks to its workers' envs.
    start_method = env.start_method if isinstance(env, ManagedParallelEnv) else env._workers[0]._popen.method
    for _ in range(20):
        td = env.step_and_maybe_reset(env.rand_action(td))[1]
    victim = psutil.Process(env._workers[0].pid)  # both keep TorchRL's process list
    children = victim.children(recursive=True)
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    error = "none"
    try:
        for _ in range(1000):
            td = env.step_and_maybe_reset(env.rand_action(td))[1]
    except Exception as err:  # upstream and ours raise different types: that is the point
        error = type(err).__name__
    left = _alive(children)
    while left and time.monotonic() - killed_at < LINGER:
        time.sleep(0.05)
        left = _alive(children)
    with contextlib.suppress(Exception):  # upstream's close() raises once a worker is dead
        env.close()
    return {
        "start_method": start_method,
        "cold_s": cold_s,
        "error": error,
        "children": len(children),
        "left": len(left),
    }


def _child_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["upstream", "managed"], required=True)
    p.add_argument("--spec", required=True, help="JSON: env_kwargs (for LogReplayEnv), managed_kwargs")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import log_replay  # examples/ is sys.path[0] in this interpreter

    spec = json.loads(args.spec)
    make_env = functools.partial(log_replay.LogReplayEnv, **spec["env_kwargs"])
    if args.side == "upstream":
        from torchrl.envs import ParallelEnv

        result = trial(ParallelEnv, make_env, {})  # upstream's own defaults
    else:
        result = trial(ManagedParallelEnv, make_env, dict(spec["managed_kwargs"], daemon_workers=False))
    Path(args.out).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------ in the demo's process
def _new_children(before: set[int]) -> list[psutil.Process]:
    return [c for c in psutil.Process().children() if c.pid not in before]


def _left_behind(before: set[int], child_pid: int) -> list[psutil.Process]:
    """Live processes that came to this subreaper from the trial, and their descendants."""
    out = []
    for proc in _alive([p for p in _new_children(before) if p.pid != child_pid]):
        out.append(proc)
        with contextlib.suppress(psutil.Error):
            out += _alive(proc.children(recursive=True))
    return out


def _end_and_reap(before: set[int], child_pid: int | None) -> None:
    """Kill and reap every process that came to this subreaper during the trial (orphans of
    the trial's interpreter and of its processes), until none is left."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        procs = [p for p in _new_children(before) if p.pid != child_pid]
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                for below in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        below.kill()
                proc.kill()
        for proc in procs:  # our children now: reap by pid (no waitpid(-1), nothing else is stolen)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(proc.pid, 0)


def run_side(side: str, env_kwargs: dict[str, Any], managed_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run one side's trial in a fresh interpreter; add what it left at its exit."""
    spec = json.dumps({"env_kwargs": env_kwargs, "managed_kwargs": managed_kwargs})
    # The same torchrl_ext as this process's, whatever sys.path the script gets.
    package_root = str(Path(torchrl_ext.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    was_subreaper = _platform.is_child_subreaper()
    before = {c.pid for c in psutil.Process().children()}
    child: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="torchrl_ext-demo-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "output.txt"
        cmd = [sys.executable, __file__, "--side", side, "--spec", spec, "--out", str(out)]
        try:
            _platform.set_child_subreaper(True)
            with open(log, "wb") as fh:  # a file, not a pipe: a leftover process may hold it open
                child = subprocess.Popen(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=path)
                )
            try:
                child.wait(timeout=TRIAL_TIMEOUT)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            # What it left: counted AFTER_EXIT s after its exit, then given until GONE_CAP to end
            # by itself (the resource tracker reports leaks once the last process using it ended).
            exited, after_exit, gone_s, left = time.monotonic(), None, None, []
            while True:
                waited = time.monotonic() - exited
                left = _left_behind(before, child.pid)
                if after_exit is None and (waited >= AFTER_EXIT or not left):
                    after_exit = len(left)
                if not left:
                    gone_s = waited
                    break
                if waited >= GONE_CAP:
                    break
                time.sleep(0.1)
        finally:
            _end_and_reap(before, None if child is None else child.pid)
            if not was_subreaper:
                _platform.set_child_subreaper(False)
        output = log.read_text(errors="replace")
        if child.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {side} trial failed (exit code {child.returncode}):\n{output[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    leaked: dict[str, int] = {}
    for count, kind in _LEAKED.findall(output):
        leaked[kind] = leaked.get(kind, 0) + int(count)
    result.update(leaked=leaked, after_exit=after_exit, gone_s=gone_s, still_alive=len(left))
    return result


def compare_with_upstream(env_kwargs: dict[str, Any], managed_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Print the side-by-side table (upstream with its own defaults: daemon=False and spawn on
    TorchRL >= 0.11); return both sides' results (keys ``upstream``, ``managed``)."""
    print("\nupstream ParallelEnv vs ManagedParallelEnv: same env, 2 workers, each in a fresh interpreter")
    up = run_side("upstream", env_kwargs, managed_kwargs)
    ours = run_side("managed", env_kwargs, managed_kwargs)

    def leaked(side: dict[str, Any]) -> str:
        return str(side["leaked"].get("semaphore", 0))

    def gone(side: dict[str, Any]) -> str:
        if side["gone_s"] is None:
            return f"> {GONE_CAP:g} ({side['still_alive']} killed)"
        return f"{side['gone_s']:.1f}"

    rows = [
        ("start path", up["start_method"], ours["start_method"]),
        ("cold start (build + first reset), s", f"{up['cold_s']:.1f}", f"{ours['cold_s']:.1f}"),
        ("a worker SIGKILLed: the next call raises", up["error"], ours["error"]),
        (
            f"  its DataLoader workers alive {LINGER:g} s later",
            f"{up['left']} of {up['children']}",
            f"{ours['left']} of {ours['children']}",
        ),
        ("at the interpreter's exit: leaked semaphores", leaked(up), leaked(ours)),
        (f"  its processes alive {AFTER_EXIT:g} s after it", str(up["after_exit"]), str(ours["after_exit"])),
        ("  until the last of them had ended, s", gone(up), gone(ours)),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"  {'':<{width}}  {'upstream':<16} managed")
    for label, a, b in rows:
        print(f"  {label:<{width}}  {a:<16} {b}")
    others = sorted((set(up["leaked"]) | set(ours["leaked"])) - {"semaphore"})
    for kind in others:
        up_n, ours_n = up["leaked"].get(kind, 0), ours["leaked"].get(kind, 0)
        print(f"  (resource_tracker also reported leaked {kind} objects: {up_n} upstream, {ours_n} managed)")
    return {"upstream": up, "managed": ours}


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
