"""Running one scenario against upstream ``ParallelEnv`` and ``ManagedParallelEnv``, and comparing.

A scenario is a function of the batched-env class. It builds its env exactly like a user
of upstream would (the class is the only difference), runs operations through a
:class:`Record` (which stores each result, or the exception it raised, under a step name)
and closes the env in a ``finally``. :func:`run_variants` runs it once per variant and
:func:`assert_same_as_upstream` compares every variant's record with upstream's, step by step:
tensor values (exactly, unless told otherwise), keys, specs, exception types and messages.
The only difference accepted is the class name in messages (see :func:`normalize`).

Debugging aid: with ``TORCHRL_EXT_CONTRACT_REFERENCE=1`` in the environment the "managed"
variant is :class:`ReferenceParallelEnv`, a subclass of ``ParallelEnv`` that changes nothing.
Every contract test must pass in that mode; a failure there is a bug in the test (a
nondeterministic comparison), not in the library.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.base import _default_is_leaf
from torchrl.data import TensorSpec
from torchrl.envs import ParallelEnv
from torchrl.envs.batched_envs import BatchedEnvBase

from torchrl_ext import ManagedParallelEnv

REFERENCE_VAR = "TORCHRL_EXT_CONTRACT_REFERENCE"

_INIT_PARAMS = inspect.signature(BatchedEnvBase.__init__).parameters
#: TorchRL >= 0.11: ``daemon=`` (default False).
HAS_DAEMON = "daemon" in _INIT_PARAMS
#: TorchRL >= 0.13: ``shutdown_timeout=`` (default 10.0).
HAS_SHUTDOWN_TIMEOUT = "shutdown_timeout" in _INIT_PARAMS
#: ``metadata_from_workers=`` (absent in TorchRL 0.10).
HAS_METADATA_FROM_WORKERS = "metadata_from_workers" in _INIT_PARAMS
#: ``env[idx]`` returns a view sharing the parent's workers (absent in TorchRL 0.10).
HAS_VIEWS = hasattr(BatchedEnvBase, "_make_batched_view")


class ReferenceParallelEnv(ParallelEnv):
    """``ParallelEnv`` itself under another name; stands in for the managed class when
    ``TORCHRL_EXT_CONTRACT_REFERENCE=1`` (module level: picklable by reference)."""


def managed_class() -> type:
    if os.environ.get(REFERENCE_VAR, "") not in ("", "0"):
        return ReferenceParallelEnv
    return ManagedParallelEnv


@dataclass(frozen=True)
class Variant:
    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build the batched env: ``cls(*args, **kwargs, **self.kwargs)``.

        ``mp_start_method="default"`` is the default path: no start method at all. The managed
        class there, with non-daemonic workers, must really be on the preloaded fork server:
        that is the path the case is about."""
        default_path = kwargs.get("mp_start_method") == "default"
        if default_path:
            kwargs = {k: v for k, v in kwargs.items() if k != "mp_start_method"}
        env = self.cls(*args, **kwargs, **self.kwargs)
        if default_path and isinstance(env, ManagedParallelEnv) and not env.daemon_workers:
            assert env.start_method == "preloaded", f"default path not preloaded: {env.start_method}"
        return env


UPSTREAM = Variant("upstream", ParallelEnv)


def variants() -> list[Variant]:
    """Upstream first, then the managed class built exactly like upstream. (A variant may
    add constructor kwargs, e.g. ``Variant("managed(daemon_workers=False)", cls,
    {"daemon_workers": False})``, passed to :func:`run_variants`.)"""
    return [UPSTREAM, Variant("managed", managed_class())]


# --------------------------------------------------------------------------- outcomes
def normalize(text: str, cls: type) -> str:
    """``text`` with the class name of ``cls`` replaced by ``ParallelEnv``."""
    if cls is ParallelEnv:
        return text
    return re.sub(rf"\b{re.escape(cls.__name__)}\b", "ParallelEnv", text)


def drop_traceback_frames(text: str) -> str:
    """A message that embeds a formatted traceback, without its (indented) frame lines.

    What is left: the message's own lines, ``Traceback (most recent call last):`` and the
    exception lines, chained ones included. Frames differ legitimately (a wrapper around
    the user's factory adds one); the exception itself may not.
    """
    return "\n".join(line for line in text.splitlines() if line and not line.startswith((" ", "\t")))


@dataclass(frozen=True)
class Raised:
    """An exception, as the user sees it: its type and its (normalized) message."""

    type: str
    message: str

    @classmethod
    def of(cls, err: BaseException, env_cls: type) -> Raised:
        kind = type(err)
        return cls(f"{kind.__module__}.{kind.__qualname__}", normalize(str(err), env_cls))

    def __str__(self) -> str:
        return f"raised {self.type}: {self.message!r}"


def snapshot(value: Any) -> Any:
    """A copy of ``value`` that no later operation (or closing the env) can change."""
    if isinstance(value, (TensorDictBase, torch.Tensor, TensorSpec)):
        return value.clone()
    if isinstance(value, Mapping):
        items = [(k, snapshot(v)) for k, v in value.items()]
        return type(value)(items) if type(value) in (dict, OrderedDict) else dict(items)
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


