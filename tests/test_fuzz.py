"""A stateful fuzz of ``ManagedParallelEnv``'s command and kill state machine.

Each example is a seeded random walk (``random.Random(seed)``; no hypothesis needed) over the
operations of a batched env: ``reset``, partial resets (a ``_reset`` mask, with the root or
alone), ``step``, ``step_and_maybe_reset``, ``set_seed``, ``state_dict`` / ``load_state_dict``,
operations through an indexed view (``env[i:j]``, ``env[[i, k]]``; TorchRL >= 0.14, gated by
feature), a few calls that fail in the main process, and SIGKILLs of workers, between two
calls (``os.kill`` on ``env.worker_pids[i]``, then a wait until the supervisor has seen it) or
while a call is in flight (the worker kills itself at the start of its reset or step, see
``tests/fuzz_envs.py``). The env (``FuzzEnv``) observes ``[worker, seed tag, episode, t,
accumulated actions]``, so a divergence shows in the data.

Four kinds of examples:

* ``plain``: no kill; the managed env is built exactly as upstream's and every step's result
  (values, keys, exception types and messages) is upstream's (``tests/contract/helpers.py``);
* ``armed``: no kill, ``max_restarts > 0``: upstream's data plus ``worker_restarted`` and
  ``truncated`` entries that are all False;
* ``fail_fast``: ``max_restarts=0`` and one kill: upstream's data up to the kill, then the
  next call (and the one after) raises ``WorkerDiedError`` naming the killed slot, ``close()``
  works and nothing is left;
* ``restart``: ``max_restarts >= kills``: every call returns normally, the slots never killed
  hold upstream's data, a killed slot's transition is marked as docs/restarts.md says (or its
  reset in flight is replayed on the replacement), and ``env.restarts`` has one record per kill.

After every example its envs are closed and their workers (and every descendant of this
process) are waited for with ``wait_until``.

The two library bugs this fuzz found (a reset given a marked root kept the mark at the root; a
mark written after a partial reset of other slots observed the lost worker's last observation)
are fixed; the regression tests at the end replay the seed that found each and a minimal
hand-written sequence.

Environment variables:

* ``TORCHRL_EXT_FUZZ_EXAMPLES=N``: ``N`` examples per test instead of the budgeted default
  (the default run takes well under a minute on 2 cores; each test's timeout grows with
  ``N``); e.g. ``TORCHRL_EXT_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest tests/test_fuzz.py``;
* ``TORCHRL_EXT_FUZZ_SEED=S``: the first example's seed (default 0; example ``i`` uses
  ``S + i``; the preloaded-path test adds 1000). Every failure names its test, kind and seed
  and prints the operations run so far and the command that reruns that example alone
  (``TORCHRL_EXT_FUZZ_SEED=S TORCHRL_EXT_FUZZ_EXAMPLES=1``).

To wait deterministically for the supervisor to see a kill, the fuzz reads the env's private
supervisor state (``_loss_seen``); nothing else here relies on the library's internals.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import ParallelEnv
from torchrl.envs.utils import step_mdp

from tests.conftest import SESSION, SESSION_VAR, leftovers, pid_alive, process_keys, start_kwargs
from tests.contract.helpers import HAS_VIEWS, Raised, assert_same, snapshot
from tests.fuzz_envs import fresh_reset_observation, make_fuzz_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError

EXAMPLES_VAR = "TORCHRL_EXT_FUZZ_EXAMPLES"
SEED_VAR = "TORCHRL_EXT_FUZZ_SEED"

#: Done entries a managed env with ``max_restarts > 0`` adds (the FuzzEnv has no truncation).
EXTRA_KEYS = ("worker_restarted", "truncated")
#: Actions are multiples of 1/4: every sum is exact in float32.
ACTIONS = [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]
STEP_KINDS = ("step", "smr", "view_step", "view_smr")
RESET_KINDS = ("reset", "partial_reset", "mask_reset", "view_reset")
#: What TorchRL sends a worker for each kind of call (``RestartRecord.command``).
COMMANDS = {"step": "step", "view_step": "step", "smr": "step_and_maybe_reset"}
COMMANDS |= {"view_smr": "step_and_maybe_reset"} | {kind: "reset" for kind in RESET_KINDS}


def examples(default: int) -> int:
    value = os.environ.get(EXAMPLES_VAR, "")
    return int(value) if value else default


def base_seed() -> int:
    return int(os.environ.get(SEED_VAR, "0") or 0)


#: An example takes about a second on 2 quiet cores; the timeout grows with the examples asked.
pytestmark = pytest.mark.timeout(120 + 10 * examples(14))


# --------------------------------------------------------------------------- the plan
@dataclass
class Op:
    """One operation of an example, with what the model expects of it (restart examples)."""

    kind: str
    #: The slots of the call's batch, in batch order (the parent's, or the view's indices).
    slots: tuple[int, ...] = ()
    actions: tuple[float, ...] = ()
    mask: tuple[bool, ...] = ()
    seed: int = 0
    static: bool = False
    scales: tuple[float, ...] = ()
    #: ``kill``: the slot killed between two calls; other kinds: a slot that dies in flight.
    kill: int | None = None
    #: Slots whose lost worker this call replaces, in the order of their loss.
    handled: list[int] = field(default_factory=list)
    #: Slots whose transition this call must mark.
    marked: set[int] = field(default_factory=set)
    #: Slots whose reset in flight is replayed on the replacement.
    replayed: set[int] = field(default_factory=set)
    #: Slots replaced at the start of this reset, then reset as asked.
    reset_after_restart: set[int] = field(default_factory=set)
    #: Slots killed before this call: their data is no longer upstream's.
    tainted: frozenset[int] = frozenset()

    def __str__(self) -> str:
        parts = [self.kind]
        if self.slots and self.kind.startswith("view"):
            parts.append(f"slots={list(self.slots)}")
        if self.actions:
            parts.append(f"actions={list(self.actions)}")
        if self.mask:
            parts.append(f"mask={[int(m) for m in self.mask]}")
        if self.kind == "set_seed":
            parts.append(f"seed={self.seed} static={self.static}")
        if self.scales:
            parts.append(f"scales={list(self.scales)}")
        if self.kill is not None:
            parts.append(f"{'kill' if self.kind == 'kill' else 'dies in flight'}={self.kill}")
        return " ".join(parts)

    @property
    def is_call(self) -> bool:
        """A call that reaches the workers (and handles the losses seen before it)."""
        return self.kind not in ("kill", "view_make", "view_close", "view_oob")

    def reset_slots(self) -> set[int]:
        if self.kind in ("reset", "view_reset"):
            return set(self.slots)
        if self.kind in ("partial_reset", "mask_reset"):
            return {s for s, m in zip(self.slots, self.mask, strict=True) if m}
        return set()


@dataclass
class Plan:
    kind: str
    seed: int
    num_workers: int
    max_steps: tuple[int, ...]
    max_restarts: int | None
    ops: list[Op]

    def header(self) -> str:
        return (
            f"kind={self.kind} seed={self.seed} num_workers={self.num_workers} "
            f"max_steps={list(self.max_steps)} max_restarts={self.max_restarts}"
        )


class _Model:
    """What the plan generator knows of the env: roots, the view, losses and pending marks."""

    def __init__(self, rng: random.Random, n: int, kind: str) -> None:
        self.rng, self.n, self.kind = rng, n, kind
        self.has_root = False
        self.view: tuple[int, ...] | None = None
        self.view_has_root = False
        self.loaded = False  # after load_state_dict: pipe-answered calls only (see _choose)
        self.lost: list[int] = []  # killed, not replaced yet (in the order of the kills)
        self.pending_mark: set[int] = set()  # replaced between calls; next step is a mark
        self.tainted: set[int] = set()
        self.kills = 0
        self.started = False  # a call started the workers (they start lazily)

    def actions(self, k: int) -> tuple[float, ...]:
        return tuple(self.rng.choice(ACTIONS) for _ in range(k))

    def choose(self, errors: bool, load: bool = True) -> Op:
        """A random operation that is valid now (``load``: ``load_state_dict`` may be drawn)."""
        rng, n = self.rng, self.n
        all_slots = tuple(range(n))
        if self.loaded:
            # TorchRL 0.14.1's worker raises its shared done flag for load_state_dict and the
            # parent never clears it: upstream's next buffer-answered call reads the buffers
            # while the workers still write them (see tests/contract/test_contract.py). Only
            # calls answered on the pipes follow it.
            if rng.random() < 0.5:
                return Op("state_dict", all_slots)
            return Op("set_seed", all_slots, seed=rng.randrange(1000), static=rng.random() < 0.3)
        choices: list[tuple[float, Callable[[], Op]]] = [
            (2.0, lambda: Op("reset", all_slots)),
            (1.0, lambda: Op("set_seed", all_slots, seed=rng.randrange(1000), static=rng.random() < 0.3)),
            (1.0, lambda: Op("state_dict", all_slots)),
        ]
        mask = lambda: tuple(rng.random() < 0.5 for _ in range(n)) or (True,)  # noqa: E731
        if self.has_root:
            choices += [
                (3.0, lambda: Op("step", all_slots, actions=self.actions(n))),
                (3.0, lambda: Op("smr", all_slots, actions=self.actions(n))),
                (1.5, lambda: Op("partial_reset", all_slots, mask=_nonempty(mask(), rng))),
                (0.5, lambda: Op("mask_reset", all_slots, mask=_nonempty(mask(), rng))),
            ]
        if load and not self.lost and not self.pending_mark:
            scales = lambda: (rng.choice([0.5, 2.0, -1.0]),)  # noqa: E731
            per_worker = lambda: tuple(rng.choice([0.5, 2.0, -1.0]) for _ in range(n))  # noqa: E731
            choices.append((0.2, lambda: Op("load_state_dict", all_slots, scales=scales())))
            choices.append((0.2, lambda: Op("load_state_dict", all_slots, scales=per_worker())))
        if HAS_VIEWS:
            if self.view is None:
                choices.append((1.5, lambda: Op("view_make", _view_slots(rng, n))))
            else:
                view = self.view
                choices.append((1.5, lambda: Op("view_reset", view)))
                choices.append((0.3, lambda: Op("view_close", view)))
                if self.view_has_root:
                    choices.append((2.5, lambda: Op("view_step", view, actions=self.actions(len(view)))))
                    choices.append((2.5, lambda: Op("view_smr", view, actions=self.actions(len(view)))))
        if errors:
            # Calls that fail in the main process, before any worker is asked anything.
            if self.has_root:
                choices.append((0.3, lambda: Op("empty_mask", all_slots, mask=(False,) * n)))
                choices.append((0.3, lambda: Op("bad_mask", all_slots)))
            if HAS_VIEWS:
                choices.append((0.3, lambda: Op("view_oob", (n,))))
        weights = [w for w, _ in choices]
        return rng.choices([make for _, make in choices], weights=weights)[0]()

    def can_die_in_flight(self, op: Op) -> list[int]:
        """Slots that may die while ``op`` is in flight: slots the call sends a reset or a step
        (a pending mark answers the slot's step without sending it)."""
        if op.kind in STEP_KINDS:
            return [s for s in op.slots if s not in self.lost and s not in self.pending_mark]
        return [s for s in op.reset_slots() if s not in self.lost]

    def apply(self, op: Op) -> None:
        """Update the model with ``op`` and fill in what the env must do in it."""
        op.tainted = frozenset(self.tainted)
        if op.kind == "kill":
            assert op.kill is not None
            self.lost.append(op.kill)
            self.tainted.add(op.kill)
            self.kills += 1
            return
        if op.is_call and op.kind not in ("empty_mask", "bad_mask"):
            self.started = True
            op.handled = list(self.lost)
            self.pending_mark |= set(self.lost)
            self.lost = []
            if op.kind in STEP_KINDS:
                op.marked = self.pending_mark & set(op.slots)
                self.pending_mark -= op.marked
            op.reset_after_restart = self.pending_mark & op.reset_slots()
            self.pending_mark -= op.reset_after_restart
            if op.kill is not None:
                op.handled.append(op.kill)
                (op.marked if op.kind in STEP_KINDS else op.replayed).add(op.kill)
                self.tainted.add(op.kill)
                self.kills += 1
        if self.kind == "fail_fast" and self.kills:
            return  # every call fails from now on: no root, no view root
        if op.kind in ("reset", "partial_reset", "mask_reset", "step", "smr"):
            self.has_root = True
        elif op.kind == "load_state_dict":
            self.loaded = True
        elif op.kind == "view_make":
            self.view, self.view_has_root = op.slots, False
        elif op.kind in ("view_reset", "view_step", "view_smr"):
            self.view_has_root = True
        elif op.kind == "view_close":
            self.view, self.view_has_root = None, False


def _nonempty(mask: tuple[bool, ...], rng: random.Random) -> tuple[bool, ...]:
    if any(mask):
        return mask
    chosen = rng.randrange(len(mask))
    return tuple(i == chosen for i in range(len(mask)))


def _view_slots(rng: random.Random, n: int) -> tuple[int, ...]:
    """A slice ``[i:j]`` (TorchRL turns it into indices) or a list of indices, in order."""
    if rng.random() < 0.6:
        start = rng.randrange(n)
        stop = rng.randrange(start + 1, n + 1)
        return tuple(range(start, stop))
    k = rng.randrange(1, n + 1)
    return tuple(sorted(rng.sample(range(n), k)))


def make_plan(kind: str, seed: int) -> Plan:
    rng = random.Random(f"{kind}-{seed}")
    n = rng.choice([2, 3])
    max_steps = tuple(rng.randint(1, 4) for _ in range(n))
    length = rng.randint(5, 12)
    model = _Model(rng, n, kind)
    ops: list[Op] = []
    max_restarts: int | None = None
    if kind == "armed":
        max_restarts = rng.randint(1, 3)
    elif kind == "fail_fast":
        max_restarts = 0
    elif kind == "restart":
        kills = rng.randint(1, 3)
        max_restarts = kills + rng.randint(0, 1)
    kill_at = rng.randint(1, length - 1) if kind == "fail_fast" else None
    for i in range(length):
        if kind == "fail_fast" and i == kill_at:
            op = _kill_op(model, rng)
            ops += op
            # The call after the kill (if the kill was not in flight) and one more: both raise.
            for _ in range(2 if op[-1].kind == "kill" else 1):
                op_next = model.choose(errors=False)
                while not op_next.is_call:
                    model.apply(op_next)
                    ops.append(op_next)
                    op_next = model.choose(errors=False)
                ops.append(op_next)
            break
        if kind == "restart" and model.kills < kills and not model.loaded and rng.random() < 0.35:
            ops += _kill_op(model, rng)
            continue
        if model.loaded and ops[-1].kind != "load_state_dict":
            break  # one pipe-answered call after load_state_dict (see _Model.choose) is enough
        # No kill follows a load_state_dict: a restart example loads one only once its kills are
        # done, a fail_fast one never before its kill.
        load = kind in ("plain", "armed") or (kind == "restart" and model.kills >= kills)
        op = model.choose(errors=(kind == "plain"), load=load)
        model.apply(op)
        ops.append(op)
    if kind == "restart":
        # Every planned kill happens; the last loss is handled by a final call.
        while model.kills < kills and not model.loaded:
            ops += _kill_op(model, rng)
        if model.lost:
            op = Op("reset", tuple(range(n)))
            model.apply(op)
            ops.append(op)
    return Plan(kind, seed, n, max_steps, max_restarts, ops)


def _kill_op(model: _Model, rng: random.Random) -> list[Op]:
    """A kill between two calls, or a call during which a worker dies; applied to ``model``
    (after a first reset if no call started the workers yet)."""
    if not model.started:
        first = Op("reset", tuple(range(model.n)))
        model.apply(first)
        return [first, *_kill_op(model, rng)]
    for _ in range(20):
        op = model.choose(errors=False)
        if not op.is_call:
            continue
        slots = model.can_die_in_flight(op)
        if slots and rng.random() < 0.5:
            op.kill = rng.choice(slots)
            model.apply(op)
            return [op]
        break
    alive = [s for s in range(model.n) if s not in model.lost]
    if not alive:  # every worker is lost already: a call replaces them first
        op = model.choose(errors=False)
        while not op.is_call:
            op = model.choose(errors=False)
        model.apply(op)
        return [op, *_kill_op(model, rng)]
    op = Op("kill", kill=rng.choice(alive))
    model.apply(op)
    return [op]


# --------------------------------------------------------------------------- running a plan
@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None


class Driver:
    """Runs a plan's operations on one batched env, keeping its own roots and view."""

    def __init__(self, env: Any, kill_dir: Path | None) -> None:
        self.env = env
        self.kill_dir = kill_dir
        self.root: TensorDictBase | None = None
        self.view: Any = None
        self.view_root: TensorDictBase | None = None
        self.pids: set[int] = set()

    def _with_actions(self, root: TensorDictBase, actions: tuple[float, ...]) -> TensorDictBase:
        return root.clone().set("action", torch.tensor(actions, dtype=torch.float32).reshape(-1, 1))

    def call(self, op: Op) -> Any:
        env = self.env
        kind = op.kind
        if kind == "reset":
            self.root = env.reset()
            return self.root
        if kind == "partial_reset":
            assert self.root is not None
            self.root = env.reset(self.root.clone().set("_reset", _mask(op.mask)))
            return self.root
        if kind == "mask_reset":
            self.root = env.reset(TensorDict({"_reset": _mask(op.mask)}, batch_size=[len(op.mask)]))
            return self.root
        if kind == "step":
            assert self.root is not None
            out = env.step(self._with_actions(self.root, op.actions))
            self.root = step_mdp(out)
            return out
        if kind == "smr":
            assert self.root is not None
            out, self.root = env.step_and_maybe_reset(self._with_actions(self.root, op.actions))
            return out, self.root
        if kind == "set_seed":
            return env.set_seed(op.seed, static_seed=op.static)
        if kind == "state_dict":
            return env.state_dict()
        if kind == "load_state_dict":
            if len(op.scales) == 1:
                state: Any = {"scale": torch.tensor(op.scales[0])}
            else:
                state = {f"worker{i}": {"scale": torch.tensor(s)} for i, s in enumerate(op.scales)}
            return env.load_state_dict(state)
        if kind == "view_make":
            self.view = env[_index(op.slots)]
            self.view_root = None
            return "view"
        if kind == "view_reset":
            self.view_root = self.view.reset()
            return self.view_root
        if kind == "view_step":
            assert self.view_root is not None
            out = self.view.step(self._with_actions(self.view_root, op.actions))
            self.view_root = step_mdp(out)
            return out
        if kind == "view_smr":
            assert self.view_root is not None
            out, self.view_root = self.view.step_and_maybe_reset(
                self._with_actions(self.view_root, op.actions)
            )
            return out, self.view_root
        if kind == "view_close":
            view, self.view, self.view_root = self.view, None, None
            return view.close()
        if kind == "empty_mask":
            assert self.root is not None
            return env.reset(self.root.clone().set("_reset", _mask(op.mask)))
        if kind == "bad_mask":
            assert self.root is not None
            return env.reset(self.root.clone().set("_reset", torch.ones(len(op.slots) + 1, dtype=torch.bool)))
        if kind == "view_oob":
            return env[op.slots[0]]
        raise AssertionError(f"unknown op {kind}")

    def run(self, op: Op) -> Outcome:
        kill_file = None
        if op.kill is not None and self.kill_dir is not None:
            kill_file = self.kill_dir / f"kill-{op.kill}"
            kill_file.touch()
        try:
            outcome = Outcome(value=snapshot(self.call(op)))
        except Exception as err:
            outcome = Outcome(error=err)
        finally:
            self.note_pids()
        if kill_file is not None:
            assert not kill_file.exists(), f"worker {op.kill} was never asked to {op.kind}"
        return outcome

    def note_pids(self) -> None:
        if isinstance(self.env, ManagedParallelEnv):
            self.pids.update(self.env.worker_pids)
            return
        for worker in self.env.__dict__.get("_workers") or []:  # upstream's processes
            self.pids.add(worker.pid)


def _mask(mask: tuple[bool, ...]) -> torch.Tensor:
    return torch.tensor(mask, dtype=torch.bool).reshape(-1, 1)


def _index(slots: tuple[int, ...]) -> Any:
    if list(slots) == list(range(slots[0], slots[-1] + 1)) and len(slots) > 1:
        return slice(slots[0], slots[-1] + 1)
    return list(slots)


def _loss_seen(env: Any, slot: int) -> bool:
    """The supervisor has handled the death of ``slot``'s worker (private state, read only)."""
    supervisor = env._state.supervisor
    if supervisor is None:
        return False
    if supervisor.failure() is not None:
        return True
    losses = [loss.index for loss in supervisor.losses()]
    return slot in losses and supervisor._worker(slot).handled.is_set()


def kill_between_calls(env: Any, slot: int) -> int:
    pid = env.worker_pids[slot]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), f"worker {slot} (pid {pid}) is dead", timeout=30)
    wait_until(lambda: _loss_seen(env, slot), f"the supervisor saw worker {slot}'s death", timeout=30)
    return pid


