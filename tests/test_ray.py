"""TorchRL's RayCollector whose remote collectors each build a ManagedParallelEnv.

Nesting: Ray actor (a remote ``Collector``) -> ManagedParallelEnv workers -> DataLoader
workers (forked, found through ``pid_dir`` files) and a ``setsid`` simulator per worker (an
escapee outside the worker's process group, found through its ``TORCHRL_EXT_OWNER`` tag,
whose owner is the actor process). Each test starts and stops its own local Ray instance:
Ray's processes are descendants of the test process and must be gone afterwards.

Ray kills a worker's direct children when it kills the worker (its
``kill_child_processes_on_worker_exit`` setting, on by default). Our external reaper runs
behind a shim, so it is not one of them: the tests run Ray with its default settings, and one
test with that setting switched off.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

ray = pytest.importorskip("ray", reason="needs the optional Ray extra: pip install 'torchrl-ext[ray]'")

from tests.collector_scenarios import check_toy_batch, make_managed_env, make_policy  # noqa: E402
from tests.conftest import ROOT, pid_alive  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from torchrl_ext._sweep import leftover_processes  # noqa: E402
from torchrl_ext._tag import read_tag  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore:The policy is not an nn.Module"),
    pytest.mark.filterwarnings("ignore:RayCollector iteration started before weight synchronization"),
    pytest.mark.filterwarnings("ignore:The env passed to Collector is missing transforms"),
]

KILL_CHILDREN_VAR = "RAY_kill_child_processes_on_worker_exit"
DEADLINE = 10.0  # the guarantee is ~2 s; slack for a loaded 2-core machine
#: How long a test's teardown waits for Ray's processes after ``ray.shutdown()``.
RAY_EXIT = 60.0
REMOTE = {"num_cpus": 1, "num_gpus": 0, "memory": 512 * 1024**2}


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A local Ray instance (2 CPUs) with Ray's default settings."""
    monkeypatch.delenv(KILL_CHILDREN_VAR, raising=False)
    ours_before = {p.pid for p in psutil.Process().children()}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _wait_for_ray_to_exit(ours_before)


def _wait_for_ray_to_exit(ours_before: set[int]) -> None:
    """Wait for every process Ray started to exit, then reap those re-parented to us.

    Once this process is a child subreaper (any ManagedParallelEnv started here makes it
    one), Ray's orphaned workers are re-parented here and stay zombies until reaped.
    """
    try:
        wait_until(lambda: not leftover_processes(), "every process Ray started exited", timeout=RAY_EXIT)
    finally:
        mp_children = {p.pid for p in multiprocessing.active_children()}
        for child in psutil.Process().children():
            if child.pid in ours_before or child.pid in mp_children:
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass


def _tagged_by_owner() -> dict[int, set[int]]:
    """Live processes carrying a TORCHRL_EXT_OWNER tag, by owner pid."""
    found: dict[int, set[int]] = {}
    for proc in psutil.process_iter():
        tag, _worker = read_tag(proc)
        if tag is not None and pid_alive(proc.pid):
            found.setdefault(tag.owner_pid, set()).add(proc.pid)
    return found


def _pid_files(pid_dir: Path) -> dict[str, set[int]]:
    """``{"env_workers", "dl", "sim"}`` pids recorded by the ToyEnvs (``WHAT-WORKERPID-PID``)."""
    out: dict[str, set[int]] = {"env_workers": set(), "dl": set(), "sim": set()}
    for path in pid_dir.glob("*-*-*"):
        what, worker, pid = path.name.split("-")
        out["env_workers"].add(int(worker))
        out.setdefault(what, set()).add(int(pid))
    return out


def _wait_gone(pids: set[int], timeout: float = DEADLINE) -> None:
    wait_until(lambda: not [p for p in pids if pid_alive(p)], f"{sorted(pids)} are all gone", timeout=timeout)


def _actor_pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())))


def _ray_collector(pid_dir: Path, sync: bool, simulator: str | None, frames: int = 40) -> Any:
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    env_fn = functools.partial(
        make_managed_env, num_workers=2, pid_dir=str(pid_dir), subprocess_kind=simulator
    )
    return RayCollector(
        [env_fn, env_fn],
        policy_factory=make_policy,
        collector_class=Collector,
        frames_per_batch=frames,
        total_frames=10**9,
        remote_configs=REMOTE,
        sync=sync,
    )


def test_ray_batches_are_correct_and_shutdown_leaves_nothing(ray_cluster: None, tmp_path: Path) -> None:
    collector = _ray_collector(tmp_path, sync=True, simulator=None)
    batches = []
    for batch in collector:  # not list(): RayCollector.__len__ fails in TorchRL 0.14
        batches.append(batch)
        if len(batches) == 3:
            break
    recorded = _pid_files(tmp_path)
    collector.shutdown()  # ray.kill() of every remote collector
    # sync=True stacks [collector, env, time]; 3 batches of 10 steps = episodes 0..5 per env.
    assert [tuple(b.shape) for b in batches] == [(2, 2, 10)] * 3
    assert check_toy_batch(torch.cat(batches, dim=-1), first=True) == 2 * 2 * 5
    assert len(recorded["env_workers"]) == 4 and len(recorded["dl"]) == 8
    _wait_gone(recorded["env_workers"] | recorded["dl"])


