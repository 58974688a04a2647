"""Everything we rely on inside TorchRL, declared in one place: the typed adapter, feature checks.

Feature detection, not version strings where a probe exists: torchrl 0.10.1 wheels report
``0.0.0+unknown`` as ``torchrl.__version__``; :func:`torchrl_release` reads the module first, then
the installed distribution's metadata (``torchrl`` or ``torchrl-nightly``).

**The adapter.** Every private TorchRL name this package uses is declared once here, with what it
is for, and read or written only through what declares it: :class:`Upstream` (a batched env's
private attributes, through its instance ``__dict__``: ``ParallelEnv.__getattr__`` forwards an
unknown name to the workers, and restarts closed ones), the module-level names
(:func:`_module_name`), the worker function's keyword arguments (:data:`WORKER_KWARGS`), the
worker loop's commands (:data:`COMMANDS`) and the methods we override (:data:`HOOKS`). The
declarations make :data:`INVENTORY`, which ``tests/test_compat.py`` checks on the installed
release (:func:`missing`), and every env at construction (:func:`check_supported`): a rename
upstream fails there, naming what it was for.

The patches of those names live in ``_intercept`` (worker entries, start context, fault check,
spec reading) and follow one rule (:class:`~torchrl_ext._patch.ScopedPatch`): a module
attribute is replaced only while a managed env needs it, the replacement falls through to
whatever was there before for anything that is not ours, and leaving the scope puts back
exactly what was current when it was entered (a user's, a profiler's or a test's own patch
included), unless someone replaced ours in the meantime, in which case theirs stays.

How a worker learns it is managed: nothing of ours wraps the user's env factory (TorchRL sends
an ``EnvCreator`` through multiprocessing's own pickler so that its shared tensors and
``mp.Value``s stay shared; a wrapper would make TorchRL cloudpickle it, which copies them).
Instead the per-worker ``create_env_kwargs`` dict is swapped, during ``_start_workers`` only, for
a :class:`~torchrl_ext._intercept.ConfiguredKwargs`: the same items plus our config, unpacked
by our worker entry before TorchRL's worker function runs, so the factory receives exactly the user's kwargs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import inspect
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

import torchrl
from torchrl.envs import ParallelEnv, batched_envs

from ._errors import UnsupportedTorchRLError

__all__ = [
    "COLLECTOR_EXCLUDES",
    "COMMANDS",
    "HAS_DAEMON_KWARG",
    "HAS_SHUTDOWN_TIMEOUT_KWARG",
    "HOOKS",
    "INVENTORY",
    "NO_PIPE_ANSWER",
    "PER_START_KWARGS",
    "STEP_MDP",
    "TESTED_RELEASES",
    "TESTED_TORCHRL",
    "UPSTREAM_DEFAULTS",
    "WORKER_KWARGS",
    "Installed",
    "Private",
    "Upstream",
    "check_supported",
    "default_start_method",
    "describe_factory",
    "missing",
    "torchrl_default_start_method",
    "torchrl_release",
]

Release = tuple[int, int]


def torchrl_release() -> Release:
    """``(major, minor)`` of the installed TorchRL: its ``__version__``, else the metadata of the
    ``torchrl`` or ``torchrl-nightly`` distribution (a nightly's date sorts after every release).

    Example:
        >>> torchrl_release() >= (0, 10)
        True
    """
    for version in _versions():
        found = re.match(r"(\d+)\.(\d+)", version)
        if found is not None and found.groups() != ("0", "0"):
            return int(found.group(1)), int(found.group(2))
    return (0, 0)


def _versions() -> Iterator[str]:
    """TorchRL's version strings, most trusted first, each looked up only when the ones before
    it do not tell (reading a distribution's metadata takes milliseconds)."""
    yield str(getattr(torchrl, "__version__", ""))
    for dist in ("torchrl", "torchrl-nightly"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        yield version


# --------------------------------------------------------------------------- the inventory
Kind = Literal["module", "env", "view", "class", "hook", "worker_kwarg", "command"]


@dataclass(frozen=True)
class Private:
    """One TorchRL name we rely on: where it lives, what for, and from which release on it
    must exist (``since``; ``None``: every supported release). Rows of :data:`INVENTORY`."""

    kind: Kind
    name: str
    purpose: str
    since: Release | None = None

    def __str__(self) -> str:
        since = "" if self.since is None else f" (>={self.since[0]}.{self.since[1]})"
        return f"{self.kind} {self.name}{since}: {self.purpose}"


#: Every private TorchRL name this package uses (filled by the declarations below).
INVENTORY: list[Private] = []


def _declare(kind: Kind, name: str, purpose: str, since: Release | None = None) -> str:
    INVENTORY.append(Private(kind, name, purpose, since))
    return name


def _module_name(name: str, purpose: str, since: Release | None = None) -> str:
    """Declare ``torchrl.envs.batched_envs.<name>`` (or ``torchrl.<module>.<name>``)."""
    return _declare("module", name, purpose, since)


T = TypeVar("T")


class _Attr(Generic[T]):
    """A private attribute of a batched env, declared in the inventory, read and written through
    the instance ``__dict__`` (``None`` when absent): never through ``ParallelEnv.__getattr__``."""

    def __init__(self, name: str, purpose: str, since: Release | None = None, kind: Kind = "env") -> None:
        self.name = _declare(kind, name, purpose, since)

    @overload
    def __get__(self, obj: None, owner: type) -> _Attr[T]: ...
    @overload
    def __get__(self, obj: Upstream, owner: type) -> T: ...
    def __get__(self, obj: Upstream | None, owner: type) -> T | _Attr[T]:
        if obj is None:
            return self
        return obj.env.__dict__.get(self.name)

    def __set__(self, obj: Upstream, value: T) -> None:
        obj.env.__dict__[self.name] = value

    def drop(self, obj: Upstream) -> None:
        obj.env.__dict__.pop(self.name, None)


#: Worker kwargs (TorchRL's names) made anew for each replacement: its pipes and event.
PER_START_KWARGS = tuple(
    _declare("worker_kwarg", name, "made anew for each replacement worker")
    for name in ("parent_pipe", "child_pipe", "mp_event")
)
#: Worker kwargs our worker entry reads or wraps, by role.
WORKER_KWARGS = {
    "env_kwargs": _declare("worker_kwarg", "env_fun_kwargs", "the factory's kwargs; carries our config"),
    "pipe": PER_START_KWARGS[1],
    "factory": _declare("worker_kwarg", "env_fun", "the env factory; the worker keeps the env it builds"),
    "done_flags": _declare("worker_kwarg", "shm_done_flags", "wrapped to wake the sleeping parent", (0, 11)),
    "worker_index": _declare("worker_kwarg", "worker_idx", "the worker's done flag (step path)", (0, 11)),
    "shared_buffer": _declare("worker_kwarg", "shared_tensordict", "the slot's shared buffer (step path)"),
    "reset_keys": _declare("worker_kwarg", "_selected_reset_keys", "what a reset writes (step path)"),
    "non_tensor_keys": _declare("worker_kwarg", "_non_tensor_keys", "non-tensor specs: TorchRL's path"),
}

#: Commands TorchRL's worker loop answers through the shared buffers and done flags only (with
#: restarts, specs are tensor-only: no non-tensor answer on the pipe either).
NO_PIPE_ANSWER = frozenset(
    _declare("command", name, "answered by the done flag or event only")
    for name in ("init", "reset", "step", "step_and_maybe_reset", "close", "load_state_dict")
)
#: Every command of TorchRL's worker loop; anything else sent is a call forwarded to the env.
COMMANDS = NO_PIPE_ANSWER | {
    _declare("command", "seed", "answered on the pipe"),
    _declare("command", "state_dict", "answered on the pipe"),
    # Seen in 0.14.1, not in 0.10.1 (the releases between are not checked here).
    _declare("command", "set_env_snapshot", "answered on the pipe", (0, 14)),
}

#: ``ParallelEnv`` methods ``ManagedParallelEnv`` overrides (TorchRL must still call them).
HOOKS = {
    name: _declare("hook", name, purpose, since)
    for name, purpose, since in (
        ("_start_workers", "supervision starts here", None),
        ("_shutdown_workers", "the bounded close", None),
        ("_set_properties", "restarts add their done entries", None),
        ("_reset", "failures and marks around a reset", None),
        ("_step", "failures around a step", None),
        ("_wait_for_workers", "sleep instead of spinning; restarts and hangs", (0, 11)),
        ("_make_batched_view", "restarts reach a view's worker lists", (0, 14)),
        ("_cleanup_failed_worker_startup", "our start-up abort does it", (0, 14)),
        ("_send_worker_buffers", "the buffers' hand-off, recorded for replacements (#4341)", (0, 15)),
    )
}


#: TorchRL >= 0.14: the next keys a registered collector drops (the step path leaves such
#: calls to TorchRL's own ``step_and_maybe_reset``).
COLLECTOR_EXCLUDES = _declare(
    "class", "_get_collector_next_keys_to_exclude", "a collector's dropped keys: TorchRL's step path", (0, 14)
)

#: ``EnvBase._step_mdp``: the root TorchRL's worker loop writes after a plain ``step`` (the
#: step path's worker makes it the same way).
STEP_MDP = _declare("class", "_step_mdp", "the worker's next root after a plain step (step path)")

_PIPE_TIMEOUT = _module_name("_utils.BATCHED_PIPE_TIMEOUT", "TorchRL's wait bound before a start sets it")


class Upstream:
    """Typed access to one TorchRL batched env's private state: the one place that names it.

    Cheap to make (one slot); make one where needed rather than keeping it (no reference cycle).

    Example:
        >>> Upstream.done_flags.name
        '_shm_done_flags'
    """

    __slots__ = ("env",)

    env_kwargs: _Attr[list[Any]] = _Attr("create_env_kwargs", "per-worker kwargs; carry our config")
    factories: _Attr[Any] = _Attr("create_env_fn", "per-worker factories; named in start-up errors")
    workers: _Attr[Any] = _Attr("_workers", "the worker processes; become our SupervisedWorkers list")
    channels: _Attr[list[Any]] = _Attr("parent_channels", "the command pipes; wrapped by the supervisor")
    mp_start_method: _Attr[str | None] = _Attr("_mp_start_method", "the start method asked for")
    use_buffers: _Attr[bool | None] = _Attr(
        "_use_buffers", "shared-buffer mode (restarts and our wait need it); None: not resolved yet"
    )
    metadata_from_workers: _Attr[bool | None] = _Attr(
        "_metadata_from_workers", "workers report the specs; >= 0.15 resolves use_buffers after", (0, 14)
    )
    non_tensor_keys: _Attr[list[Any]] = _Attr("_non_tensor_keys", "restarts refuse non-tensor specs")
    events: _Attr[list[Any] | None] = _Attr("_events", "per-worker done events (TorchRL 0.10)")
    step_event: _Attr[Any] = _Attr("event", "the env's CUDA event; cleared on close")
    done_flags: _Attr[Any] = _Attr("_shm_done_flags", "the shared done flags our wait reads", (0, 11))
    slot_buffers: _Attr[list[Any]] = _Attr("shared_tensordicts", "each slot's shared buffer (marks)")
    parent_buffer: _Attr[Any] = _Attr("shared_tensordict_parent", "the stacked buffer (root marks)")
    obs_keys: _Attr[list[Any]] = _Attr("_env_obs_keys", "observation keys a mark copies")
    buffer_template: _Attr[Any] = _Attr("_env_tensordict", "shared-buffer template; gains restart keys")
    closed: _Attr[bool] = _Attr("is_closed", "whether the workers are gone")
    parent_env: _Attr[Any] = _Attr("_parent_env", "the owner of an indexed view", (0, 14), kind="view")
    worker_indices: _Attr[Sequence[int] | None] = _Attr(
        "_worker_indices", "the owner's worker slots of a view", (0, 14), kind="view"
    )
    owns_workers_flag: _Attr[bool | None] = _Attr(
        "_owns_workers", "False for a view, which must not close workers", (0, 14), kind="view"
    )
    input_keys: _Attr[list[Any]] = _Attr("_env_input_keys", "the keys a step writes (step path)")
    next_buffer: _Attr[Any] = _Attr("_shared_tensordict_parent_next", "the stacked next outputs (step path)")
    root_buffer: _Attr[Any] = _Attr("_shared_tensordict_parent_root", "the stacked root outputs (step path)")
    batched_pipe_timeout: _Attr[float | None] = _Attr("BATCHED_PIPE_TIMEOUT", "the wait bound, kept by ours")

    def __init__(self, env: Any) -> None:
        self.env = env

    @property
    def owner(self) -> Upstream:
        """The env that owns the workers: this one, or the parent of an indexed view."""
        parent = self.parent_env
        return self if parent is None else Upstream(parent)

    @property
    def owns_workers(self) -> bool:
        return self.owns_workers_flag is not False

    @property
    def pipe_timeout(self) -> float:
        value = self.batched_pipe_timeout  # set by TorchRL's start from torchrl._utils
        if value is None:
            module, _, name = _PIPE_TIMEOUT.rpartition(".")
            value = getattr(importlib.import_module(f"torchrl.{module}"), name)
        return float(value)

    def slots(self, positions: Any) -> list[int]:
        """The owner's worker slots behind ``positions`` of this env (a view's are a subset)."""
        indices = self.worker_indices
        return list(positions) if indices is None else [indices[i] for i in positions]

    def position_of(self, slot: int) -> int | None:
        """Where the owner's worker ``slot`` sits in this env's lists (``None``: not there)."""
        indices = self.worker_indices
        if indices is None:
            return slot
        indices = list(indices)
        return indices.index(slot) if slot in indices else None

    def factory_of(self, slot: int) -> Any:
        """The factory TorchRL calls for the owner's worker ``slot`` (one for all, or a list)."""
        factories = self.owner.factories
        return factories[slot] if isinstance(factories, list | tuple) and slot < len(factories) else factories

    def drop_buffers(self) -> None:
        """Forget the shared buffers (a later start makes new ones)."""
        for attr in (Upstream.slot_buffers, Upstream.parent_buffer):
            attr.drop(self)


def unwrap_factory(fn: Any) -> Any:
    """The user's own callable inside what TorchRL (``EnvCreator``, ``CloudpickleWrapper``)
    or ``functools.partial`` wrapped it in."""
    for _ in range(8):
        inner = getattr(fn, "create_env_fn", None) or getattr(fn, "func", None) or getattr(fn, "fn", None)
        if inner is None or inner is fn:
            break
        fn = inner
    return fn


def describe_factory(fn: Any) -> str:
    """A factory as a user recognises it: ``module.name``, or its repr."""
    inner = unwrap_factory(fn)
    name = getattr(inner, "__qualname__", None)
    module = getattr(inner, "__module__", None)
    return f"{module}.{name}" if name and module else repr(fn)


_init_params = inspect.signature(ParallelEnv.__init__).parameters
#: TorchRL >= 0.11: workers' daemon flag is configurable (``daemon=``).
HAS_DAEMON_KWARG = "daemon" in _init_params
#: TorchRL >= 0.13: ``shutdown_timeout=`` exists upstream.
HAS_SHUTDOWN_TIMEOUT_KWARG = "shutdown_timeout" in _init_params


def _default_of(name: str, fallback: Any) -> Any:
    param = _init_params.get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return fallback
    return param.default


#: The installed TorchRL's own defaults; ``ManagedParallelEnv`` uses the same.
#: 0.10 has no ``daemon`` argument (workers are always daemonic) and waits 10 s on close.
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "daemon": bool(_default_of("daemon", True)),
    "shutdown_timeout": float(_default_of("shutdown_timeout", 10.0)),
    #: Threads TorchRL gives each worker (``torch.set_num_threads`` there).
    "num_sub_threads": int(_default_of("num_sub_threads", 1)),
    "raise_if_closed": bool(
        inspect.signature(ParallelEnv.close).parameters["raise_if_closed"].default
        if "raise_if_closed" in inspect.signature(ParallelEnv.close).parameters
        else True
    ),
}

_SHARED_MEM_ENTRY = _module_name("_run_worker_pipe_shared_mem", "worker function; replaced while ours start")
_DIRECT_ENTRY = _module_name("_run_worker_pipe_direct", "worker function (use_buffers=False); likewise")
_FAULT_CHECK = _module_name("_check_for_faulty_process", "fault check; ours for our worker lists")
METADATA_READER = _module_name("get_env_metadata", "spec reader; run in a helper process")
GC_NAME = _module_name("gc", "the worker loop's gc.collect() before exit, skipped after a close")
_MP_NAME = _module_name("mp", "torch.multiprocessing as TorchRL uses it; routed to the preloaded server")
_DEFAULT_START = _module_name(
    "_utils._get_default_mp_start_method", "start method ParallelEnv uses when none is given", (0, 11)
)


def torchrl_default_start_method() -> str | None:
    """TorchRL's own default start method (``None``: this TorchRL has none, 0.10)."""
    module, _, name = _DEFAULT_START.rpartition(".")
    getter = getattr(importlib.import_module(f"torchrl.{module}"), name, None)
    return str(getter()) if callable(getter) else None


def default_start_method(requested: str | None = None) -> str:
    """The start method ``ParallelEnv`` uses for ``mp_start_method=requested`` (the one copy)."""
    if requested is not None:
        return requested
    return torchrl_default_start_method() or "spawn"  # TorchRL 0.10: spawn when none is given


# --------------------------------------------------------------------------- the check
#: The TorchRL builds the test suites run on (``make test``), by distribution version: 0.15 as
#: the nightly build that stands in for it until the registry serves 0.15.0.
TESTED_TORCHRL = ("0.10.1", "0.14.1", "2026.10.27")
#: The same, as errors and the doctor name them.
TESTED_RELEASES = "0.10.1, 0.14.1 and 0.15 (as torchrl-nightly 2026.10.27)"


@dataclass(frozen=True)
class Installed:
    """Where each kind of inventory row is looked up on the installed TorchRL. ``env`` and
    ``view`` (a started batched env and an indexed view of it) are optional: without them,
    their rows are not checked."""

    modules: Mapping[str, Any]
    env_class: Any
    worker_params: frozenset[str]
    loop_source: str
    env: Any = None
    view: Any = None

    @classmethod
    def read(cls, env: Any = None, view: Any = None) -> Installed:
        params, loop_source = _defined(batched_envs, "_run_worker_pipe_shared_mem")
        return cls(
            modules={"": batched_envs, "_utils": importlib.import_module("torchrl._utils")},
            env_class=ParallelEnv,
            worker_params=params,
            loop_source=loop_source,
            env=env,
            view=view,
        )


def _defined(module: Any, name: str) -> tuple[frozenset[str], str]:
    """The parameter names and source of the function ``module``'s file defines as ``name``
    (nothing when it defines none): TorchRL's own, whatever a user has patched in its place.

    Parsing all of ``batched_envs`` takes a twentieth of a second, most of a warm start's cost
    at one worker: the top-level definition is cut out of the source and parsed alone
    (:func:`_top_level_def`), the whole file only where that cut does not parse to it.
    """
    source = inspect.getsource(module)
    cut = _top_level_def(source, name)
    if cut is None:
        tree = ast.parse(source)
        node = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if node is None:
            return frozenset(), ""
        cut = node, ast.get_source_segment(source, node) or ""
    node, segment = cut
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return frozenset(p.arg for p in params), segment


#: A line that starts a top-level statement: not indented, blank, a comment or a closing bracket.
_TOP_LEVEL_LINE = re.compile(r"^(?![\s#)\]}]|$)", re.M)


def _top_level_def(source: str, name: str) -> tuple[ast.FunctionDef, str] | None:
    """The first top-level ``def name`` of ``source`` and its source, parsed from its own
    lines (from the ``def`` to the next top-level statement); ``None`` where that text is not
    one function of that name (a nested definition, a cut inside a string): then the caller
    parses the whole file, whose first match (``ast.walk`` goes level by level) is the same."""
    start = re.search(rf"^def[ \t]+{re.escape(name)}\b", source, re.M)
    if start is None:
        return None
    end = _TOP_LEVEL_LINE.search(source, start.end())
    text = source[start.start() : end.start() if end is not None else len(source)]
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef) or body[0].name != name:
        return None
    # What ast.get_source_segment gives, without its line splitting in Python (a few ms over a
    # long function): the text from the def (line 1, column 0) to the node's end, which the
    # whole file's parse puts at its last statement, not at trailing blanks. Lines end as the
    # parser ends them (\n, \r\n, \r); the end column counts UTF-8 bytes.
    node = body[0]
    end_line, end_col = node.end_lineno, node.end_col_offset
    if end_line is None or end_col is None:
        return None
    lines = io.StringIO(text, newline="").readlines()[:end_line]
    lines[-1] = lines[-1].encode()[:end_col].decode()
    return node, "".join(lines)


def _has(target: Any, name: str) -> bool:
    return target is not None and (name in vars(target) or hasattr(type(target), name))


def missing(installed: Installed, release: Release) -> list[Private]:
    """The inventory rows ``installed`` lacks (rows newer than ``release`` are not required)."""
    found = []
    for row in INVENTORY:
        if row.since is not None and release < row.since:
            continue
        if row.kind == "module":
            module, _, attr = row.name.rpartition(".")
            present = hasattr(installed.modules[module], attr)
        elif row.kind in ("env", "view"):
            target = installed.env if row.kind == "env" else installed.view
            present = target is None or _has(target, row.name)
        elif row.kind in ("class", "hook"):
            present = hasattr(installed.env_class, row.name)
        elif row.kind == "worker_kwarg":
            present = row.name in installed.worker_params
        else:  # a command: TorchRL's worker loop compares against its name
            present = re.search(rf"""["']{re.escape(row.name)}["']""", installed.loop_source) is not None
        if not present:
            found.append(row)
    return found


@functools.cache
def check_supported() -> None:
    """Raise :class:`UnsupportedTorchRLError` if the installed TorchRL lacks a name of the
    inventory that can be checked without an env (all but instance attributes); once."""
    lacking = missing(Installed.read(), torchrl_release())
    if lacking:
        version = str(getattr(torchrl, "__version__", "?"))
        raise UnsupportedTorchRLError(version, [str(row) for row in lacking], TESTED_RELEASES)
