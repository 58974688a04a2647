"""What both benchmarks need to know about the (shared) machine they run on."""

from __future__ import annotations

import contextlib
import time

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