def _nothing_left(before: set[tuple[int, float]]) -> bool:
    live, zombies = leftovers(before)
    return not live and not zombies


# --------------------------------------------------------------------------- checks
def _comparable(outcome: Outcome, cls: type) -> Any:
    return Raised.of(outcome.error, cls) if outcome.error is not None else outcome.value


def _leaves(td: TensorDictBase) -> dict[Any, Any]:
    return dict(td.items(include_nested=True, leaves_only=True))


def _last(key: Any) -> str:
    return key if isinstance(key, str) else key[-1]


def compare_slots(expected: Any, actual: Any, op: Op, path: str, extra_keys: bool) -> None:
    """``actual`` (managed) is ``expected`` (upstream) in every slot of ``op`` not killed so far;
    with ``extra_keys``, ``actual`` may hold the done entries restarts add (checked elsewhere)."""
    if isinstance(expected, Raised) or isinstance(actual, Raised):
        assert_same(expected, actual, path)
        return
    excluded = set(op.tainted) | ({op.kill} if op.kill is not None else set())
    keep = [p for p, slot in enumerate(op.slots) if slot not in excluded]
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            compare_slots(e, a, op, f"{path}[{i}]", extra_keys)
        return
    if isinstance(expected, TensorDictBase):
        assert isinstance(actual, TensorDictBase), f"{path}: {type(actual).__name__}"
        assert expected.batch_size == actual.batch_size, (
            f"{path}: {expected.batch_size} != {actual.batch_size}"
        )
        e_leaves, a_leaves = _leaves(expected), _leaves(actual)
        missing = [k for k in e_leaves if k not in a_leaves]
        extra = [k for k in a_leaves if k not in e_leaves]
        assert not missing, f"{path}: managed lacks {missing}"
        assert all(extra_keys and _last(k) in EXTRA_KEYS for k in extra), f"{path}: managed adds {extra}"
        index = torch.tensor(keep, dtype=torch.long)
        for key, value in e_leaves.items():
            assert_same(value[index], a_leaves[key][index], f"{path}[{key!r}] at slots {keep}")
        return
    if op.kind == "state_dict":
        assert list(expected) == list(actual), f"{path}: {list(expected)} != {list(actual)}"
        for slot in op.slots:
            if slot not in excluded:
                assert_same(expected[f"worker{slot}"], actual[f"worker{slot}"], f"{path}[worker{slot}]")
        return
    assert_same(expected, actual, path)


