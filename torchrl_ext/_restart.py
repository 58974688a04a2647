"""Restarting a crashed or hung worker's slot: the policy, the records, the marked transition.

What ``ManagedParallelEnv`` does when a worker is lost with ``max_restarts > 0`` (see
docs/restarts.md): the supervisor has already killed and reaped the worker's tree; the env's
calling thread checks the budget (:class:`RestartBudget`), starts a copy of the slot's original
``multiprocessing.Process`` (recorded unstarted by :func:`recording_starts`) on fresh pipes,
and then either replays an in-flight reset or resets the new env and writes the marked
transition (:func:`mark_transition`) into the slot's shared buffer.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import multiprocessing
import multiprocessing.process
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import ScopedPatch

__all__ = [
    "RESTARTED_KEY",
    "RestartBudget",
    "RestartRecord",
    "add_restart_keys",
    "clear_marks",
    "copy_unstarted",
    "mark_transition",
    "recording_starts",
]

#: The done-spec entry that flags a transition cut short by a worker restart.
RESTARTED_KEY = "worker_restarted"

#: Done entries set on a marked transition (by their last name); every other done entry is False.
_TRUE_ON_MARK = frozenset({"done", "truncated", RESTARTED_KEY})


@dataclass(frozen=True)
class RestartRecord:
    """One restart of a worker slot (``env.restarts`` lists them, oldest first).

    ``cause`` is the dead worker's exit code (``-9`` for SIGKILL), ``"hung"`` (no answer within
    ``step_timeout``) or the name of the exception its env raised (``restart_on_error=True``, or
    a call forwarded to the env, ``env.some_method()``, that failed there).

    Example:
        >>> r = RestartRecord(slot=1, old_pid=41, new_pid=42, cause=-9, command="step",
        ...                   time=0.0, ready_after=0.05)
        >>> print(r)
        slot 1: pid 41 -> 42 after SIGKILL(-9) during 'step'; ready in 0.050s
    """

    slot: int
    old_pid: int | None
    new_pid: int
    cause: int | str | None
    command: str | None
    #: Wall-clock time (``time.time()``) the loss was noticed.
    time: float
    #: Seconds from the loss being noticed to the new worker having built its env.
    ready_after: float

    def __str__(self) -> str:
        from ._errors import format_exitcode

        cause = self.cause if isinstance(self.cause, str) else format_exitcode(self.cause)
        return (
            f"slot {self.slot}: pid {self.old_pid} -> {self.new_pid} after {cause} during "
            f"{self.command or 'no command'!r}; ready in {self.ready_after:.3f}s"
        )


class RestartBudget:
    """At most ``max_restarts`` losses within any ``window`` seconds (``None``: the env's life)."""

    def __init__(self, max_restarts: int, window: float | None) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._times: collections.deque[float] = collections.deque()

    def allows(self, now: float) -> bool:
        """Whether one more loss at ``now`` (monotonic) may be restarted; records it if so."""
        if self.window is not None:
            while self._times and now - self._times[0] > self.window:
                self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        window = "the env's life" if self.window is None else f"{self.window:g}s"
        return f"max_restarts={self.max_restarts} within {window}"


# --------------------------------------------------------------------------- process templates
_recording = threading.local()


def _recording_start(previous: Any) -> Any:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        recorded = getattr(_recording, "into", None)
        if recorded is not None:
            recorded.append(copy.copy(self))  # before start(), which drops target and kwargs
        previous(self)

    start.__wrapped__ = previous  # type: ignore[attr-defined]
    return start


_START_PATCH = ScopedPatch(multiprocessing.process.BaseProcess, "start", _recording_start)


@contextlib.contextmanager
def recording_starts() -> Iterator[list[Any]]:
    """While active, every process this thread starts is recorded, unstarted, in the list
    yielded (TorchRL builds its worker processes in several ways across releases; a copy of
    what it built is the one way to build the same again)."""
    into: list[Any] = []
    _recording.into = into
    try:
        with _START_PATCH.active():
            yield into
    finally:
        _recording.into = None


_counter = itertools.count(1)


def copy_unstarted(template: Any, kwargs: dict[str, Any]) -> Any:
    """A new, unstarted process like ``template`` (recorded by :func:`recording_starts`) with
    ``kwargs`` as its target's keyword arguments."""
    process = copy.copy(template)
    process._config = dict(template._config)
    process._popen = None
    process._closed = False
    process._kwargs = kwargs
    base = template._name.rsplit("-", 1)[0] if "-" in template._name else template._name
    process._name = f"{base}-restart{next(_counter)}"
    return process


# --------------------------------------------------------------------------- specs and marks
def add_restart_keys(env: Any) -> list[str]:
    """Add ``truncated`` (if missing) and :data:`RESTARTED_KEY` to a batched env's done spec and
    shared-buffer template, shaped like its root ``done``. Returns the keys added.

    The spec and the template are replaced by extended copies: TorchRL shares them with the
    env's metadata (and so with indexed views), which must keep describing the workers' env.
    """
    done_spec = env.output_spec["full_done_spec"]
    names = list(done_spec.keys())
    if "done" not in names:
        raise ValueError(
            "max_restarts needs a root 'done' entry in the env's done spec to mark restarted "
            f"transitions; this env's done keys are {list(done_spec.keys(True, True))}"
        )
    added = [name for name in ("truncated", RESTARTED_KEY) if name not in names]
    if not added:
        return added
    extended = done_spec.clone()
    for name in added:
        extended[name] = done_spec["done"].clone()
    with _unlocked(env.output_spec):
        env.output_spec["full_done_spec"] = extended
    template = env.__dict__.get("_env_tensordict")
    if template is not None:
        template = template.clone()
        for name in added:
            for key in (name, ("next", name)):
                like = template.get(("next", "done") if isinstance(key, tuple) else "done", None)
                if like is None:
                    like = template.get(("next", "done"))
                template.set(key, torch.zeros_like(like))
        env.__dict__["_env_tensordict"] = template
    return added


@contextlib.contextmanager
def _unlocked(spec: Any) -> Iterator[None]:
    locked = bool(getattr(spec, "locked", False))
    if locked:
        spec.unlock_()
    try:
        yield
    finally:
        if locked:
            spec.lock_()


def mark_transition(
    slot_td: Any,
    obs_keys: Sequence[Any],
    reward_keys: Sequence[Any],
    done_keys: Sequence[Any],
    fresh: Any = None,
) -> None:
    """Write a restarted slot's transition into its shared buffer ``slot_td``: the next
    observation is the fresh env's reset observation (``fresh``, as recorded when it answered,
    written to the root too; else the root's), rewards are 0,
    ``done``/``truncated``/``worker_restarted`` are True and every other done entry False."""
    nxt = slot_td.get("next")
    source = slot_td if fresh is None else fresh
    for key in obs_keys:
        nxt.get(key).copy_(source.get(key))
        if fresh is not None:  # the root is the new env's too (step_and_maybe_reset reads it)
            slot_td.get(key).copy_(fresh.get(key))
    for key in reward_keys:
        nxt.get(key).zero_()
    for key in done_keys:
        last = key if isinstance(key, str) else key[-1]
        nxt.get(key).fill_(last in _TRUE_ON_MARK)


def clear_root_marks(td: Any, keys: Sequence[str]) -> None:
    """Set the root entries of ``keys`` in ``td`` to False: no env writes them on reset, and a
    partial reset copies whatever the caller's tensordict held (a marked step's next root) into
    the shared buffer. Marks live in ``"next"`` only."""
    for key in keys:
        value = td.get(key, None)
        if value is not None:
            value.zero_()


def clear_marks(slot_td: Any, keys: Sequence[str]) -> None:
    """Reset the done entries only restarts write (the env never does) back to False."""
    nxt = slot_td.get("next")
    for key in keys:
        nxt.get(key).zero_()
