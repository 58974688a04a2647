"""What both benchmarks need to know about the (shared) machine they run on."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

#: Long-lived helper processes that are not part of what a benchmark measures.
HELPER_MARKERS = ("resource_tracker", "_reaper.py", "multiprocessing.forkserver")


def is_helper(proc: psutil.Process) -> bool:
    """Whether ``proc`` is one of multiprocessing's or torchrl_ext's helper processes."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return any(marker in cmd for marker in HELPER_MARKERS)


def system_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores, everything but idle)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return float(sum(t) - idle)


def wait_for_quiet(limit: float = 0.3, max_wait: float = 30.0) -> float:
    """Wait (up to ``max_wait`` s) until other jobs use less than ``limit`` cores; return their load."""
    deadline = time.monotonic() + max_wait
    while True:
        before, t = system_busy(), time.monotonic()
        time.sleep(0.5)
        load = (system_busy() - before) / (time.monotonic() - t)
        if load < limit or time.monotonic() > deadline:
            return load


def kill_tree(pid: int) -> int:
    """SIGKILL ``pid`` and every descendant, wait for them; returns how many there were."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def run_script_child(
    script: str,
    spec: dict[str, Any],
    out_path: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    watch: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``script --child SPEC --child-out OUT`` in a fresh interpreter.

    Returns ``(result, None)`` with the JSON the child wrote, or ``(None, why)``. ``watch(pid)``
    is entered while the child runs (to sample its process tree). On timeout the child's whole
    tree is killed.
    """
    cmd = [sys.executable, script, "--child", json.dumps(spec), "--child-out", str(out_path)]
    child_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env)
    with watch(proc.pid) if watch is not None else contextlib.nullcontext():
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.communicate()
            return None, f"timed out after {timeout:.0f}s"
    if proc.returncode != 0 or not out_path.exists():
        tail = err.strip().splitlines()[-1:] if err else []
        return None, f"exit code {proc.returncode}: {tail}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result, None


def child_trial(
    trials: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
    name: str,
    spec: dict[str, Any],
    out_path: Path,
    imports: Sequence[str] = ("torchrl_ext",),
) -> dict[str, Any]:
    """In a child of :func:`run_script_child`: run ``trials[name](spec)`` and return its result,
    or ``{"error", "traceback"}`` if it raised (the parent counts the trial as failed).
    ``imports`` are imported before any clock starts; a trial stuck in a call leaves its
    threads' stacks in ``stacks.txt`` beside ``out_path`` 10 s before ``spec["timeout"]``."""
    stacks = (out_path.parent / "stacks.txt").open("w")
    faulthandler.dump_traceback_later(float(spec["timeout"]) - 10.0, exit=True, file=stacks)
    for module in imports:
        importlib.import_module(module)
    try:
        result = trials[name](spec)
    except BaseException as err:
        result = {"error": f"{type(err).__name__}: {err}"[:300], "traceback": traceback.format_exc()}
    faulthandler.cancel_dump_traceback_later()
    return result


def interleaved(
    repeats: int, groups: Sequence[str], counts: Sequence[int], configs: Sequence[str]
) -> Iterator[tuple[int, str, int, str]]:
    """``(repeat, group, count, config)`` for every cell, each repeat in full before the next,
    the configs rotated by one per repeat: the configurations compared by a ratio run side by
    side in time, and none always runs first."""
    for repeat in range(repeats):
        for group in groups:
            for count in counts:
                shift = repeat % len(configs)
                for config in [*configs[shift:], *configs[:shift]]:
                    yield repeat, group, count, config