def check_marks(op: Op, value: Any, path: str, seeds: dict[int, int | None]) -> None:
    """The done entries a managed env with ``max_restarts > 0`` adds, per docs/restarts.md
    (``seeds``: per slot, the seed its last replacement was given)."""
    if op.kind in ("step", "view_step", "smr", "view_smr"):
        out, root = (value, None) if op.kind in ("step", "view_step") else value
        nxt = out["next"]
        for p, slot in enumerate(op.slots):
            marked = slot in op.marked
            where = f"{path}: slot {slot} (position {p}), marked={marked}"
            assert nxt["worker_restarted"][p].item() is marked, where
            assert nxt["truncated"][p].item() is marked, where
            if marked:
                assert nxt["done"][p].item() is True, where
                assert nxt["terminated"][p].item() is False, where
                assert nxt["reward"][p].item() == 0.0, where
                if root is not None:
                    assert root["done"][p].item() is False, where
                fresh = fresh_reset_observation(slot, seeds.get(slot))
                assert torch.equal(nxt["observation"][p], fresh), f"{where}: {nxt['observation'][p]}"
                if root is not None:  # the fresh env's reset is the slot's next root
                    seen = root["observation"][p]
                    assert torch.equal(seen, fresh), f"{where}: root {seen}"
            if root is not None:
                assert root["worker_restarted"][p].item() is False, f"{where}: root"
        return
    if op.kind in RESET_KINDS:
        reset = op.reset_slots()
        for p, slot in enumerate(op.slots):
            if slot not in reset:
                continue
            where = f"{path}: slot {slot} (position {p})"
            for key in ("worker_restarted", "truncated", "done"):
                assert value[key][p].item() is False, f"{where}: {key}"
            obs = value["observation"][p]
            if slot in op.replayed:  # the same reset, on the replacement: its first
                fresh = fresh_reset_observation(slot, seeds.get(slot))
                assert torch.equal(obs, fresh), f"{where}: replayed reset {obs}"
            if slot in op.reset_after_restart:  # reset by the restart, then as asked
                assert (obs[0].item(), obs[3].item(), obs[4].item()) == (slot, 0.0, 0.0), f"{where}: {obs}"


