"""Everything we rely on inside TorchRL, in one place: feature checks and scoped patches.

Feature detection, not version strings: torchrl 0.10.1 wheels report ``0.0.0+unknown``.

Patches follow one rule (:class:`ScopedPatch`): a module attribute is replaced only while a
managed env needs it, the replacement falls through to whatever was there before for anything
that is not ours, and leaving the scope puts back exactly what was current when it was entered
(a user's, a profiler's or a test's own patch included), unless someone replaced ours in the
meantime, in which case theirs stays.

How a worker learns it is managed: nothing of ours wraps the user's env factory (TorchRL sends
an ``EnvCreator`` through multiprocessing's own pickler so that its shared tensors and
``mp.Value``s stay shared; a wrapper would make TorchRL cloudpickle it, which copies them).
Instead the per-worker ``create_env_kwargs`` dict is swapped, during ``_start_workers`` only, for
a :class:`ConfiguredKwargs`: the same items plus our config, unpacked by our worker entry
before TorchRL's worker function runs, so the factory receives exactly the user's kwargs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchrl.envs import ParallelEnv, batched_envs

from . import _worker
from ._worker import WorkerConfig

__all__ = [
    "HAS_DAEMON_KWARG",
    "HAS_SHUTDOWN_TIMEOUT_KWARG",
    "PRIVATE_ENV_ATTRIBUTES",
    "PRIVATE_MODULE_NAMES",
    "UPSTREAM_DEFAULTS",
    "ConfiguredKwargs",
    "ScopedPatch",
    "SupervisedWorkers",
    "install_fault_check",
    "is_worker_entry",
    "managed_worker_targets",
    "worker_context",
]

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

#: Every private TorchRL name this package relies on, and what for; ``tests/test_compat.py``
#: checks each on the installed release, so a TorchRL change fails there with this text.
#: Names marked ``>=0.11`` / ``>=0.14`` are optional on older releases (we fall back).
PRIVATE_MODULE_NAMES: dict[str, str] = {
    "batched_envs._run_worker_pipe_shared_mem": "worker function; replaced while our workers start",
    "batched_envs._run_worker_pipe_direct": "worker function (use_buffers=False); replaced likewise",
    "batched_envs._check_for_faulty_process": "fault check; ours for our worker lists",
    "batched_envs.get_env_metadata": "spec reader; run in a helper process (metadata_in_subprocess)",
    "batched_envs.gc": "the worker loop's gc.collect() before exit, skipped after a close",
    "_utils._get_default_mp_start_method (>=0.11)": "start method ParallelEnv uses when none given",
    "batched_envs.mp": "torch.multiprocessing as TorchRL uses it; get_context routed to the preloaded server",
}
#: Attributes of a started ``ParallelEnv`` (instance or class) that ``ManagedParallelEnv`` uses.
PRIVATE_ENV_ATTRIBUTES: dict[str, str] = {
    "create_env_kwargs": "per-worker kwargs, passed as env_fun_kwargs; carries our config",
    "_workers": "the worker processes; becomes our SupervisedWorkers list",
    "parent_channels": "the command pipes; wrapped to remember the last command",
    "_mp_start_method": "the start method asked for",
    "_use_buffers": "shared-buffer mode (our done signal needs it)",
    "_events": "per-worker events; cleared on close",
    "BATCHED_PIPE_TIMEOUT": "TorchRL's wait bound, kept by our wait",
    "_start_workers": "overridden: supervision starts here",
    "_shutdown_workers": "overridden: the bounded close",
    "_wait_for_workers (>=0.11)": "overridden: sleep instead of spinning",
    "_shm_done_flags (>=0.11)": "the shared done flags our wait reads",
    "_owns_workers (>=0.14)": "False for an indexed view, which must not close workers",
    "_worker_indices (>=0.14)": "the parent's worker indices of a view",
    "_cleanup_failed_worker_startup (>=0.14)": "overridden: our start-up abort does it",
}


class ScopedPatch:
    """Replace ``module.name`` while at least one scope is active; nest-safe and thread-safe.

    ``make(previous)`` builds the replacement from the value that was current on entry.

    Example:
        >>> import types
        >>> mod = types.SimpleNamespace(f=lambda: "theirs")
        >>> patch = ScopedPatch(mod, "f", lambda previous: lambda: "ours, then " + previous())
        >>> with patch.active():
        ...     mod.f()
        'ours, then theirs'
        >>> mod.f()
        'theirs'
    """

    def __init__(self, module: Any, name: str, make: Callable[[Any], Any]) -> None:
        self._module = module
        self._name = name
        self._make = make
        self._lock = threading.RLock()
        self._depth = 0
        self._previous: Any = None
        self._installed: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        with self._lock:
            if self._depth == 0:
                self._previous = getattr(self._module, self._name)
                self._installed = self._make(self._previous)
                setattr(self._module, self._name, self._installed)
            self._depth += 1
            installed = self._installed
        try:
            yield installed
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    if getattr(self._module, self._name) is self._installed:
                        setattr(self._module, self._name, self._previous)
                    self._previous = self._installed = None


# --------------------------------------------------------------------------- worker entries
class ConfiguredKwargs(dict[str, Any]):
    """A worker's ``create_env_kwargs`` carrying our :class:`WorkerConfig` alongside.

    Pickles its items exactly as the plain dict would (so shared tensors stay shared) and
    is unpacked back into a plain dict in the worker before the factory sees it.
    """

    def __init__(self, items: Any, config: WorkerConfig) -> None:
        super().__init__(items or {})
        self.trx_config = config

    def __reduce__(self) -> tuple[Any, ...]:
        return (ConfiguredKwargs, (dict(self), self.trx_config))


def _resolve_entry(name: str) -> Callable[..., Any]:
    """In a spawned or forkserver child: TorchRL's worker function as that process has it."""
    entry = getattr(importlib.import_module("torchrl.envs.batched_envs"), name)
    found: Callable[..., Any] = entry._previous if isinstance(entry, _ManagedEntry) else entry
    return found


