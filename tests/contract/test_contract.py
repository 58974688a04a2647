"""Contract: ``ManagedParallelEnv`` is a drop-in ``torchrl.envs.ParallelEnv``.

Each test is one public behaviour of ``ParallelEnv``. It runs the same scenario with
upstream ``ParallelEnv`` and with ``ManagedParallelEnv`` built exactly the same way (the
class is the only difference) and asserts that everything observable is identical, step by
step: tensor values, keys, specs, return values, exception types and messages (see
``helpers.py``). Each test also checks the upstream result itself where that is what makes
the comparison meaningful.

Every test is parametrized over the start method of the env workers: the default path
(``mp_start_method=None``: upstream's default, spawn on TorchRL >= 0.11, against the managed
default, the preloaded fork server, which is what the import swap alone gives), spawn,
forkserver and fork where the start method can change the outcome (what is pickled and how:
EnvCreator state, errors, children, views, close), forkserver and fork for the pure data paths
(the worker loop is the same code whatever started it; forkserver already sends everything
through the pickler exactly as spawn does, without spawn's seconds of torch import per worker).
Those whose behaviour also exists on TorchRL 0.10 are marked ``compat`` (features missing there
are skipped by a feature check, not a version string: 0.10 wheels report ``0.0.0+unknown``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs import EnvCreator, RemoveEmptySpecs, TrajCounter, TransformedEnv
from torchrl.envs.utils import step_mdp

from tests.conftest import START_METHODS
from tests.contract.envs import (
    make_child_in_reset_env,
    make_counting_env,
    make_empty_specs_env,
    make_failing_env,
    make_nested_env,
    make_slow_close_env,
    make_traj_counter_env,
    make_vecnorm_env,
)
from tests.contract.helpers import (
    HAS_DAEMON,
    HAS_METADATA_FROM_WORKERS,
    HAS_SHUTDOWN_TIMEOUT,
    HAS_VIEWS,
    UPSTREAM,
    Raised,
    Record,
    Variant,
    assert_same_as_upstream,
    close_quietly,
    closing,
    drop_traceback_frames,
    run_variants,
)

#: The start methods of a test about a pure data path (see the module doc).
DATA_PATH_METHODS = [m for m in START_METHODS if m != "spawn"]
#: ``"default"``: no ``mp_start_method`` at all, each class's default path (see the module doc
#: and ``Variant``).
every_start_method = pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
data_path_start_methods = pytest.mark.parametrize("mp_start_method", DATA_PATH_METHODS)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # VecNorm's first API (on purpose)
    pytest.mark.filterwarnings("ignore:VecNorm wasn't initialized"),
    pytest.mark.timeout(150),
]

#: Two workers whose episodes have different lengths, so that resets interleave.
UNEVEN = [{"max_steps": 3}, {"max_steps": 4}]


def counting(**kwargs: Any) -> functools.partial[Any]:
    return functools.partial(make_counting_env, **kwargs)


def rollout(env: Any, steps: int = 6, seed: int | None = None) -> Any:
    """``env.rollout`` with random actions drawn after ``torch.manual_seed(0)``; the envs
    are seeded with ``seed`` first unless it is ``None``."""
    if seed is not None:
        env.set_seed(seed)
    torch.manual_seed(0)
    return env.rollout(steps, break_when_any_done=False)


#: The ``step`` entry of the root after each call of :func:`step_and_maybe_reset_loop` on
#: ``UNEVEN`` workers: each worker is reset as soon as its episode ends.
LOOP_STEPS = [[1, 1], [2, 2], [0, 3], [1, 0], [2, 1], [0, 2], [1, 3]]
RESET_WORKER_0 = torch.tensor([[True], [False]])


def step_and_maybe_reset_loop(env: Any) -> list[Any]:
    """The collector's loop, 7 steps: (step data, next root) after each call."""
    env.set_seed(11)
    torch.manual_seed(0)
    root = env.reset()
    out = []
    for _ in range(7):
        data, root = env.step_and_maybe_reset(env.rand_action(root))
        out.append((data.clone(), root.clone()))
    return out


def two_steps(env: Any) -> Any:
    """Reset, then two random steps: the root for a third step."""
    env.set_seed(5)
    torch.manual_seed(0)
    td = env.reset()
    td = step_mdp(env.rand_step(td))
    return step_mdp(env.rand_step(td))