# --------------------------------------------------------------------------- examples
def _env_kwargs(plan: Plan, kill_dir: Path | None) -> list[dict[str, Any]]:
    kwargs: list[dict[str, Any]] = []
    for i in range(plan.num_workers):
        entry: dict[str, Any] = {"worker": i, "max_steps": plan.max_steps[i]}
        if kill_dir is not None:
            entry["kill_file"] = str(kill_dir / f"kill-{i}")
        kwargs.append(entry)
    return kwargs


def _op_name(i: int, op: Op) -> str:
    return f"{i:02d} {op}"


def _close(env: Any, ok: bool) -> None:
    if ok:
        env.close()  # must not raise, whatever happened to the workers
    else:
        try:
            env.close(raise_if_closed=False)
        except Exception:
            pass


def _wait_gone(pids: set[int], what: str) -> None:
    wait_until(lambda: not [p for p in pids if pid_alive(p)], f"every worker of {what} is gone", timeout=30)


def run_upstream(plan: Plan) -> dict[str, Outcome]:
    """Upstream's outcome of each call of ``plan`` (up to the kill, for ``fail_fast``)."""
    env = ParallelEnv(
        plan.num_workers, make_fuzz_env, create_env_kwargs=_env_kwargs(plan, None), mp_start_method="fork"
    )
    driver = Driver(env, None)
    outcomes: dict[str, Outcome] = {}
    ok = False
    try:
        torch.manual_seed(0)
        for i, op in enumerate(plan.ops):
            if plan.kind == "fail_fast" and (op.kind == "kill" or op.kill is not None):
                break
            if op.kind != "kill":
                outcomes[_op_name(i, op)] = driver.run(op)
        ok = True
    finally:
        _close(env, ok)
        _wait_gone(driver.pids, "upstream's env")
    return outcomes


