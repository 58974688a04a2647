"""Contract: the managed step path (``_step_path``) gives upstream's outputs bit for bit.

The same scenario runs on upstream ``ParallelEnv`` and on ``ManagedParallelEnv`` (see
``helpers.py``): the collector's ``step_and_maybe_reset`` loop with uneven episodes (workers
reset inside the step, at different times), partial steps (a ``_step`` mask), plain steps,
partial resets, on an env whose outputs span float32, float64, uint8, int32 and bool leaves,
nested keys included. Every key, dtype, shape and value is compared, and the key order too.
On TorchRL >= 0.11 the managed env must really have run its own path (``step_path``); on 0.10
(``compat``) the same scenario proves TorchRL's path, which it runs there, unchanged.
"""

from __future__ import annotations

import ast
import functools
import inspect
from typing import Any

import pytest
import torch

from tests.conftest import START_METHODS
from tests.contract.envs import make_dtypes_env, make_hetero_agents_env
from tests.contract.helpers import (
    HAS_DAEMON,
    UPSTREAM,
    Record,
    Variant,
    assert_same_as_upstream,
    closing,
    managed_class,
    run_variants,
)
from torchrl_ext import ManagedParallelEnv, _step_path

pytestmark = [pytest.mark.timeout(240)]

UNEVEN = [{"max_steps": 3}, {"max_steps": 5}]
#: TorchRL >= 0.11 (shared done flags): the managed env runs its own step path.
MANAGED_PATH = HAS_DAEMON


def _keys(td: Any) -> list[str]:
    return [str(k) for k in td.keys(True, True)]


def _seeded_steps(env: Any, rec: Record, seed: int, steps: int) -> list[tuple[Any, Any]]:
    """Seed, reset and ``step_and_maybe_reset`` ``steps`` times on random actions, recording
    the reset and each step; each step's ``(data, root)``."""
    env.set_seed(seed)
    torch.manual_seed(0)
    root = rec("reset", env.reset)
    out = []
    for i in range(steps):
        data, root = env.step_and_maybe_reset(env.rand_action(root))
        rec.value(f"step {i}", (data, root))
        out.append((data, root))
    return out


def _loop(env: Any, rec: Record, paths: list[Any]) -> None:
    stepped = _seeded_steps(env, rec, seed=3, steps=9)
    for i, (data, root) in enumerate(stepped):
        rec.value(f"step {i} keys", (_keys(data), _keys(root)))
        rec.value(f"step {i} devices", (str(data.device), str(root.device), str(data["next"].device)))
    root = stepped[-1][1]
    paths.append(env.step_path if isinstance(env, ManagedParallelEnv) else None)
    # a partial step: worker 1 only (TorchRL's path on both sides of the parent)
    partial = env.rand_action(root).set("_step", torch.tensor([False, True]))
    data, root = env.step_and_maybe_reset(partial)
    rec.value("partial step", (data, root))
    # back on the full step after it
    data, root = env.step_and_maybe_reset(env.rand_action(root.exclude("_step")))
    rec.value("step after the partial step", (data, root))
    rec("plain step", lambda: env.rand_step(root.clone()))
    rec("partial reset", lambda: env.reset(root.clone().set("_reset", torch.tensor([[True], [False]]))))
    rec("rollout", lambda: env.rollout(7, break_when_any_done=False))


def _same_as_upstream(mp_start_method: str) -> list[Any]:
    """Run the loop on upstream and ours, assert they agree; each side's ``step_path``."""
    paths: list[Any] = []

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(
            2, functools.partial(make_dtypes_env), create_env_kwargs=UNEVEN, mp_start_method=mp_start_method
        )
        with closing(env):
            _loop(env, rec, paths)

    assert_same_as_upstream(run_variants(scenario))
    return paths


@pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
@pytest.mark.compat
def test_step_path_outputs_are_upstreams(mp_start_method: str) -> None:
    upstream_path, managed_path = _same_as_upstream(mp_start_method)
    assert upstream_path is None
    if managed_path is None:  # TORCHRL_EXT_CONTRACT_REFERENCE: upstream against itself
        return
    if MANAGED_PATH:
        assert managed_path == ("managed", "tensor-only CPU specs in shared buffers")
    else:
        assert managed_path[0] == "torchrl"


@pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
@pytest.mark.compat
def test_lazily_stacked_entries_in_the_buffers_run_torchrls_step_path(mp_start_method: str) -> None:
    """An env whose own specs stack different ``Composite``s (two agents, observations of
    different sizes): TorchRL's shared buffers hold a ``LazyStackedTensorDict``, which the
    planned copies do not serve. Both sides leave it to TorchRL's path (before, the workers'
    check read it whole and died at start), and the data is upstream's."""
    paths: list[Any] = []

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, functools.partial(make_hetero_agents_env), mp_start_method=mp_start_method)
        with closing(env):
            _seeded_steps(env, rec, seed=5, steps=4)
            rec("rollout", lambda: env.rollout(5, break_when_any_done=False))
            paths.append(env.step_path if isinstance(env, ManagedParallelEnv) else None)

    assert_same_as_upstream(run_variants(scenario))
    managed_path = paths[1]
    if managed_path is not None and MANAGED_PATH:  # None: upstream against itself
        assert managed_path == (
            "torchrl",
            "the shared buffers hold a LazyStackedTensorDict under 'agents' "
            "(only CPU tensors in plain TensorDicts are planned)",
        )


@pytest.mark.parametrize("mp_start_method", ["default", "fork"])
def test_torchrl_s_step_path_chosen_by_the_environment_gives_upstreams_outputs(
    mp_start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TORCHRL_EXT_STEP_PATH=torchrl``: the managed env says it runs TorchRL's path, and
    its outputs are still upstream's (the fallback the guarantee suites also run on)."""
    monkeypatch.setenv(_step_path.STEP_PATH_VAR, "torchrl")
    paths = _same_as_upstream(mp_start_method)
    if paths[1] is not None:  # None: TORCHRL_EXT_CONTRACT_REFERENCE (upstream against itself)
        assert paths[1] == ("torchrl", "TORCHRL_EXT_STEP_PATH=torchrl is set")


@pytest.mark.parametrize("mp_start_method", ["default", "fork"])
def test_a_step_path_switch_that_does_not_parse_is_refused_at_the_start(
    mp_start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_step_path.STEP_PATH_VAR, "fast")
    kwargs = {} if mp_start_method == "default" else {"mp_start_method": mp_start_method}
    env = ManagedParallelEnv(1, functools.partial(make_dtypes_env), **kwargs)
    try:
        with pytest.raises(ValueError, match="TORCHRL_EXT_STEP_PATH='fast': set it to 'torchrl'"):
            env.reset()
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_the_step_paths_tensordict_internals_are_declared_and_exist() -> None:
    """Each tensordict private the step path uses exists on the installed tensordict, and the
    module uses none that its inventory does not declare."""
    import tensordict

    plain = tensordict.TensorDict({}, batch_size=[])
    declared = set()
    for dotted in _step_path.TENSORDICT_PRIVATES:
        owner, _, name = dotted.partition(".")
        where = plain if owner == "TensorDict" else getattr(tensordict, owner)
        assert hasattr(where, name), f"tensordict {tensordict.__version__} has no {dotted}"
        declared.add(name)
    tree = ast.parse(inspect.getsource(_step_path))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    privates = {
        name for name in used if name.startswith("_") and not name.startswith("__") and hasattr(plain, name)
    }
    assert privates == declared


@pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
def test_envs_sharing_a_worker_process_give_upstreams_outputs(mp_start_method: str) -> None:
    """``envs_per_worker=2`` with 3 envs: slots 0 and 1 in one process (stepped on one
    message), slot 2 alone; the collector's loop, a partial step, a partial reset and a rollout
    give upstream's data bit for bit (the env draws nothing from torch's global RNG)."""
    paths: list[Any] = []
    managed = managed_class()
    extra = {"envs_per_worker": 2} if managed is ManagedParallelEnv else {}
    uneven = [{"max_steps": 3}, {"max_steps": 5}, {"max_steps": 4}]

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(
            3, functools.partial(make_dtypes_env), create_env_kwargs=uneven, mp_start_method=mp_start_method
        )
        with closing(env):
            stepped = _seeded_steps(env, rec, seed=3, steps=9)
            root = stepped[-1][1]
            if isinstance(env, ManagedParallelEnv):
                pids = env.worker_pids
                paths.append((env.step_path, pids[0] == pids[1] != pids[2]))
            partial = env.rand_action(root).set("_step", torch.tensor([False, True, True]))
            rec.value("partial step", env.step_and_maybe_reset(partial))
            rec(
                "partial reset",
                lambda: env.reset(root.clone().set("_reset", torch.tensor([[True], [False], [True]]))),
            )
            rec("rollout", lambda: env.rollout(7, break_when_any_done=False))

    assert_same_as_upstream(run_variants(scenario, [UPSTREAM, Variant("managed", managed, extra)]))
    if extra:
        ((path, shared),) = paths
        assert shared and path == ("managed", "tensor-only CPU specs in shared buffers")