def check_partial_reset(before: Any, after: Any) -> None:
    """``after``: ``before`` with worker 0 reset (and worker 1 untouched)."""
    assert after["step"][:, 0].tolist() == [0, 2]
    assert torch.equal(after["observation"][1], before["observation"][1])
    assert not torch.equal(after["observation"][0], before["observation"][0])


def built(env: Any) -> str:
    """What a construction step records (the env object itself is not comparable)."""
    return "built"


def upstream(records: dict[str, Record], step: str) -> Any:
    value = records[UPSTREAM.name].steps[step]
    assert not isinstance(value, Raised), f"upstream step {step!r} {value}"
    return value


@every_start_method
# --------------------------------------------------------------------------- 1. views
@pytest.mark.skipif(not HAS_VIEWS, reason="this TorchRL has no indexed views of batched envs")
def test_indexed_views_share_workers_and_close_like_upstream(mp_start_method: str) -> None:
    """``env[0:1]`` and ``env[[0]]`` are views on worker 0 and give the same data; closing a
    view leaves the parent's workers alone (the parent keeps stepping and closes normally);
    a view used after its parent closed, or after it was closed, raises upstream's error."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), mp_start_method=mp_start_method)
        views: dict[str, Any] = {}

        def make_views() -> dict[str, Any]:
            views["[0:1]"] = env[0:1]
            views["[[0]]"] = env[[0]]
            views["[1]"] = env[1]
            return {k: (v.batch_size, v.observation_spec, v.action_spec) for k, v in views.items()}

        with closing(env):
            rec("parent rollout", lambda: rollout(env, 4, seed=1))
            rec("make views", make_views)
            rec("env[0:1] rollout", lambda: rollout(views["[0:1]"], 4, seed=5))
            rec("env[[0]] rollout", lambda: rollout(views["[[0]]"], 4, seed=5))
            rec("env[0:1].close()", lambda: views["[0:1]"].close())
            rec("env[0:1].is_closed", lambda: views["[0:1]"].is_closed)
            rec("parent is_closed after view close", lambda: env.is_closed)
            rec("parent rollout after view close", lambda: rollout(env, 4, seed=1))
            rec("closed view reset", lambda: views["[0:1]"].reset())
            rec("parent close", env.close)
            rec("env[1] reset after parent close", lambda: views["[1]"].reset())

    records = run_variants(scenario)
    # What upstream does, so that the comparison is about the right thing.
    first, second = upstream(records, "env[0:1] rollout"), upstream(records, "env[[0]] rollout")
    assert first.batch_size == torch.Size([1, 4])
    assert torch.equal(first["next", "observation"], second["next", "observation"])
    parent = upstream(records, "parent rollout")
    again = upstream(records, "parent rollout after view close")
    assert torch.equal(parent["next", "observation"], again["next", "observation"])
    assert "closed" in records["upstream"].steps["env[1] reset after parent close"].message
    assert_same_as_upstream(records)


@every_start_method
# --------------------------------------------------------------------------- 2. EnvCreator
@pytest.mark.compat
def test_env_creator_shared_vecnorm_statistics(mp_start_method: str) -> None:
    """Workers built from an ``EnvCreator`` update the ``VecNorm`` statistics that the
    EnvCreator holds in shared memory in the main process: both workers' updates arrive.

    What is compared is how many updates arrived, not the sums: two workers add to the same
    shared tensors with upstream's in-place ``+=``, which is not atomic, so under load one
    update can be lost, upstream's as ours (seen once in CI on 0.10.1: one reset observation
    missing from upstream's sums). Each worker makes 8 updates (6 steps + 2 resets: at the
    start and after step 3): more than 8 arrived means both workers' reached the main process.
    """

    def scenario(variant: Variant, rec: Record) -> None:
        creator = EnvCreator(functools.partial(make_vecnorm_env, max_steps=3))
        rec.value("statistics before", creator.state_dict())
        before = creator.state_dict()["_extra_state"]["observation_count"].item()
        env = variant(2, creator, mp_start_method=mp_start_method)
        rec.value(
            "statistics in shared memory after construction",
            [v.is_shared() for v in creator.state_dict()["_extra_state"].values()],
        )
        with closing(env):
            rec(
                "rollout keys and shape",
                lambda: (sorted(map(str, (r := rollout(env, 6, seed=0)).keys(True, True))), r.batch_size),
            )
        arrived = creator.state_dict()["_extra_state"]["observation_count"].item() - before
        seen = "none" if arrived == 0 else "both workers'" if 8 < arrived <= 16 else arrived
        rec.value("updates in the main process", seen)

    records = run_variants(scenario)
    # TorchRL 0.14 moves the statistics to shared memory when the env is built; 0.10 leaves
    # them private until they are pickled for a spawn or forkserver worker, so that forked
    # workers there update copies and the main process sees nothing.
    shared = all(upstream(records, "statistics in shared memory after construction"))
    expected = "both workers'" if shared or mp_start_method != "fork" else "none"
    assert upstream(records, "updates in the main process") == expected
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.compat
def test_env_creator_shared_traj_counter(mp_start_method: str) -> None:
    """A ``TrajCounter`` shared through an ``EnvCreator`` (an ``mp.Value``) numbers the
    trajectories of all workers from one counter, which the main process sees."""

    def scenario(variant: Variant, rec: Record) -> None:
        counter = TrajCounter()
        creator = EnvCreator(functools.partial(make_traj_counter_env, counter=counter, max_steps=3))
        rec.value("count before", counter.state_dict())
        env = variant(2, creator, mp_start_method=mp_start_method)

        def traj_counts() -> Any:
            out = rollout(env, 7, seed=0)
            # Which worker draws which number at a simultaneous reset is a race: sort over workers.
            return out["next", "traj_count"].sort(dim=0).values

        with closing(env):
            rec("traj_count per step (sorted over workers)", traj_counts)
        rec.value("count after", counter.state_dict())

    records = run_variants(scenario)
    counts = upstream(records, "traj_count per step (sorted over workers)")
    start = upstream(records, "count before")["traj_count"]
    # 3-step episodes: resets before steps 1, 4 and 7 draw 2 numbers each.
    expected = torch.tensor([[start, start + 2, start + 4], [start + 1, start + 3, start + 5]])
    assert torch.equal(counts[:, [0, 3, 6], 0], expected), counts
    assert upstream(records, "count after")["traj_count"] == start + 6
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 3. metadata_from_workers
@pytest.mark.skipif(not HAS_METADATA_FROM_WORKERS, reason="this TorchRL has no metadata_from_workers")
def test_metadata_from_workers_specs_and_rollout(mp_start_method: str) -> None:
    """With ``metadata_from_workers=True`` (and ``use_buffers=False``) the workers start at
    construction and report the specs; specs and data are upstream's."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = rec(
            "construct",
            lambda: variant(
                2,
                counting(),
                create_env_kwargs=UNEVEN,
                mp_start_method=mp_start_method,
                metadata_from_workers=True,
                use_buffers=False,
            ),
            describe=built,
        )
        with closing(env):
            rec("is_closed after construction", lambda: env.is_closed)
            rec("batch_size", lambda: env.batch_size)
            rec("output_spec", lambda: env.output_spec)
            rec("input_spec", lambda: env.input_spec)
            rec("rollout", lambda: rollout(env, 6, seed=2))

    records = run_variants(scenario)
    assert upstream(records, "is_closed after construction") is False
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.skipif(not HAS_METADATA_FROM_WORKERS, reason="this TorchRL has no metadata_from_workers")
def test_metadata_from_workers_factory_error(mp_start_method: str) -> None:
    """When the env factory raises in a worker during construction, the constructor raises
    upstream's exception: same type, same message (the worker's traceback it embeds is
    compared without its frame lines, which name files and lines)."""

    def scenario(variant: Variant, rec: Record) -> None:
        # Only worker 1 fails: upstream names the first failure it reads, so a single
        # failing factory would make the worker index in the message a race.
        env = rec(
            "construct",
            lambda: variant(
                2,
                [counting(), make_failing_env],
                mp_start_method=mp_start_method,
                metadata_from_workers=True,
                use_buffers=False,
            ),
            describe=built,
            message=drop_traceback_frames,
        )
        close_quietly(env)

    records = run_variants(scenario)
    error = records[UPSTREAM.name].steps["construct"]
    assert isinstance(error, Raised) and error.type == "builtins.RuntimeError", error
    assert "worker 1 failed during metadata construction" in error.message, error
    assert error.message.endswith("FactoryError: contract: the env factory failed on purpose"), error
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.skipif(not HAS_METADATA_FROM_WORKERS, reason="this TorchRL has no metadata_from_workers")
def test_metadata_from_workers_close_is_bounded_by_shutdown_timeout(mp_start_method: str) -> None:
    """TorchRL's own ``test_metadata_from_workers_shutdown_is_bounded``, as a contract: an env
    whose ``close()`` takes 10 s, ``shutdown_timeout=0.1``; when ``close()`` returns, every
    worker process it had is dead, as upstream's are."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(
            1,
            functools.partial(make_slow_close_env, close_delay=10.0),
            mp_start_method=mp_start_method,
            metadata_from_workers=True,
            use_buffers=False,
            shutdown_timeout=0.1,
        )
        workers = list(env._workers)
        rec("close", env.close)
        rec("workers alive after close", lambda: [worker.is_alive() for worker in workers])

    records = run_variants(scenario)
    assert upstream(records, "workers alive after close") == [False]
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 4. use_buffers
@pytest.mark.compat
def test_use_buffers_false_gives_upstream_data(mp_start_method: str) -> None:
    """With ``use_buffers=False`` the data goes through the pipes instead of shared buffers,
    through code paths of its own (for partial resets, the parent keeps the workers' last
    outputs): rollout, step_and_maybe_reset loop and a partial reset give upstream's data.
    ``use_buffers=True`` is what these envs (static specs) get by default: every other test
    of this file runs it, so it is not started a second time here (spawn costs 3-6 s/start)."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(
            2, counting(), create_env_kwargs=UNEVEN, mp_start_method=mp_start_method, use_buffers=False
        )
        with closing(env):
            rec("rollout", functools.partial(rollout, env, 7, 3))
            rec("step_and_maybe_reset loop", functools.partial(step_and_maybe_reset_loop, env))
            td = rec("two steps", functools.partial(two_steps, env))
            rec("reset worker 0", lambda: env.reset(td.clone().set("_reset", RESET_WORKER_0)))
            rec("step", lambda: env.rand_step(env.reset()))

    records = run_variants(scenario)
    data = upstream(records, "rollout")
    assert data.batch_size == torch.Size([2, 7])
    assert data["next", "done"].any(), "the rollout crosses episode ends"
    loop = upstream(records, "step_and_maybe_reset loop")
    assert [root["step"][:, 0].tolist() for _, root in loop] == LOOP_STEPS
    check_partial_reset(upstream(records, "two steps"), upstream(records, "reset worker 0"))
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 5. update_kwargs
@pytest.mark.compat
def test_update_kwargs_applies_at_next_start(mp_start_method: str) -> None:
    """``update_kwargs`` (a dict for all workers or one dict per worker) changes the kwargs
    the env factories get when the workers (re)start; a list of the wrong length raises."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), create_env_kwargs={"offset": 0.0}, mp_start_method=mp_start_method)
        with closing(env):
            rec("update_kwargs(dict) before start", lambda: env.update_kwargs({"offset": 10.0}))
            rec("rollout", lambda: rollout(env, 3, seed=4))
            rec("close", env.close)
            rec(
                "update_kwargs(list) while closed",
                lambda: env.update_kwargs([{"offset": 100.0}, {"offset": 200.0}]),
            )
            rec("rollout after restart", lambda: rollout(env, 3, seed=4))
            rec("update_kwargs(list of wrong length)", lambda: env.update_kwargs([{"offset": 1.0}]))

    records = run_variants(scenario)
    first = upstream(records, "rollout")["observation"][:, 0]
    second = upstream(records, "rollout after restart")["observation"][:, 0]
    assert ((first >= 10.0) & (first < 11.0)).all(), first
    assert ((second[0] >= 100.0) & (second[0] < 101.0)).all(), second
    assert ((second[1] >= 200.0) & (second[1] < 201.0)).all(), second
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 6. seeds, state dicts
@pytest.mark.compat
def test_set_seed_and_state_dict(mp_start_method: str) -> None:
    """``set_seed`` returns upstream's next seed and seeds the workers alike;
    ``state_dict()`` has upstream's keys and values; ``load_state_dict`` (one state for all
    workers, or one per worker) changes the workers as upstream's does."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), mp_start_method=mp_start_method)
        with closing(env):
            rec("set_seed(7)", lambda: env.set_seed(7))
            rec("set_seed(7, static_seed=True)", lambda: env.set_seed(7, static_seed=True))
            rec("rollout after set_seed(7)", lambda: rollout(env, 4, seed=7))
            rec("rollout after set_seed(8)", lambda: rollout(env, 4, seed=8))
            rec("state_dict", env.state_dict)
            rec("load_state_dict(one state)", lambda: env.load_state_dict({"scale": torch.tensor(2.0)}))
            rec("state_dict after one state", env.state_dict)
            per_worker = OrderedDict(
                worker0={"scale": torch.tensor(3.0)}, worker1={"scale": torch.tensor(-1.0)}
            )
            rec("load_state_dict(per worker)", lambda: env.load_state_dict(per_worker))
            rec("state_dict after per worker", env.state_dict)
            # No rollout after load_state_dict: on TorchRL 0.14.1 (use_buffers=True) the
            # worker's "load_state_dict" handler raises the shared done flag that the parent
            # never clears, so the next waits return one step early and read the buffers
            # while the workers write them: upstream's own data is then a race.

    records = run_variants(scenario)
    assert upstream(records, "set_seed(7, static_seed=True)") == 7
    seven, eight = (
        upstream(records, "rollout after set_seed(7)"),
        upstream(records, "rollout after set_seed(8)"),
    )
    assert not torch.equal(seven["observation"], eight["observation"])
    state = upstream(records, "state_dict after per worker")
    assert [state["worker0"]["scale"].item(), state["worker1"]["scale"].item()] == [3.0, -1.0]
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 7. step_and_maybe_reset
@pytest.mark.compat
def test_step_and_maybe_reset_loop(mp_start_method: str) -> None:
    """The collector's loop: ``step_and_maybe_reset`` returns upstream's step data and next
    root (with the finished workers reset)."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), create_env_kwargs=UNEVEN, mp_start_method=mp_start_method)
        with closing(env):
            rec("loop", functools.partial(step_and_maybe_reset_loop, env))

    records = run_variants(scenario)
    assert [root["step"][:, 0].tolist() for _, root in upstream(records, "loop")] == LOOP_STEPS
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 8. partial resets
@pytest.mark.compat
def test_partial_reset_of_one_worker(mp_start_method: str) -> None:
    """``reset`` with a ``_reset`` mask resets the selected worker only (the mask in the
    root of the next step, or alone in a TensorDict)."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), create_env_kwargs=UNEVEN, mp_start_method=mp_start_method)
        with closing(env):
            td = rec("two steps", functools.partial(two_steps, env))
            rec("reset worker 0", lambda: env.reset(td.clone().set("_reset", RESET_WORKER_0)))
            only_mask = TensorDict({"_reset": ~RESET_WORKER_0}, batch_size=[2])
            rec("reset worker 1 (mask only)", lambda: env.reset(only_mask))
            rec("step after partial resets", lambda: env.rand_step(env.reset()))

    records = run_variants(scenario)
    check_partial_reset(upstream(records, "two steps"), upstream(records, "reset worker 0"))
    assert_same_as_upstream(records)