def run_managed(
    plan: Plan,
    upstream: dict[str, Outcome],
    start: dict[str, Any],
    trace: list[str],
) -> None:
    kill_dir = Path(tempfile.mkdtemp(prefix="fuzz-kill-")) if plan.kind in ("fail_fast", "restart") else None
    if plan.kind == "plain":
        from tests.contract.helpers import managed_class

        env = managed_class()(
            plan.num_workers, make_fuzz_env, create_env_kwargs=_env_kwargs(plan, None), **start
        )
    else:
        env = ManagedParallelEnv(
            plan.num_workers,
            make_fuzz_env,
            create_env_kwargs=_env_kwargs(plan, kill_dir),
            daemon_workers=False,
            max_restarts=plan.max_restarts,
            **start,
        )
    driver = Driver(env, kill_dir)
    cls = type(env)
    extra = plan.kind in ("armed", "restart")
    killed: dict[int, int] = {}  # slot -> pid of the worker killed between calls, not replaced yet
    expected_records: list[tuple[int, int]] = []
    dead: tuple[int, int] | None = None  # fail_fast: (slot, pid) of the dead worker
    ok = False
    try:
        torch.manual_seed(0)
        for i, op in enumerate(plan.ops):
            name = _op_name(i, op)
            trace.append(name)
            if op.kind == "kill":
                assert op.kill is not None
                pid = kill_between_calls(env, op.kill)
                killed[op.kill] = pid
                if plan.kind == "fail_fast":
                    dead = (op.kill, pid)
                continue
            in_flight_pid = env.worker_pids[op.kill] if op.kill is not None else None
            outcome = driver.run(op)
            if plan.kind == "fail_fast" and (dead is not None or op.kill is not None):
                if dead is None:
                    assert op.kill is not None and in_flight_pid is not None
                    dead = (op.kill, in_flight_pid)
                if not op.is_call:
                    continue
                err = outcome.error
                assert isinstance(err, WorkerDiedError), f"{name}: expected WorkerDiedError, got {outcome}"
                assert (err.worker_index, err.pid) == dead, f"{name}: {err!r} is not worker {dead}"
                continue
            compare_slots(
                _comparable(upstream[name], ParallelEnv), _comparable(outcome, cls), op, name, extra
            )
            if extra and outcome.error is None:
                check_marks(op, outcome.value, name, {r.slot: r.seed for r in env.restarts})
            for slot in op.handled:
                pid = in_flight_pid if slot == op.kill and slot not in killed else killed.pop(slot)
                assert pid is not None
                expected_records.append((slot, pid))
            if plan.kind == "restart":
                records = env.restarts
                seen = [(r.slot, r.old_pid) for r in records]
                assert seen == expected_records, f"{name}: restarts {seen} != {expected_records}"
                assert all(r.cause == -signal.SIGKILL for r in records), f"{name}: {records}"
                if op.kill is not None:
                    assert records[-1].command == COMMANDS[op.kind], f"{name}: {records[-1]}"
        if plan.kind == "restart":
            assert not killed, f"losses never handled: {killed}"
            last = {r.slot: r.new_pid for r in env.restarts}
            assert all(env.worker_pids[s] == pid for s, pid in last.items()), (env.worker_pids, last)
        if plan.kind == "fail_fast":
            assert dead is not None, "the plan killed nothing"
        ok = True
    finally:
        _close(env, ok)
        _wait_gone(driver.pids, "the managed env")
        if kill_dir is not None:
            left = sorted(p.name for p in kill_dir.iterdir())
            shutil.rmtree(kill_dir, ignore_errors=True)
            assert not left or not ok, f"kill files left: {left}"
    if isinstance(env, ManagedParallelEnv):  # not ReferenceParallelEnv (helpers.REFERENCE_VAR)
        report = env.supervision_report
        assert report is not None, "close() left no supervision report"
        assert report.leftovers_killed == 0, str(report)
        outcomes = {w.index: w.outcome for w in report.workers}
        if dead is not None:  # fail_fast: the dead worker was reaped when it died, the others closed
            assert outcomes.pop(dead[0], "died") == "died", str(report)
        assert set(outcomes.values()) <= {"graceful"}, str(report)
        if plan.kind == "restart":
            assert report.restarts == len(expected_records), str(report)


