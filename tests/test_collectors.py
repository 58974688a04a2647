"""TorchRL collectors whose env (or whose workers' env) is a ManagedParallelEnv.

Every env worker holds a ``DataLoader(num_workers=2)`` used in ``reset()``. Checked: the
observations of collected batches, that ``shutdown()`` leaves nothing (the autouse leak
fixture), that SIGKILL of the training process leaves nothing three levels down (main ->
collector worker -> env worker -> DataLoader worker), and that building the env inside a
daemonic TorchRL process surfaces :class:`DaemonicParentError`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from tests.collector_scenarios import check_toy_batch, collector_classes, make_managed_env, make_policy
from tests.conftest import Scenario, ScenarioResult, pid_alive, wait_until
from torchrl_ext import DaemonicParentError
from torchrl_ext._compat import HAS_DAEMON_KWARG

COLLECTORS = collector_classes()
NEW_COLLECTORS = COLLECTORS["single"].__name__ == "Collector"  # TorchRL 0.14 names (0.10: SyncDataCollector)
pytestmark = pytest.mark.filterwarnings("ignore:The env passed to Collector is missing transforms")
LINGER = 10.0  # spawn collector workers (TorchRL's) exit ~4 s after main; then their env trees go


def _pids(pid_dir: Path, prefix: str) -> set[int]:
    return {int(p.read_text()) for p in pid_dir.glob(f"{prefix}-*")}


# --------------------------------------------------------------------------- one process
@pytest.mark.compat
def test_single_process_collector_batches_and_shutdown() -> None:
    env = make_managed_env(num_workers=2, loader="per_reset")  # a new DataLoader per reset
    collector = COLLECTORS["single"](env, make_policy(), frames_per_batch=20, total_frames=60)
    batches = list(collector)
    collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(2, 10)] * 3
    # One trajectory per env over the three batches: episodes 0..5, each 5 steps.
    assert check_toy_batch(torch.cat(batches, dim=-1), first=True) == 2 * 5
    assert env.is_closed
    report = env.supervision_report
    assert report is not None and report.clean, str(report)


# --------------------------------------------------------------------------- multi-process
@pytest.mark.compat
@pytest.mark.parametrize("kind", ["multisync", "multiasync"])
def test_multi_collector_workers_build_managed_envs(
    kind: str, tmp_path: Path, restore_start_method: None
) -> None:
    """Each collector worker (TorchRL's default start method: spawn) builds a ManagedParallelEnv
    of 2 forked workers, each holding 2 DataLoader workers."""
    env_fn = functools.partial(make_managed_env, num_workers=2, loader="persistent", pid_dir=str(tmp_path))
    collector = COLLECTORS[kind]([env_fn, env_fn], make_policy(), frames_per_batch=40, total_frames=120)
    try:
        batches = list(collector)
        dl_workers = _pids(tmp_path, "dl")
        assert len(dl_workers) == 2 * 2 * 2, "2 collector workers x 2 env workers x 2 DataLoader workers"
        assert all(pid_alive(pid) for pid in dl_workers)
    finally:
        collector.shutdown()
        for proc in collector.procs:  # TorchRL 0.10's shutdown() leaves them as zombies
            proc.join(timeout=10)
    assert sum(b.numel() for b in batches) == 120
    for batch in batches:
        assert check_toy_batch(batch) >= 1
    if kind == "multisync":  # each batch holds both collectors' trajectories, in lockstep
        # 4 trajectories (2 collectors x 2 envs) of 30 steps: episodes 0..5 each.
        assert check_toy_batch(torch.cat(batches, dim=-1), first=True) == 4 * 5
    assert not [pid for pid in dl_workers if pid_alive(pid)]


# --------------------------------------------------------------------------- SIGKILL of main
@pytest.mark.compat
@pytest.mark.parametrize(
    ("kind", "method"),
    [
        ("multisync", "spawn"),
        ("multiasync", "spawn"),
        ("multisync", "fork"),
    ],
)
def test_sigkill_of_training_process_leaves_nothing(
    scenario: Scenario, kind: str, method: str, tmp_path: Path
) -> None:
    """main -> 2 collector workers -> 2 env workers each -> 2 DataLoader workers each. Collector
    workers started by spawn (TorchRL's default) exit when their pipe to main breaks and close
    their env; forked ones never see that on TorchRL 0.14 (they hold both ends of the pipe), so
    the env's parent watch (``exit_with_parent``) ends them. The env trees go with them."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    scenario.start(
        kind,
        "--collector-method",
        method,
        "--pid-dir",
        str(pid_dir),
        linger=LINGER,
        module="tests.collector_scenarios",
    )
    ready = scenario.wait_ready(timeout=240)
    wait_until(lambda: len(_pids(pid_dir, "dl")) >= 8, "every DataLoader worker started", timeout=60)
    env_workers = {int(p.name.split("-")[1]) for p in pid_dir.glob("dl-*")}
    assert len(env_workers) == 2 * 2
    scenario.wait_seen(set(ready["collector_workers"]) | env_workers | _pids(pid_dir, "dl"))
    os.kill(ready["pid"], signal.SIGKILL)
    result: ScenarioResult = scenario.finish(timeout=120)
    _reap_harness_orphans(result)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not result.leaked, f"processes outlived the training process by {LINGER}s: {result.leaked}"
    seen = {s["pid"] for s in result.seen_before_death}
    tree = set(ready["collector_workers"]) | env_workers | _pids(pid_dir, "dl")
    assert len(tree) == 2 + 4 + 8 and tree <= seen
    assert not [pid for pid in tree if pid_alive(pid)]


def _reap_harness_orphans(result: ScenarioResult, timeout: float = 30.0) -> None:
    """Reap processes of the scenario that end up as zombie children of this process.

    The harness counts a process whose main thread has exited (status Z) as gone, although
    its other threads may still be exiting; when the harness exits first, that process is
    re-parented here (this process is a child subreaper once any env was started here) and
    becomes our zombie when its last thread ends. Seen with TorchRL 0.10's forked workers.
    """
    pids = {int(info["pid"]) for info in result.seen_before_death}
    me = psutil.Process()

    def none_left() -> bool:
        ours = [child.pid for child in me.children() if child.pid in pids]
        for pid in ours:
            try:
                os.waitpid(pid, os.WNOHANG)  # only ever reaps a child of ours
            except ChildProcessError:
                pass
        return not [child for child in me.children() if child.pid in pids]

    wait_until(none_left, "processes of the scenario re-parented to this process were reaped", timeout)


# --------------------------------------------------------------------------- daemonic parents
def _chain(err: BaseException | None) -> str:
    out = []
    while err is not None:
        out.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n".join(out)


def _managed_inner(metadata_in_subprocess: bool | None) -> object:
    return make_managed_env(num_workers=1, loader="per_reset", metadata_in_subprocess=metadata_in_subprocess)


@pytest.mark.parametrize("metadata_in_subprocess", [False, None])
def test_async_batched_collector_env_workers_are_daemonic(metadata_in_subprocess: bool | None) -> None:
    """AsyncBatchedCollector's process env workers (ProcessSlotTransport) are daemonic: the
    user sees our error, wrapped by TorchRL's ``RuntimeError("An environment worker failed.")``."""
    from tensordict import TensorDict
    from torchrl.collectors import AsyncBatchedCollector
    from torchrl.modules.inference_server import ProcessSlotTransport

    request = TensorDict({"observation": torch.zeros(1, 4)}, batch_size=[1])
    response = TensorDict(
        {"action": torch.zeros(1, 1), "policy_version": torch.zeros(1, dtype=torch.long)}, batch_size=[1]
    )
    collector = AsyncBatchedCollector(
        [functools.partial(_managed_inner, metadata_in_subprocess)],
        policy_factory=make_policy,
        frames_per_batch=4,
        total_frames=8,
        transport=ProcessSlotTransport(request, response, num_slots=1),
    )
    try:
        with pytest.raises(RuntimeError) as info:
            next(iter(collector))
    finally:
        collector.shutdown()
    chain = _chain(info.value)
    assert "An environment worker failed" in chain
    assert DaemonicParentError.__name__ in chain, chain
    assert "non-daemonic" in chain and "daemon_workers=False" in chain, chain


@pytest.mark.skipif(not HAS_DAEMON_KWARG, reason="ParallelEnv(daemon=...) needs TorchRL >= 0.11")
def test_upstream_daemonic_parallel_env_shows_our_error_in_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """An upstream ``ParallelEnv(daemon=True)`` whose factory builds a ManagedParallelEnv: TorchRL
    raises its own "worker 0 dead" error; our message is in the dead worker's stderr."""
    from torchrl.envs import ParallelEnv

    outer = ParallelEnv(1, functools.partial(_managed_inner, False), daemon=True, mp_start_method="fork")
    try:
        with pytest.raises(RuntimeError, match=r"dead|failed"):
            outer.reset()
    finally:
        with contextlib.suppress(RuntimeError):  # TorchRL re-raises the dead worker here
            outer.close(raise_if_closed=False)
    err = capfd.readouterr().err
    assert f"{DaemonicParentError.__module__}.{DaemonicParentError.__name__}" in err, err[-2000:]
    assert "daemonic processes are not allowed to have children" in err
