"""The demo's last part: upstream ``ParallelEnv`` and ``ManagedParallelEnv`` side by side on
the same env, each on its own default start path: the start time, and what a SIGKILL of one
worker leaves behind (the dead worker's DataLoader workers, 3 s later). Whatever upstream leaves
is ended here, so that the demo itself leaves nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psutil
from torchrl.envs import ParallelEnv

from torchrl_ext import ManagedParallelEnv

#: Seconds after the kill at which the dead worker's children are counted.
LINGER = 3.0


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def _semaphores() -> set[str]:
    """Named multiprocessing semaphores in /dev/shm (spawn and forkserver queues make them)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}
    except OSError:
        return set()


def _trial(cls: type[Any], make_env: Callable[[], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    before = _semaphores()
    t = time.perf_counter()
    env = cls(2, make_env, **kwargs)
    td = env.reset()
    start_s = time.perf_counter() - t
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
    with contextlib.suppress(Exception):
        env.close()
    del env
    semaphores = len(_semaphores() - before)  # what is still there (the tracker removes it at exit)
    for proc in left:  # upstream leaves them: end them, so that the demo leaves nothing
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    return {
        "start_s": start_s,
        "error": error,
        "children": len(children),
        "left": len(left),
        "semaphores": semaphores,
    }


def compare_with_upstream(make_env: Callable[[], Any], managed_kwargs: dict[str, Any]) -> None:
    """Print the side-by-side table (upstream with its own defaults: daemon=False and spawn on
    TorchRL >= 0.11)."""
    print("\nupstream ParallelEnv vs ManagedParallelEnv, same env, 2 workers, default start paths:")
    up = _trial(ParallelEnv, make_env, {})
    ours = _trial(ManagedParallelEnv, make_env, dict(managed_kwargs, daemon_workers=False))
    rows = [
        ("start (build + first reset), s", f"{up['start_s']:.1f}", f"{ours['start_s']:.1f}"),
        ("a worker SIGKILLed: the next call raises", up["error"], ours["error"]),
        (
            f"  its DataLoader workers alive {LINGER:g} s later",
            f"{up['left']} of {up['children']}",
            f"{ours['left']} of {ours['children']}",
        ),
        ("  named semaphores left in /dev/shm after close()", str(up["semaphores"]), str(ours["semaphores"])),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"  {'':<{width}}  {'upstream':<20} managed")
    for label, a, b in rows:
        print(f"  {label:<{width}}  {a:<20} {b}")