def run_example(plan: Plan, start: dict[str, Any], offset: int = 0) -> None:
    """Run ``plan`` on upstream, then on the managed env, and compare."""
    before = process_keys()  # the leak fixture's baseline: a tagged ancestor is not ours
    trace: list[str] = []
    try:
        upstream = run_upstream(plan)
        run_managed(plan, upstream, start, trace)
        wait_until(lambda: _nothing_left(before), "every process of the example is gone", timeout=30)
    except Exception as err:
        test = os.environ.get("PYTEST_CURRENT_TEST", "tests/test_fuzz.py").split(" ")[0]
        ops = "\n".join(f"    {line}" for line in trace) or "    (none)"
        raise AssertionError(
            f"fuzz example failed: {plan.header()}\n"
            f"  rerun: {SEED_VAR}={plan.seed - offset} {EXAMPLES_VAR}=1 python -m pytest {test!r}\n"
            f"  managed ops run (the last one failed):\n{ops}\n"
            f"  {type(err).__name__}: {err}"
        ) from err


def run_examples(kind: str, default: int, start: dict[str, Any], offset: int = 0) -> None:
    first = base_seed() + offset
    t0 = time.monotonic()
    count = examples(default)
    for seed in range(first, first + count):
        try:
            plan = make_plan(kind, seed)
        except Exception as err:
            raise AssertionError(f"the plan of kind={kind} seed={seed} could not be drawn: {err!r}") from err
        run_example(plan, start, offset=offset)
    print(f"{kind}: {count} examples (seeds {first}..{first + count - 1}) in {time.monotonic() - t0:.1f} s")


