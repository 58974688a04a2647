"""``python -m torchrl_ext status``: every managed env on this machine, per worker."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import child_env, kill_tree, start_kwargs
from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, _forkserver
from torchrl_ext._status import as_json, read_envs


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrl_ext", "status", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _mine(envs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [env for env in envs if env["owner_pid"] == os.getpid()]


def _listed(expected_pids: list[int], restarts: list[int] | None = None, **expect: Any) -> Any:
    """Poll the status (what ``status --json`` prints) until this process's one env lists
    ``expected_pids`` (with ``restarts``, per slot, if given; and, for every worker, the
    ``expect`` fields); return that env."""

    def check() -> Any:
        (env,) = _mine(json.loads(as_json(read_envs()))) or [None]  # what `status --json` prints
        if env is None or [w["pid"] for w in env["workers"]] != expected_pids:
            return None
        if restarts is not None and [w["restarts"] for w in env["workers"]] != restarts:
            return None
        if any(w[key] != value for w in env["workers"] for key, value in expect.items()):
            return None
        return env

    return wait_until(check, f"status lists workers {expected_pids} with {expect}")


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_status_lists_each_worker_with_its_tree_and_restarts(method: str) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", dl_context="fork"),
        daemon_workers=False,
        max_restarts=1,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        listed = _listed(env.worker_pids, children=2)
        assert listed["label"].startswith("ManagedParallelEnv[") and "pytest" in listed["command"]
        for slot, worker in enumerate(listed["workers"]):
            assert worker["slot"] == slot and worker["state"] != "gone" and worker["restarts"] == 0
            assert worker["tree_rss"] > 0 and worker["cpu_percent"] >= 0
        proc = _status("--json")  # the command itself, once
        assert proc.returncode == 0 and _mine(json.loads(proc.stdout)), proc.stderr
        text = _status().stdout
        assert "RESTARTS" in text and all(str(pid) in text for pid in env.worker_pids), text
        # NOTE [zygote]: the server's kind, next to its owner (none on the fork path).
        kind, fallback = _forkserver.server_kind()
        server = None if method == "fork" else kind if fallback is None else f"{kind} ({fallback})"
        assert listed["server"] == server, listed
        assert (f"[fork server: {server}]" in text) == (server is not None), text
        assert env.stats().get("server_zygote") == (None if server is None else int(kind == "zygote"))
        victim = env.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        env.step(env.rand_action(td))
        assert victim not in env.worker_pids
        # The new pid is published as soon as the replacement is installed, its restart once the
        # replacement is seeded and recorded: the next publish (about a second later) lists both.
        _listed(env.worker_pids, restarts=[0, 1])
    finally:
        env.close(raise_if_closed=False)
    assert not _mine(json.loads(as_json(read_envs()))), "the closed env is gone from status"


@pytest.mark.parametrize("method", ["preloaded", "fork"])
def test_stats_and_status_show_each_trees_unique_memory(method: str) -> None:
    """What ``recycle_memory`` counts, the tree's USS (per process, the pages no other process
    maps), is in ``stats()`` per worker and in all, and in ``status`` per worker: a worker that
    holds 32 MiB of its own and runs a subprocess shows at least both, and less than its RSS
    (torch's libraries, which other processes map too)."""
    hold = 32 << 20
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, hold_mb=32, subprocess_kind="plain"),
        daemon_workers=False,
        **start_kwargs(method),
    )
    try:
        env.reset()
        children = [psutil.Process(pid).children() for pid in env.worker_pids]
        assert [len(c) for c in children] == [1, 1]
        floor = [hold + c[0].memory_full_info().uss for c in children]

        def sampled() -> Any:
            s = env.stats(workers="both")
            uss = [s.get(f"worker_{i}/uss_bytes", math.nan) for i in range(2)]
            return s["descendants"] == 2 and all(u >= f for u, f in zip(uss, floor, strict=True)) and s

        # USS is read with PSS (every 10 s while stats() is read): poll for a sample of the envs.
        stats = wait_until(sampled, "a sample of both trees' USS", timeout=90)
        for slot in range(2):
            prefix = f"worker_{slot}/"
            assert stats[prefix + "uss_bytes"] <= stats[prefix + "pss_bytes"] < stats[prefix + "rss_bytes"]
        assert stats["tree_uss_bytes"] == sum(stats[f"worker_{i}/uss_bytes"] for i in range(2))
        listed = _listed(env.worker_pids, children=1)
        for worker, least in zip(listed["workers"], floor, strict=True):
            assert least <= worker["tree_uss"] < worker["tree_rss"]
        text = _status().stdout
        assert "TREE USS" in text and all(str(pid) in text for pid in env.worker_pids), text
    finally:
        env.close()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_repeats_until_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "watch.txt"
    with out.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchrl_ext", "status", "--watch", "0.2"],
            env=child_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            # As from a terminal, whatever started the test run: a shell's background job
            # passes SIGINT on ignored, and Python then raises no KeyboardInterrupt.
            preexec_fn=_sigint_default,
        )
    try:
        wait_until(lambda: out.read_text().count("every 0.2s") >= 2, "two frames of status --watch")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
