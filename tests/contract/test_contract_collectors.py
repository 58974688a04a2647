"""Contract: TorchRL's multi-process collectors over a batched env give the same data whether
each collector worker builds an upstream ``ParallelEnv`` or a ``ManagedParallelEnv``.

Each collector worker builds a 2-worker batched env of 3-step, noise-free episodes and runs a
constant policy, so every batch is a known function of the frames collected; only the
trajectory ids, drawn from a pool the collector workers share, depend on timing: their
values are left out, their keys and how many there are per batch are compared.

Start methods (these tests start three levels of processes, the most expensive of the suite):
the collector workers use the process-wide start method (TorchRL sets spawn when none is
set). Both collectors run with "fork": the collector worker is a copy of this process (with
its registry of open envs). The multi-sync one also runs with "spawn", TorchRL's default and
the path where the env factory is pickled to the collector worker; the multi-async collector
builds its workers' envs the same way, so its spawn case (~10-20 s on 2 cores) would cover
nothing new. "forkserver" is left out: for the collector workers it is spawn's pickling path
again. The env workers inside the collector workers are forked: the start methods of env
workers have their own tests in test_contract.py, and spawning them here too would cost 4
more torch imports per variant and case.
"""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any

import pytest

from tests.collector_scenarios import collector_classes
from tests.contract.envs import make_constant_policy, make_parallel_counting_env
from tests.contract.helpers import UPSTREAM, Record, Variant, assert_same_as_upstream, run_variants

COLLECTORS = collector_classes()  # 0.14 names, 0.10 names as fallback
ENV_WORKER_START_METHOD = "fork"
TOTAL_FRAMES = 48

pytestmark = [
    pytest.mark.filterwarnings("ignore:The env passed to"),
    pytest.mark.timeout(150),
]


def collect(variant: Variant, kind: str, frames_per_batch: int) -> list[Any]:
    env_fn = functools.partial(
        make_parallel_counting_env, variant.cls, ENV_WORKER_START_METHOD, **variant.kwargs
    )
    collector = COLLECTORS[kind](
        [env_fn, env_fn], make_constant_policy(), frames_per_batch=frames_per_batch, total_frames=TOTAL_FRAMES
    )
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
        for proc in getattr(collector, "procs", []):  # TorchRL 0.10's shutdown() does not join
            proc.join(timeout=30)


def describe(batches: list[Any]) -> list[Any]:
    """Per batch: its data without the timing-dependent trajectory ids, all its keys, and
    how many trajectories it holds."""
    return [
        (
            batch.exclude("collector"),
            sorted(map(str, batch.keys(True, True))),
            batch["collector", "traj_ids"].unique().numel(),
        )
        for batch in batches
    ]


def check_upstream(records: dict[str, Record], batches: int) -> None:
    data = records[UPSTREAM.name].steps["batches"]
    assert isinstance(data, list) and len(data) == batches, data
    assert sum(td.numel() for td, _, _ in data) == TOTAL_FRAMES
    for td, _, trajectories in data:
        # Noise-free 3-step episodes under a constant action: steps 1, 2, 3, 1, 2, 3 everywhere.
        assert td["next", "step"].flatten().tolist() == [1, 2, 3] * (td.numel() // 3)
        assert trajectories == td.numel() // 3


@pytest.mark.compat
@pytest.mark.parametrize("collector_start_method", ["fork", "spawn"])
def test_multi_sync_collector(collector_start_method: str, restore_start_method: None) -> None:
    """Each batch holds both collector workers' frames (2 x 2 envs x 6 steps): upstream's."""
    multiprocessing.set_start_method(collector_start_method, force=True)

    def scenario(variant: Variant, rec: Record) -> None:
        rec("batches", lambda: collect(variant, "multisync", 24), describe=describe)

    records = run_variants(scenario)
    check_upstream(records, batches=2)
    assert_same_as_upstream(records)


@pytest.mark.compat
@pytest.mark.parametrize("collector_start_method", ["fork"])
def test_multi_async_collector(collector_start_method: str, restore_start_method: None) -> None:
    """Each batch holds one collector worker's frames (2 envs x 6 steps), in arrival order;
    all batches are alike, so the order does not matter: upstream's."""
    multiprocessing.set_start_method(collector_start_method, force=True)

    def scenario(variant: Variant, rec: Record) -> None:
        rec("batches", lambda: collect(variant, "multiasync", 12), describe=describe)

    records = run_variants(scenario)
    check_upstream(records, batches=4)
    assert_same_as_upstream(records)
