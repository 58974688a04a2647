"""Which torchrl_ext modules does one restart cross?

A diagnostic, not a benchmark: it times nothing and writes no results file. It builds
``ManagedParallelEnv(2, make_env, max_restarts=1)`` with ``benchmarks/restart.py``'s factory
(``tests/envs.py``'s ``ToyEnv``) and the default start, steps it, SIGKILLs one worker between two
calls and polls until that process is gone (or a zombie). Then, for the one next call (a
``step_and_maybe_reset``, which replaces the worker: restarts happen in the calling thread),
``sys.setprofile`` (this thread) and ``threading.setprofile`` (threads started during the call)
record the module (``frame.f_globals["__name__"]``) of every Python function called that is
``torchrl_ext`` or below it, and every call edge between two of those modules (the caller is the
nearest ``torchrl_ext`` frame up the stack, so a call that passes through TorchRL or the standard
library still counts as ours calling ours). The same trace of one ordinary call just before the
kill (the same call, no worker lost) gives the baseline: the modules and edges only a restart
adds. Threads already running when the call starts (the supervisor's) are
not traced: ``threading.setprofile`` only reaches threads started after it; their names are
printed. The script checks that the call restarted that slot (``env.stats()["restarts"]`` and
``env.restarts``) and fails otherwise. It prints the modules called in the main thread and in the
other threads, their union, and the counts; ``--json`` prints one JSON object instead.

    python benchmarks/restart_trace.py           # a few seconds
    python benchmarks/restart_trace.py --json    # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import psutil
from restart import ROOT, _factory

PACKAGE = "torchrl_ext"
#: Seconds to wait for the killed worker to be gone.
GONE_TIMEOUT = 30.0


class ModuleTrace:
    """The ``torchrl_ext`` modules of the Python functions called while it is active, per thread."""

    def __init__(self) -> None:
        self.main_ident = threading.main_thread().ident
        self.main: set[str] = set()
        self.others: set[str] = set()
        #: (caller module, callee module), both ours and different, any thread.
        self.edges: set[tuple[str, str]] = set()
        self.other_threads: set[str] = set()
        self.active = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active:
            sys.setprofile(None)  # a thread started during the call that outlives it
            return
        if event != "call":
            return
        module = _ours(frame)
        if module is None:
            return
        caller = frame.f_back
        while caller is not None and _ours(caller) is None:
            caller = caller.f_back
        if caller is not None and (source := _ours(caller)) != module:
            assert source is not None
            self.edges.add((source, module))
        if threading.get_ident() == self.main_ident:
            self.main.add(module)
        else:
            self.others.add(module)
            self.other_threads.add(threading.current_thread().name)

    def __enter__(self) -> ModuleTrace:
        self.active = True
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        self.active = False


def _ours(frame: FrameType) -> str | None:
    """The frame's module when it is ``torchrl_ext`` or below it."""
    module = frame.f_globals.get("__name__")
    if isinstance(module, str) and (module == PACKAGE or module.startswith(PACKAGE + ".")):
        return module
    return None


def _edges(edges: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, b in edges)


def _wait_gone(proc: psutil.Process, timeout: float) -> float:
    """Poll until ``proc`` has exited (gone or a zombie); the seconds it took."""
    start = time.monotonic()
    while True:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - start
        except psutil.NoSuchProcess:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"worker {proc.pid} still runs {timeout:.0f}s after SIGKILL")
        time.sleep(0.005)


def trace(slot: int, steps: int) -> dict[str, Any]:
    """Kill worker ``slot`` after ``steps`` steps and trace the call that replaces it."""
    from torchrl_ext import ManagedParallelEnv

    env = ManagedParallelEnv(2, _factory(), max_restarts=1)
    try:
        td = env.reset()
        for _ in range(steps):
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
        td.set("action", env.action_spec.rand())
        with ModuleTrace() as baseline:
            _, td = env.step_and_maybe_reset(td)
        victim = env.worker_pids[slot]
        proc = psutil.Process(victim)
        restarts_before, records_before = env.stats()["restarts"], len(env.restarts)
        os.kill(victim, signal.SIGKILL)
        gone_after = _wait_gone(proc, GONE_TIMEOUT)
        untraced = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        td.set("action", env.action_spec.rand())
        with ModuleTrace() as modules:
            _, td = env.step_and_maybe_reset(td)
        restarts_after, records = env.stats()["restarts"], env.restarts
        new = records[records_before:]
        problems = [
            what
            for what, bad in (
                (
                    f"stats() restarts {restarts_before} -> {restarts_after}",
                    restarts_after != restarts_before + 1,
                ),
                (f"{len(new)} new restart records", len(new) != 1),
                (
                    f"record {new[-1] if new else None} is not slot {slot}, pid {victim}",
                    not new or new[-1].slot != slot or new[-1].old_pid != victim,
                ),
                (f"worker_pids[{slot}] is still {victim}", env.worker_pids[slot] == victim),
            )
            if bad
        ]
        if problems:
            raise RuntimeError("the traced call did not restart the killed worker: " + "; ".join(problems))
        record = str(new[-1])
    finally:
        env.close()
    both = modules.main | modules.others
    ordinary = baseline.main | baseline.others
    return {
        "record": record,
        "killed_gone_after_s": round(gone_after, 4),
        "main_thread": sorted(modules.main),
        "other_threads": sorted(modules.others),
        "union": sorted(both),
        "edges": _edges(modules.edges),
        "baseline_union": sorted(ordinary),
        "restart_only": sorted(both - ordinary),
        "restart_only_edges": _edges(modules.edges - baseline.edges),
        "counts": {
            "main_thread": len(modules.main),
            "other_threads": len(modules.others),
            "union": len(both),
            "edges": len(modules.edges),
            "baseline_union": len(ordinary),
            "baseline_edges": len(baseline.edges),
            "restart_only": len(both - ordinary),
            "restart_only_edges": len(modules.edges - baseline.edges),
        },
        "other_thread_names": sorted(modules.other_threads),
        "untraced_threads": untraced,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slot", type=int, default=0, choices=(0, 1), help="the worker to kill")
    p.add_argument("--steps", type=int, default=5, help="steps before the kill")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # tests.envs, for this process and the workers
    result = trace(args.slot, args.steps)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"restart: {result['record']} (killed worker gone after {result['killed_gone_after_s']:.3f}s)")
    for key, title in (
        ("main_thread", "main thread"),
        ("other_threads", "other threads"),
        ("union", "union"),
        ("restart_only", "not called by an ordinary call"),
    ):
        print(f"\n{title} ({result['counts'][key]} modules):")
        for module in result[key]:
            print(f"  {module}")
    print(f"\nother threads seen: {', '.join(result['other_thread_names']) or 'none'}")
    print(f"running before the call, not traced: {', '.join(result['untraced_threads']) or 'none'}")
    counts = result["counts"]
    print(
        f"\ncounts: main thread {counts['main_thread']}, other threads {counts['other_threads']}, "
        f"union {counts['union']} (an ordinary call: {counts['baseline_union']}, restart only: "
        f"{counts['restart_only']})"
    )
    print(
        f"call edges between modules: {counts['edges']} (an ordinary call: {counts['baseline_edges']}, "
        f"restart only: {counts['restart_only_edges']})"
    )
    print(f"\nedges ({counts['edges']}):")
    for edge in result["edges"]:
        print(f"  {edge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