def test_ray_kill_of_one_collector_actor_ends_its_env_tree_only(ray_cluster: None, tmp_path: Path) -> None:
    collector = _ray_collector(tmp_path, sync=False, simulator="setsid", frames=20)
    try:
        it = iter(collector)
        for _ in range(4):
            check_toy_batch(next(it))
        victim, survivor = collector.remote_collectors
        victim_pid, survivor_pid = _actor_pid(victim), _actor_pid(survivor)
        tagged = _tagged_by_owner()
        assert len(tagged.get(victim_pid, ())) == 2 and len(tagged.get(survivor_pid, ())) == 2
        recorded = _pid_files(tmp_path)
        tree = {pid: psutil.Process(pid).ppid() for pid in recorded["env_workers"]}
        victim_workers = {w for w, parent in tree.items() if parent == victim_pid}
        assert len(victim_workers) == 2
        victim_tree = victim_workers | {
            int(p.name.split("-")[2]) for w in victim_workers for p in tmp_path.glob(f"*-{w}-*")
        }
        assert tagged[victim_pid] <= victim_tree and len(victim_tree) == 2 + 2 * 2 + 2
        rest = (recorded["env_workers"] | recorded["dl"] | recorded["sim"]) - victim_tree

        ray.kill(victim)
        _wait_gone(victim_tree | {victim_pid})
        assert all(pid_alive(pid) for pid in rest | {survivor_pid}), "the other actor's env was touched"
    finally:
        collector.shutdown()
    _wait_gone(rest)
    assert not _tagged_by_owner().get(survivor_pid)


def test_ray_shutdown_with_live_collectors_leaves_nothing(ray_cluster: None, tmp_path: Path) -> None:
    collector = _ray_collector(tmp_path, sync=False, simulator="setsid", frames=20)
    it = iter(collector)
    for _ in range(2):
        check_toy_batch(next(it))
    owners = {_actor_pid(actor) for actor in collector.remote_collectors}
    recorded = _pid_files(tmp_path)
    tagged = set().union(*(_tagged_by_owner().get(owner, set()) for owner in owners))
    assert len(tagged) == 4 and len(recorded["dl"]) == 8

    ray.shutdown()
    _wait_gone(owners | tagged | recorded["env_workers"] | recorded["dl"] | recorded["sim"])
    assert not [p for owner in owners for p in _tagged_by_owner().get(owner, ())]
    # Ray's own processes (GCS, raylet, agents, workers) are gone too.
    wait_until(lambda: not leftover_processes(), "Ray's own processes exited", timeout=DEADLINE)
    del it, collector


def test_ray_kill_with_child_killing_off_ends_escapees(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RAY_kill_child_processes_on_worker_exit=0`` (the setting older docs asked for): Ray
    leaves the killed actor's children alone; the reaper still ends the whole env tree."""
    ray.shutdown()
    monkeypatch.setenv(KILL_CHILDREN_VAR, "0")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    env_fn = functools.partial(
        make_managed_env, num_workers=1, pid_dir=str(tmp_path), subprocess_kind="setsid"
    )
    collector = RayCollector(
        [env_fn],
        policy_factory=make_policy,
        collector_class=Collector,
        frames_per_batch=10,
        total_frames=10**9,
        remote_configs=REMOTE,
    )
    sims: set[int] = set()
    try:
        check_toy_batch(next(iter(collector)))
        (actor,) = collector.remote_collectors
        sims = _tagged_by_owner().get(_actor_pid(actor), set())
        assert len(sims) == 1
        collector.shutdown()  # ray.kill()
        _wait_gone(sims, timeout=5.0)
    finally:
        for pid in sims:
            if pid_alive(pid):
                psutil.Process(pid).kill()
        _wait_gone(sims)


def test_example_quick_mode_runs_and_leaves_nothing(tmp_path: Path) -> None:
    """``examples/ray_scale_out.py --quick`` (what CI runs), under the subreaper harness."""
    out = tmp_path / "harness.json"
    cmd = [sys.executable, str(ROOT / "tests" / "harness.py"), str(out), "10", "--"]
    cmd += [sys.executable, str(ROOT / "examples" / "ray_scale_out.py"), "--quick"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    result = json.loads(out.read_text())
    assert result["returncode"] == 0, done.stdout + done.stderr
    assert "done: 60 frames" in done.stdout, done.stdout
    assert not result["leaked"], result["leaked"]