@data_path_start_methods
# --------------------------------------------------------------------------- 9. nested and heterogeneous
@pytest.mark.compat
def test_nested_and_heterogeneous_specs(mp_start_method: str) -> None:
    """Two different envs (one factory each) with nested ``Composite`` observations and one
    key each of their own: the same (stacked) specs and the same lazily stacked data."""

    def scenario(variant: Variant, rec: Record) -> None:
        fns = [
            functools.partial(make_nested_env, extra_key="obs_a", extra_dim=2),
            functools.partial(make_nested_env, extra_key="obs_b", extra_dim=3),
        ]
        env = variant(2, fns, mp_start_method=mp_start_method)
        with closing(env):
            rec("output_spec", lambda: env.output_spec)
            rec("input_spec", lambda: env.input_spec)
            rec("reset", env.reset)
            rec("rollout", lambda: rollout(env, 4))

    records = run_variants(scenario)
    data = upstream(records, "rollout")
    assert ("next", "agent", "pos") in data.keys(True)
    assert {"obs_a", "obs_b"} - set(data.tensordicts[0].keys()) == {"obs_b"}
    assert {"obs_a", "obs_b"} - set(data.tensordicts[1].keys()) == {"obs_a"}
    assert_same_as_upstream(records)


@every_start_method
# --------------------------------------------------------------------------- 10. defaults
@pytest.mark.skipif(not HAS_DAEMON, reason="this TorchRL hard-codes daemonic workers (no daemon=)")
def test_defaults_daemon_and_shutdown_timeout(mp_start_method: str) -> None:
    """The import swap alone gives upstream's defaults: ``env.daemon`` (``False`` since
    TorchRL 0.11) and ``env.shutdown_timeout`` (10.0 s since 0.13); both follow their kwargs."""
    explicit: dict[str, Any] = {"daemon": True}
    if HAS_SHUTDOWN_TIMEOUT:
        explicit["shutdown_timeout"] = 3.0

    def scenario(variant: Variant, rec: Record) -> None:
        for kwargs in ({}, explicit):
            env = variant(2, counting(), mp_start_method=mp_start_method, **kwargs)
            with closing(env):
                rec(f"daemon with {kwargs}", lambda env=env: env.daemon)
                if HAS_SHUTDOWN_TIMEOUT:
                    rec(f"shutdown_timeout with {kwargs}", lambda env=env: env.shutdown_timeout)

    records = run_variants(scenario)
    assert upstream(records, "daemon with {}") is False
    if HAS_SHUTDOWN_TIMEOUT:
        assert upstream(records, "shutdown_timeout with {}") == 10.0
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.skipif(not HAS_DAEMON, reason="this TorchRL hard-codes daemonic workers (no daemon=)")
def test_workers_may_have_children_by_default(mp_start_method: str) -> None:
    """What the default ``daemon=False`` means: a worker may start a child process (an env
    whose reset runs a DataLoader with workers, or a simulator)."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, functools.partial(make_child_in_reset_env), mp_start_method=mp_start_method)
        with closing(env):
            rec("reset (child exit codes)", lambda: env.reset()["observation"][:, 0])

    records = run_variants(scenario)
    assert upstream(records, "reset (child exit codes)").tolist() == [0.0, 0.0]
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.compat
def test_close_of_a_closed_env(mp_start_method: str) -> None:
    """``close()`` of a closed env (never started, or closed already) raises upstream's
    ``RuntimeError`` (``raise_if_closed=True`` by default); ``close(raise_if_closed=False)``
    does not."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, counting(), mp_start_method=mp_start_method)
        with closing(env):
            rec("close() before start", env.close)
            rec("rollout", lambda: rollout(env, 2, seed=0))
            rec("close()", env.close)
            rec("is_closed", lambda: env.is_closed)
            rec("close() again", env.close)
            rec("close(raise_if_closed=False)", lambda: env.close(raise_if_closed=False))
            rec("close(raise_if_closed=True)", lambda: env.close(raise_if_closed=True))

    records = run_variants(scenario)
    again = records[UPSTREAM.name].steps["close() again"]
    assert again == Raised("builtins.RuntimeError", "trying to close a closed environment"), again
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.compat
def test_torchrl_s_own_errors_name_the_class_as_upstream_s_do(mp_start_method: str) -> None:
    """TorchRL's empty-spec check names the env's class (``type(self).__name__``); with the
    import swapped the message is upstream's word for word, not only once class names are
    normalized as the other contract cases compare them (TorchRL's own transform tests match
    "The environment passed to ParallelEnv has empty specs")."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = None
        try:
            env = variant(2, make_empty_specs_env, mp_start_method=mp_start_method)
            TransformedEnv(env, RemoveEmptySpecs())
            rec.value("construct", None)
        except RuntimeError as err:
            rec.value("construct", (type(err).__qualname__, str(err)))
        finally:
            if env is not None:
                close_quietly(env)

    records = run_variants(scenario)
    error = records[UPSTREAM.name].steps["construct"]
    assert error is not None and error[1].startswith("The environment passed to ParallelEnv has empty specs")
    assert_same_as_upstream(records)


@every_start_method
@pytest.mark.compat
def test_reset_s_argument_errors_name_the_class_as_upstream_s_do(mp_start_method: str) -> None:
    """``reset(set_state=True)`` on envs that cannot honour it: TorchRL's check names the class
    (TorchRL >= 0.14); the error is upstream's word for word (0.10 has no such check: both
    reset)."""

    def scenario(variant: Variant, rec: Record) -> None:
        env = variant(2, make_counting_env, mp_start_method=mp_start_method)
        with closing(env):
            try:
                env.reset(set_state=True)
                rec.value("reset", None)
            except Exception as err:
                rec.value("reset", (type(err).__qualname__, str(err)))

    records = run_variants(scenario)
    error = records[UPSTREAM.name].steps["reset"]
    assert error is None or error[1].startswith("ParallelEnv does not support deterministic resets"), error
    assert_same_as_upstream(records)