class _ManagedEntry:
    """Stands in for one of TorchRL's worker functions while a managed env starts its workers.

    A worker whose kwargs carry our config is prepared by ``_worker.run_managed``; any other
    (an upstream env started meanwhile from another thread) runs the displaced function as is.
    """

    def __init__(self, name: str, previous: Callable[..., Any]) -> None:
        self._name = name
        self._previous = previous

    def __call__(self, **kwargs: Any) -> None:
        env_kwargs = kwargs.get("env_fun_kwargs")
        if not isinstance(env_kwargs, ConfiguredKwargs):
            self._previous(**kwargs)
            return
        kwargs["env_fun_kwargs"] = dict(env_kwargs)
        config = env_kwargs.trx_config
        _worker.run_managed(self._previous, config, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        previous = self._previous
        module = getattr(previous, "__module__", None)
        qualname = getattr(previous, "__qualname__", None)
        if module == batched_envs.__name__ and qualname == self._name:
            # The child resolves TorchRL's function by name, as upstream's pickled target does.
            return (_rebuild_entry, (self._name, None))
        return (_rebuild_entry, (self._name, previous))


def is_worker_entry(target: Any) -> bool:
    """Whether ``target`` is the target of a managed env's worker process."""
    return isinstance(target, _ManagedEntry)


def _rebuild_entry(name: str, previous: Callable[..., Any] | None) -> _ManagedEntry:
    return _ManagedEntry(name, _resolve_entry(name) if previous is None else previous)


def _entry_patch(name: str) -> ScopedPatch:
    def make(previous: Callable[..., Any]) -> _ManagedEntry:
        return _ManagedEntry(name, previous)

    return ScopedPatch(batched_envs, name, make)


_ENTRY_PATCHES = [_entry_patch(name) for name in ("_run_worker_pipe_shared_mem", "_run_worker_pipe_direct")]


@contextlib.contextmanager
def managed_worker_targets() -> Iterator[None]:
    """While active, ParallelEnv starts workers through our entry points (see the module doc)."""
    with _ENTRY_PATCHES[0].active(), _ENTRY_PATCHES[1].active():
        yield


# --------------------------------------------------------------------------- start context
_route = threading.local()


class _ContextRouter:
    """Stands in for ``torch.multiprocessing`` in ``batched_envs`` while a managed env starts
    its workers from the preloaded fork server: ``get_context`` called by that thread returns
    the preloaded context; everything else (other threads, every other name) is the module's."""

    def __init__(self, previous: Any) -> None:
        self._previous = previous

    def get_context(self, method: str | None = None) -> Any:
        routed = getattr(_route, "context", None)
        if routed is not None:
            return routed
        return self._previous.get_context(method)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._previous, name)


_MP_PATCH = ScopedPatch(batched_envs, "mp", _ContextRouter)


@contextlib.contextmanager
def worker_context(env: Any, context: Any) -> Iterator[None]:
    """While active, ``env._start_workers`` (TorchRL's) starts its processes from ``context``
    (``None``: unchanged). TorchRL reads ``_mp_start_method`` to pick its process class, so
    it is ``"forkserver"`` for the duration and ``None`` again after, as the user left it."""
    if context is None:
        yield
        return
    previous = env.__dict__.get("_mp_start_method")
    env.__dict__["_mp_start_method"] = context.get_start_method()
    _route.context = context
    try:
        with _MP_PATCH.active():
            yield
    finally:
        _route.context = None
        env.__dict__["_mp_start_method"] = previous


# --------------------------------------------------------------------------- fault check
class SupervisedWorkers(list[Any]):
    """The env's ``_workers`` list, carrying the supervisor's fault check.

    TorchRL's ``_check_start`` calls ``_check_for_faulty_process(self._workers)`` before most
    methods; for our workers that check is the supervisor's (which keeps the survivors alive
    and raises our error) instead of TorchRL's (which terminates them and closes the
    ``Process`` objects).
    """

    def __init__(self, processes: list[Any], check_faults: Callable[[], None]) -> None:
        super().__init__(processes)
        self.check_faults = check_faults


class _FaultCheck:
    """Replaces ``batched_envs._check_for_faulty_process``: ours for our lists, theirs otherwise."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, processes: Any) -> Any:
        check = getattr(processes, "check_faults", None)
        if isinstance(processes, SupervisedWorkers) and check is not None:
            check()
            return None
        return self.previous(processes)


_fault_check_lock = threading.Lock()


def install_fault_check() -> None:
    """Route TorchRL's fault check of our worker lists to the supervisor (first start only).

    Installed once, when the first managed env starts, over whatever is current then; every
    other list goes to that function. If something later replaces it, ours is installed again
    on top at the next start, still delegating.
    """
    with _fault_check_lock:
        current = batched_envs._check_for_faulty_process
        if not isinstance(current, _FaultCheck):
            batched_envs._check_for_faulty_process = _FaultCheck(current)


# --------------------------------------------------------------------------- spec reading
def get_env_metadata_patch(make: Callable[[Any], Any]) -> ScopedPatch:
    """A scoped patch of the function ``ParallelEnv.__init__`` reads env specs with."""
    return ScopedPatch(batched_envs, "get_env_metadata", make)
