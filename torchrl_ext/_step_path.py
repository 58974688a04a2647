"""The managed step path: a batched step owned end to end, its protocol written down once.

TorchRL's shared-buffer step does generic tensordict work on both sides of the pipe (``update_``
of the inputs, ``update_`` of both outputs in the worker, a ``clone`` of both outputs in the
parent) and its worker loop keeps its own books around every command. Where every output is a
CPU tensor in TorchRL's shared buffers, a managed env does the same steps with copies planned
once per spec::

    parent: ManagedParallelEnv.step_and_maybe_reset        worker i: _worker._CommandRecorder.recv
    ------------------------------------------------        ----------------------------------------
    ParentPlan.write_inputs
      input key k: buffer[k].copy_(td[k])  (planned)
    for each slot i (all told before any wait):
      channel.send(STEP_AND_MAYBE_RESET) ---- pipe, one write of STEP_WIRE ----->
                                                            recv_bytes() == STEP_BYTES:
                                                            WorkerPlan.step_and_maybe_reset
                                                              td, root = env.step_and_maybe_reset(R)
                                                              next[k].copy_(td["next"][k])  (planned)
                                                              R[k].copy_(root[k])           (planned)
                                                              flags[i] = 1 (+ wake byte, _done_signal)
    env._wait_for_workers(slots)  <------------------------ shared done flag -----------
      (the managed wait: sleep/spin, restarts, marks,
       step_timeout, recycling: unchanged)
    ParentPlan.read_outputs: one clone per leaf into the
      caller's result (no generic apply)

``R`` is the worker's root view of its slot of the shared buffer (what TorchRL's loop names
``root_shared_tensordict``), ``next`` its ``"next"`` entry.

**The protocol is TorchRL's own messages**: the parent sends exactly what TorchRL's
``ParallelEnv`` sends (``("step_and_maybe_reset", {})``, ``("step", {})``, ``("reset", (keys,
kwargs))``, with ``{"next_td_passthrough_keys": [...]}`` where the input carries ``"next"``),
and a worker answers exactly as TorchRL's loop does (the done flag; the shared buffers). So either
side may take its own path or TorchRL's, independently: a worker that cannot plan (TorchRL 0.10's
pipes, non-tensor specs, a device, the 0.15 hand-off) leaves every command to TorchRL's loop, and
a parent call the plan does not cover (partial steps, a collector's excluded keys) runs TorchRL's
``step_and_maybe_reset``. A worker with a plan answers every step, step-and-reset and reset
itself (so one root view carries whatever the env leaves in its input between calls), and
leaves every other command (init, seed, close, state dicts, forwarded calls, the recycler's
prepared reset) to TorchRL's loop. The most frequent message is pickled once
(:data:`STEP_BYTES`; the parent writes it framed as ``Connection.send_bytes`` frames it,
:data:`STEP_WIRE`, in one system call per worker): the worker compares bytes before unpickling
anything.

Which path an env runs and why: :func:`parent_reason` (``None``: ours), reported by
``ManagedParallelEnv.step_path`` and ``stats()`` (``managed_step_path``, ``managed_steps``).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ._compat import COLLECTOR_EXCLUDES, STEP_MDP, WORKER_KWARGS, Upstream
from ._done_signal import SpinRate

__all__ = [
    "STEP_AND_MAYBE_RESET",
    "STEP_BYTES",
    "STEP_PATH_VAR",
    "STEP_WIRE",
    "TENSORDICT_PRIVATES",
    "ParentPlan",
    "StepPath",
    "WorkerPlan",
    "kwargs_reason",
    "parent_reason",
    "switched_off",
    "unplannable",
    "worker_reason",
]

#: ``TORCHRL_EXT_STEP_PATH=torchrl`` in the main process's environment: every managed env steps
#: through TorchRL's path, on both sides (to rule ours out; :func:`switched_off`).
STEP_PATH_VAR = "TORCHRL_EXT_STEP_PATH"
#: The message TorchRL's ``ParallelEnv`` sends each worker for a plain batched step-and-reset.
STEP_AND_MAYBE_RESET: tuple[str, dict[str, Any]] = ("step_and_maybe_reset", {})
#: The same, pickled once: the bytes a worker recognises before unpickling anything.
STEP_BYTES: bytes = bytes(ForkingPickler.dumps(STEP_AND_MAYBE_RESET))
#: The same message as ``multiprocessing.connection.Connection.send_bytes`` writes it (a 4-byte
#: big-endian length, then the bytes): what the parent writes to each worker's pipe, in one write.
STEP_WIRE: bytes = struct.pack("!i", len(STEP_BYTES)) + STEP_BYTES

Key = str | tuple[str, ...]

#: The tensordict internals this module uses (none is public API), with what each is for.
#: ``tests/contract/test_contract_step_path.py`` checks that each exists on the installed
#: tensordict and that this module uses no other (TorchRL's names are ``_compat``'s).
TENSORDICT_PRIVATES: dict[str, str] = {
    "TensorDict._tensordict": "a plain TensorDict's dict of entries, read by the worker's planned copies",
    "TensorDict._new_unsafe": "builds the caller's result from fresh clones without validating them again",
    "TensorDictBase._maybe_names": "a buffer's dimension names (None: unnamed), given to the result as is",
}


def _leaves(td: TensorDictBase) -> list[tuple[Key, torch.Tensor]]:
    return [(key, td.get(key)) for key in td.keys(True, True)]


def unplannable(td: TensorDictBase, where: str = "") -> str | None:
    """What in ``td`` the planned copies cannot serve (``None``: every entry, at every depth,
    is a CPU tensor or a plain ``TensorDict``). It walks the entries as they are stored and
    reads no leaf through ``get``: a lazily stacked entry of heterogeneous shapes cannot be
    read whole (TorchRL's own path serves it, entry by entry).

    Example:
        >>> unplannable(TensorDict({"a": torch.zeros(2), "b": {"c": torch.zeros(1)}}, []))
        >>> unplannable(TensorDict({"a": {"b": "text"}}, []))
        "a NonTensorData under 'a.b'"
    """
    if type(td) is not TensorDict:
        return f"a {type(td).__name__} under {where!r}" if where else f"a {type(td).__name__}"
    for name, value in td._tensordict.items():
        key = f"{where}.{name}" if where else name
        if isinstance(value, TensorDictBase):
            found = unplannable(value, key)
            if found is not None:
                return found
        elif not isinstance(value, torch.Tensor):
            return f"a {type(value).__name__} under {key!r}"
        elif value.device.type != "cpu":
            return f"a {value.device.type} tensor under {key!r}"
    return None


def _unplannable_buffers(shared: TensorDictBase) -> str | None:
    """Either side's reason for TorchRL's path when its shared buffers hold what
    :func:`unplannable` finds (``None``: nothing)."""
    found = unplannable(shared)
    if found is None:
        return None
    return f"the shared buffers hold {found} (only CPU tensors in plain TensorDicts are planned)"


# --------------------------------------------------------------------------- the worker's side
def switched_off() -> str | None:
    """Why every managed env of this process runs TorchRL's step path by choice: ``STEP_PATH_VAR``
    set to ``"torchrl"`` (``None``: unset, or ``"managed"``). Any other value raises.

    The main process reads it at each start and tells its workers (``WorkerConfig``), so both
    sides follow the main process's environment, whatever process the workers are forked from.

    Example:
        >>> os.environ.get(STEP_PATH_VAR) is None and switched_off() is None
        True
    """
    value = os.environ.get(STEP_PATH_VAR, "managed")
    if value == "managed":
        return None
    if value == "torchrl":
        return f"{STEP_PATH_VAR}=torchrl is set"
    raise ValueError(
        f"{STEP_PATH_VAR}={value!r}: set it to 'torchrl' (TorchRL's step path) or 'managed' (the default)"
    )


def worker_reason(
    shared: Any, non_tensor_keys: Any, flags: Any, worker_idx: Any, switch: str | None = None
) -> str | None:
    """Why a worker leaves its steps to TorchRL's loop (``None``: it plans them itself);
    ``switch``: the main process's :func:`switched_off` at the start."""
    if switch is not None:
        return switch
    if shared is None:
        return "the worker has no shared buffers at start (use_buffers=False or TorchRL 0.15's hand-off)"
    if flags is None or worker_idx is None:
        return "TorchRL < 0.11 answers through events, not shared flags"
    if non_tensor_keys:
        return "the specs have non-tensor entries (answered on the pipe)"
    return _unplannable_buffers(shared)


def kwargs_reason(kwargs: dict[str, Any], switch: str | None = None) -> str | None:
    """:func:`worker_reason` of the worker TorchRL gives ``kwargs``: what that worker decides at
    its start, and what the main process decides for it from the same kwargs (``_hosts``)."""
    return worker_reason(
        kwargs.get(WORKER_KWARGS["shared_buffer"]),
        kwargs.get(WORKER_KWARGS["non_tensor_keys"]),
        kwargs.get(WORKER_KWARGS["done_flags"]),
        kwargs.get(WORKER_KWARGS["worker_index"]),
        switch,
    )


class _Copies:
    """Planned ``update_``: the destination's leaves, copied from a source's same keys.

    A plain ``TensorDict`` source is read through its own dict of entries (what ``get`` ends
    in, without the key normalisation); any other kind through ``get``."""

    __slots__ = ("_plan",)

    def __init__(self, dest: TensorDictBase, keys: Sequence[Key] | None = None) -> None:
        wanted = None if keys is None else set(keys)
        self._plan = [
            (k, (k,) if isinstance(k, str) else k, t)
            for k, t in _leaves(dest)
            if wanted is None or k in wanted
        ]

    def apply(self, source: TensorDictBase) -> None:
        if type(source) is not TensorDict:
            get = source.get
            for key, _, dest in self._plan:
                found = get(key, None)
                if found is not None:
                    dest.copy_(found)
            return
        entries = source._tensordict
        for _, path, dest in self._plan:
            value: Any = entries.get(path[0])
            for depth in range(1, len(path)):
                if type(value) is not TensorDict:
                    value = value.get(path[depth:], None) if isinstance(value, TensorDictBase) else None
                    break
                value = value._tensordict.get(path[depth])
            if value is not None:
                dest.copy_(value)


class WorkerPlan:
    """One worker's steps, answered as TorchRL's loop answers them, with planned copies.

    Built from the worker kwargs TorchRL passes its loop; :meth:`init` runs when the loop is
    sent "init" (it builds the same views of the shared buffer the loop builds then).
    """

    def __init__(
        self,
        env: Callable[[], Any],
        shared: TensorDict,
        reset_keys: Any,
        flags: Any,
        worker_idx: int,
        spin: float = 0.0,
    ) -> None:
        #: The worker's env (a getter: the recorder keeps it weakly).
        self._env = env
        #: Longest spin for the next command (:meth:`await_command`); 0: never spin.
        self._spin = spin
        #: Whether spinning for the next command pays; written by :meth:`await_command`.
        self._spin_rate = SpinRate()
        self._shared = shared
        self._reset_keys = list(reset_keys or ())
        self._flags = flags
        #: The shared flags without the wake-up byte (``_worker`` sets them; a host's steps but
        #: its last write there, ``_hosts``).
        self.quiet_flags = flags
        self._idx = worker_idx
        #: Set by :meth:`init`; until then every command is TorchRL's loop's.
        self.ready = False
        #: Set with ``ready``: a host's first slot waits for it before stepping this one (``_hosts``).
        self._ready_event = threading.Event()
        self._root: TensorDictBase | None = None
        self._next: TensorDictBase | None = None
        self._reset_copies: _Copies | None = None
        self._next_copies: _Copies | None = None
        self._root_copies: _Copies | None = None

    def init(self) -> None:
        self._next = self._shared.get("next")
        self._root = self._shared.exclude("next")
        whole = self._shared.clone(False).unlock_()
        self._reset_copies = _Copies(whole, [_unravel(k) for k in self._reset_keys])
        self._next_copies = _Copies(self._next)
        self._root_copies = _Copies(self._root)
        self.ready = True
        self._ready_event.set()

    def sleep_on_pipe(self) -> None:
        """Never spin for the next command: a host's other slots (``_hosts``), whose steps
        come through the first slot's pipe, would only take the core from it."""
        self._spin = 0.0

    def wait_ready(self) -> None:
        """Until :meth:`init` ran (in this slot's own thread of a host, ``_hosts``)."""
        if not self.ready:
            self._ready_event.wait()

    def await_command(self, poll: Callable[[float], bool]) -> None:
        """Spin, yielding the core, until the pipe has the next command (``poll(0)``) or
        ``spin`` seconds have passed, while such spins usually see it arrive
        (``_done_signal.SpinRate``); the caller then reads it, blocking if it is not there.

        A batched step's next command usually comes a few tens of microseconds after this
        worker answered (the parent reads the outputs and writes the next inputs): catching it
        spinning saves the wake-up of a sleeping process on both sides (the parent's write to
        a pipe a sleeper waits on, and the sleeper's own wake-up)."""
        if self._spin <= 0 or not self._spin_rate.worth_trying():
            return
        until = time.perf_counter() + self._spin
        while not poll(0):
            os.sched_yield()
            if time.perf_counter() >= until:
                self._spin_rate.record(False)
                return
        self._spin_rate.record(True)

    def handle(self, command: str, data: Any) -> bool:
        """Answer ``(command, data)`` if it is ours to answer; False leaves it to TorchRL."""
        if command == "step_and_maybe_reset":
            if data and (set(data) - {"next_td_passthrough_keys"}):
                return False
            self.step_and_maybe_reset(data)
            return True
        if command == "step":
            if data and (set(data) - {"next_td_passthrough_keys"}):
                return False
            self.step(data)
            return True
        if command == "reset":
            self.reset(data)
            return True
        return False

    def _input(self, root: TensorDictBase, data: Any) -> TensorDictBase:
        keys = data.get("next_td_passthrough_keys") if data else None
        if keys is not None:
            assert self._next is not None
            root = root.set("next", self._next.select(*keys))
        return root

    def step_and_maybe_reset(self, data: Any = None, quiet: bool = False) -> None:
        assert self._root is not None and self._next_copies and self._root_copies
        td, root_next = self._env().step_and_maybe_reset(self._input(self._root, data))
        self._next_copies.apply(td.pop("next"))
        self._root_copies.apply(root_next)
        (self.quiet_flags if quiet else self._flags)[self._idx] = 1

    def step(self, data: Any = None) -> None:
        assert self._root is not None and self._next_copies and self._root_copies
        env = self._env()
        out = env.step(self._input(self._root.copy(), data))
        self._next_copies.apply(out.get("next"))
        self._root_copies.apply(getattr(env, STEP_MDP)(out))
        self._flags[self._idx] = 1

    def reset(self, data: Any) -> None:
        assert self._root is not None and self._reset_copies is not None
        selected, kwargs = data
        given = self._root.select(*selected, strict=False) if selected else None
        self._reset_copies.apply(self._env().reset(tensordict=given, **kwargs))
        self._flags[self._idx] = 1


def _unravel(key: Any) -> Key:
    if isinstance(key, tuple):
        return key[0] if len(key) == 1 else key
    return str(key)


# --------------------------------------------------------------------------- the parent's side
def parent_reason(env: Any) -> str | None:
    """Why the env's batched steps run TorchRL's path (``None``: they run ours)."""
    switch = switched_off()
    if switch is not None:
        return switch
    upstream = Upstream(env)
    if upstream.done_flags is None:
        return "TorchRL < 0.11 answers through events, not shared flags"
    if not upstream.use_buffers:
        return "use_buffers=False (no shared buffers)"
    if upstream.non_tensor_keys:
        return "the specs have non-tensor entries (answered on the pipe)"
    parent = upstream.parent_buffer
    if not isinstance(parent, TensorDict):
        return "the shared buffers are lazily stacked (different specs per worker)"
    found = _unplannable_buffers(parent)
    if found is not None:
        return found
    if env.device != parent.device:
        return "the env's device differs from its shared buffers'"
    if upstream.worker_indices is not None and upstream.parent_env is not None:
        return "an indexed view of the env"
    return None


class ParentPlan:
    """The parent's planned copies of one env's shared buffers (made once per start)."""

    def __init__(self, upstream: Upstream) -> None:
        #: The buffer planned for: a new start makes new buffers, and so a new plan.
        self.parent: TensorDict = upstream.parent_buffer
        inputs = [(_unravel(k), self.parent.get(_unravel(k), None)) for k in upstream.input_keys]
        self._inputs = [(k, t) for k, t in inputs if t is not None]
        self.next: TensorDictBase = upstream.next_buffer
        self.root: TensorDictBase = upstream.root_buffer
        self._next_plan = _clone_plan(self.next)
        self._root_plan = _clone_plan(self.root)

    def write_inputs(self, td: TensorDictBase) -> None:
        get = td.get
        for key, dest in self._inputs:
            value = get(key, None)
            if value is not None:
                dest.copy_(value)

    def read_outputs(self) -> tuple[TensorDictBase, TensorDictBase]:
        return _clone(self.next, self._next_plan), _clone(self.root, self._root_plan)


_ClonePlan = list[tuple[str, Any]]


def _clone_plan(td: TensorDictBase) -> _ClonePlan:
    """Each entry: ``(name, tensor)`` or ``(name, (plan, batch_size, device, names))``."""
    plan: _ClonePlan = []
    for name in td.keys():  # noqa: SIM118 (iterating a TensorDict iterates its batch)
        value = td.get(name)
        if isinstance(value, TensorDictBase):  # a plain TensorDict (parent_reason: unplannable)
            plan.append((name, (_clone_plan(value), value.batch_size, value.device, value._maybe_names())))
        else:
            plan.append((name, value))
    return plan


def _clone(td: TensorDictBase, plan: _ClonePlan) -> TensorDict:
    return _build(plan, td.batch_size, td.device, td._maybe_names())


def _build(plan: _ClonePlan, batch_size: Any, device: Any, names: Any) -> TensorDict:
    source: dict[str, Any] = {}
    for name, entry in plan:
        if isinstance(entry, torch.Tensor):
            source[name] = entry.clone()
        else:
            sub, size, dev, sub_names = entry
            source[name] = _build(sub, size, dev, sub_names)
    return TensorDict._new_unsafe(source=source, batch_size=batch_size, device=device, names=names)


class StepPath:
    """Which path one managed env's batched steps take, and how many took ours."""

    __slots__ = ("plan", "reason", "steps")

    def __init__(self) -> None:
        #: The plan of the current buffers (``None``: not made yet, or TorchRL's path); made
        #: and replaced by :meth:`plan_for` only.
        self.plan: ParentPlan | None = None
        #: Why TorchRL's path runs (``None``: ours, or not started yet); written by :meth:`plan_for`.
        self.reason: str | None = "not started yet"
        #: Batched steps our path served; written by :func:`step_and_maybe_reset`.
        self.steps = 0

    def plan_for(self, env: Any) -> ParentPlan | None:
        """The plan of ``env``'s current buffers, made when they changed (``None``: TorchRL's)."""
        upstream = Upstream(env)
        plan = self.plan
        if plan is not None and plan.parent is upstream.parent_buffer:
            return plan
        self.plan = None
        if upstream.closed is not False:
            self.reason = "not started yet"
            return None
        self.reason = parent_reason(env)
        if self.reason is None:
            self.plan = ParentPlan(upstream)
        return self.plan


def step_and_maybe_reset(
    env: Any, path: StepPath, tensordict: TensorDictBase, upstream_call: Callable[[Any], Any]
) -> Any:
    """``env.step_and_maybe_reset(tensordict)`` on our path where the plan covers the call,
    else ``upstream_call(tensordict)`` (TorchRL's): partial steps, a ``"next"`` passed in, a
    collector's excluded keys."""
    plan = path.plan_for(env)
    if (
        plan is None
        or tensordict.get("next", None) is not None
        or tensordict.get("_step", None) is not None
        or _collector_excludes(env)
    ):
        return upstream_call(tensordict)
    with torch.no_grad():
        plan.write_inputs(tensordict)
        slots = range(env.num_workers)
        channels = Upstream(env).channels
        for i in slots:  # every worker told before the wait (a host's slots: once, _hosts)
            channels[i].send(STEP_AND_MAYBE_RESET)
        env._wait_for_workers(slots)
        next_td, root = plan.read_outputs()
    tensordict.set("next", next_td)
    path.steps += 1
    return tensordict, root


def _collector_excludes(env: Any) -> bool:
    method = getattr(type(env), COLLECTOR_EXCLUDES, None)
    return method is not None and bool(method(env))