FORK = {"mp_start_method": "fork"}


@pytest.mark.compat
def test_without_kills_same_as_upstream() -> None:
    run_examples("plain", 8, FORK)


@pytest.mark.compat
def test_restarts_armed_without_kills_same_as_upstream_plus_unset_marks() -> None:
    run_examples("armed", 3, FORK)


@pytest.mark.compat
def test_kill_without_restarts_raises_worker_died_error() -> None:
    run_examples("fail_fast", 5, FORK)


@pytest.mark.compat
def test_kills_with_restarts_mark_or_replay_and_leave_others_untouched() -> None:
    run_examples("restart", 10, FORK)


@pytest.mark.compat
def test_kills_with_restarts_on_the_preloaded_path() -> None:
    """The default start (forks of the preloaded server; upstream's reference runs on fork)."""
    run_examples("restart", 1, start_kwargs("preloaded"), offset=1000)


# --------------------------------------------------------------------------- bugs found
# Regressions: the seeds that found the two bugs (fixed), then minimal hand-written sequences.


@pytest.mark.skipif(not HAS_VIEWS, reason="the walk of this seed is the one drawn where views exist")
def test_regression_root_marks_restart_seed_94() -> None:
    """Restart, seed 94: ``reset``, a step during which worker 1 dies (marked), a reset of slot
    0 given that root, then a reset of both given the next root: slot 1 came back with root
    ``worker_restarted`` True (TorchRL copies the input into the slot's buffer; no env writes
    the entries restarts add, so every reset now clears them at the root)."""
    run_example(make_plan("restart", 94), FORK)