class Record:
    """The results of one scenario, step by step, in order."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.steps: dict[str, Any] = {}

    def __call__(
        self,
        name: str,
        fn: Callable[[], Any],
        *,
        describe: Callable[[Any], Any] | None = None,
        message: Callable[[str], str] | None = None,
    ) -> Any:
        """Run ``fn``; store a snapshot of its result (or of ``describe(result)``), or the
        exception it raised (its message passed through ``message``), as ``name``.
        Returns the result (``None`` if it raised)."""
        assert name not in self.steps, f"step name {name!r} used twice"
        try:
            value = fn()
        except Exception as err:
            raised = Raised.of(err, self.cls)
            if message is not None:
                raised = Raised(raised.type, message(raised.message))
            self.steps[name] = raised
            return None
        self.steps[name] = snapshot(value if describe is None else describe(value))
        return value

    def value(self, name: str, value: Any) -> None:
        """Store a value computed by the scenario itself."""
        assert name not in self.steps, f"step name {name!r} used twice"
        self.steps[name] = snapshot(value)


def close_quietly(env: Any) -> None:
    """Close ``env`` if it is open (for ``finally`` blocks: a closed env is not an error)."""
    if env is not None:
        env.close(raise_if_closed=False)


@contextlib.contextmanager
def closing(env: Any) -> Iterator[Any]:
    try:
        yield env
    finally:
        close_quietly(env)


def run_variants(
    scenario: Callable[[Variant, Record], None], variants_: list[Variant] | None = None
) -> dict[str, Record]:
    """Run ``scenario(variant, record)`` once per variant, each after ``torch.manual_seed(0)``
    (random actions are drawn in the main process)."""
    records = {}
    for variant in variants_ if variants_ is not None else variants():
        record = Record(variant.cls)
        torch.manual_seed(0)
        scenario(variant, record)
        records[variant.name] = record
    return records


# --------------------------------------------------------------------------- comparison
def _describe(value: Any) -> str:
    if isinstance(value, Raised):
        return str(value)
    text = repr(value)
    return text if len(text) < 1500 else text[:1500] + "..."


def _fail(path: str, expected: Any, actual: Any, what: str) -> None:
    raise AssertionError(
        f"{path}: {what}\n  upstream: {_describe(expected)}\n  managed:  {_describe(actual)}"
    )


def _leaves(td: TensorDictBase, prefix: tuple[str, ...] = ()) -> dict[Any, Any]:
    """``td``'s leaves by key, walked level by level: tensordict's own leaves, and lazy stacks
    (compared stacked tensordict by stacked tensordict, since entries of different shapes
    cannot be read as one tensor)."""
    found: dict[Any, Any] = {}
    for name, value in td.items():
        path = (*prefix, name)
        if _default_is_leaf(type(value)) or type(value) is LazyStackedTensorDict:
            found[path[0] if len(path) == 1 else path] = value
        else:
            found.update(_leaves(value, path))
    return found


def assert_same(expected: Any, actual: Any, path: str = "result", exact: bool = True) -> None:
    """Assert that ``actual`` (managed) is what ``expected`` (upstream) is, recursively."""
    if isinstance(expected, Raised) or isinstance(actual, Raised):
        if expected != actual:
            _fail(path, expected, actual, "different outcome")
        return
    if type(expected).__name__ != type(actual).__name__:
        _fail(path, expected, actual, f"type {type(expected).__name__} != {type(actual).__name__}")
    if isinstance(expected, LazyStackedTensorDict):
        if expected.stack_dim != actual.stack_dim or len(expected.tensordicts) != len(actual.tensordicts):
            _fail(path, expected, actual, "different lazy stack")
        for i, (e, a) in enumerate(zip(expected.tensordicts, actual.tensordicts, strict=True)):
            assert_same(e, a, f"{path}[stacked {i}]", exact)
        return
    if isinstance(expected, TensorDictBase):
        if expected.batch_size != actual.batch_size:
            _fail(path, expected.batch_size, actual.batch_size, "different batch_size")
        el, al = _leaves(expected), _leaves(actual)
        if sorted(map(str, el)) != sorted(map(str, al)):
            _fail(path, sorted(map(str, el)), sorted(map(str, al)), "different keys")
        for key in el:
            assert_same(el[key], al[key], f"{path}[{key!r}]", exact)
        return
    if isinstance(expected, torch.Tensor):
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            _fail(path, expected, actual, "different dtype or shape")
        if exact:
            if not torch.equal(expected, actual):
                _fail(path, expected, actual, "different values")
        else:
            try:
                torch.testing.assert_close(actual, expected)
            except AssertionError as err:
                _fail(path, expected, actual, f"different values ({err})")
        return
    if isinstance(expected, TensorSpec):
        if expected != actual:
            _fail(path, expected, actual, "different spec")
        return
    if isinstance(expected, Mapping):
        if list(map(str, expected)) != list(map(str, actual)):
            _fail(path, list(expected), list(actual), "different keys (or order)")
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]", exact)
        return
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            _fail(path, expected, actual, "different length")
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]", exact)
        return
    if expected != actual:
        _fail(path, expected, actual, "different value")


def assert_same_as_upstream(records: dict[str, Record], exact: bool = True) -> None:
    """Every variant's steps are upstream's steps, in the same order, with the same results."""
    reference = records[UPSTREAM.name]
    for name, record in records.items():
        if name == UPSTREAM.name:
            continue
        assert list(record.steps) == list(reference.steps), (
            f"{name}: steps {list(record.steps)} != upstream's {list(reference.steps)}"
        )
        for step, expected in reference.steps.items():
            try:
                assert_same(expected, record.steps[step], path=f"step {step!r}", exact=exact)
            except AssertionError as err:
                raise AssertionError(f"[{name} vs upstream] {err}") from None