@pytest.mark.skipif(not HAS_VIEWS, reason="the walk of this seed is the one drawn where views exist")
def test_regression_stale_mark_obs_restart_seed_68() -> None:
    """Restart, seed 68: ... kill 1, kill 0, a mask-only reset of slot 0 (it replaces both),
    then ``step_and_maybe_reset``: slot 1's mark observed zeros (TorchRL's partial reset copies
    a slot it does not reset's "next" over its root; the mark now uses the observation the
    replacement's reset gave, recorded when it answered)."""
    run_example(make_plan("restart", 68), FORK)


def _two_workers() -> ManagedParallelEnv:
    kwargs = [{"worker": 0, "max_steps": 9}, {"worker": 1, "max_steps": 9}]
    return ManagedParallelEnv(
        2,
        make_fuzz_env,
        create_env_kwargs=kwargs,
        daemon_workers=False,
        max_restarts=1,
        mp_start_method="fork",
    )


@pytest.mark.compat
def test_regression_root_marks_minimal() -> None:
    """One kill between two calls, the marked step, a reset of the done (restarted) slot given
    the step's next root, then a full reset: both resets must leave the slot unmarked."""
    env = _two_workers()
    pids: set[int] = set()
    try:
        td = env.reset()
        pids.update(env.worker_pids)
        kill_between_calls(env, 1)
        out = env.step(td.set("action", torch.zeros(2, 1)))
        pids.update(env.worker_pids)
        assert out["next", "worker_restarted"].squeeze(-1).tolist() == [False, True]  # marked
        root = step_mdp(out)
        root["_reset"] = root["done"].clone()
        partial, full = env.reset(root), env.reset()
        keys = ("done", *EXTRA_KEYS)
        found = {
            "partial reset": {key: partial[key].squeeze(-1).tolist() for key in keys},
            "full reset": {key: full[key].squeeze(-1).tolist() for key in keys},
        }
        clean = {key: [False, False] for key in keys}
        assert found == {"partial reset": clean, "full reset": clean}, found
    finally:
        env.close(raise_if_closed=False)
        _wait_gone(pids, "the managed env")


@pytest.mark.compat
def test_regression_stale_mark_obs_minimal() -> None:
    """A step, a kill of worker 0 between two calls, a partial reset of slot 1 only (it
    replaces worker 0), then a step: slot 0's mark must hold the new env's reset observation."""
    env = _two_workers()
    pids: set[int] = set()
    try:
        td = env.reset()
        pids.update(env.worker_pids)
        env.step(td.set("action", torch.full((2, 1), 0.5)))
        kill_between_calls(env, 0)
        root = env.reset(TensorDict({"_reset": torch.tensor([[False], [True]])}, batch_size=[2]))
        pids.update(env.worker_pids)
        out = env.step(root.set("action", torch.zeros(2, 1)))
        assert out["next", "worker_restarted"].squeeze(-1).tolist() == [True, False]  # marked
        # Seen: [0, -1, 0, 1, 0.5], the lost worker's last next observation.
        assert out["next", "observation"][0].tolist() == fresh_reset_observation(0).tolist()
    finally:
        env.close(raise_if_closed=False)
        _wait_gone(pids, "the managed env")


@pytest.mark.compat
def test_example_baseline_leaves_out_a_tagged_process_that_is_no_descendant() -> None:
    """``make test-torchrl015`` runs pytest under ``sh -c`` with the session tag exported: that
    shell is a tagged process and no descendant. The example's baseline counted descendants
    only, so every example waited 30 s for the shell to go and failed, on every release (the
    single-command recipes exec pytest from make, which carries no tag). An orphaned tagged
    sleeper stands in for the shell: it existed before the example, so it is not left by it."""
    code = (
        "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(300)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    args = [sys.executable, "-c", code]
    done = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60)
    pid = int(done.stdout)
    try:
        assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
        assert psutil.Process(pid).environ().get(SESSION_VAR) == SESSION  # tagged, as the shell
        assert _nothing_left(process_keys())
    finally:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), f"the tagged sleeper (pid {pid}) is dead", timeout=30)
