"""Where ours steps into TorchRL's start of workers: the patches a managed env's start applies.

Every name patched here is declared in ``_compat``'s inventory (``_SHARED_MEM_ENTRY``,
``_DIRECT_ENTRY``, ``_MP_NAME``, ``_FAULT_CHECK``, ``METADATA_READER``) and patched by the one
rule of :class:`~torchrl_ext._patch.ScopedPatch`; see ``_compat``'s module docstring for how a
worker learns it is managed (:class:`ConfiguredKwargs`, not a wrapped factory).

- worker entries (:func:`managed_worker_targets`): ours stand in for TorchRL's worker
  functions while ``_start_workers`` runs; a worker carrying our config runs ``_worker.run_managed``.
- start context (:func:`worker_context`): ``mp.get_context`` returns the preloaded fork server's
  context to the starting thread only.
- fault check (:func:`install_fault_check`): ``_check_for_faulty_process`` on our worker lists
  (:class:`SupervisedWorkers`) is the supervisor's check.
- spec reading (:func:`get_env_metadata_patch`): where ``ParallelEnv.__init__`` reads specs.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchrl.envs import batched_envs

from . import _worker
from ._compat import (
    _DIRECT_ENTRY,
    _FAULT_CHECK,
    _MP_NAME,
    _SHARED_MEM_ENTRY,
    METADATA_READER,
    WORKER_KWARGS,
    Upstream,
)
from ._patch import ScopedPatch
from ._worker import WorkerConfig

__all__ = [
    "ConfiguredKwargs",
    "SupervisedWorkers",
    "get_env_metadata_patch",
    "install_fault_check",
    "is_worker_entry",
    "managed_worker_targets",
    "worker_context",
]


# --------------------------------------------------------------------------- worker entries
class ConfiguredKwargs(dict[str, Any]):
    """A worker's ``create_env_kwargs`` carrying our :class:`WorkerConfig` alongside.

    Pickles its items exactly as the plain dict would (so shared tensors stay shared) and
    is unpacked back into a plain dict in the worker before the factory sees it.
    """

    def __init__(self, items: Any, config: WorkerConfig, hosted: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__(items or {})
        self.worker_config = config
        #: The worker-function kwargs of the other slots this worker's process hosts (``_hosts``).
        self.hosted = hosted

    def __reduce__(self) -> tuple[Any, ...]:
        return (ConfiguredKwargs, (dict(self), self.worker_config, self.hosted))


def _resolve_entry(name: str) -> Callable[..., Any]:
    """In a spawned or forkserver child: TorchRL's worker function as that process has it."""
    entry = getattr(importlib.import_module(batched_envs.__name__), name)
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

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        key = WORKER_KWARGS["env_kwargs"]
        env_kwargs = kwargs.get(key)
        if args or not isinstance(env_kwargs, ConfiguredKwargs):
            # Not a start of ours: TorchRL >= 0.15's direct loop calls the shared-memory loop
            # positionally, with the env it built, on the shared buffers' hand-off.
            self._previous(*args, **kwargs)
            return
        hosted = [_unpacked(member) for member in env_kwargs.hosted]
        _worker.run_managed(self._previous, *_unpacked(kwargs), hosted)

    def __reduce__(self) -> tuple[Any, ...]:
        previous = self._previous
        module = getattr(previous, "__module__", None)
        qualname = getattr(previous, "__qualname__", None)
        if module == batched_envs.__name__ and qualname == self._name:
            # The child resolves TorchRL's function by name, as upstream's pickled target does.
            return (_rebuild_entry, (self._name, None))
        return (_rebuild_entry, (self._name, previous))


def _unpacked(kwargs: dict[str, Any]) -> tuple[WorkerConfig, dict[str, Any]]:
    """A worker's config, and its kwargs with the user's env kwargs as the plain dict they were."""
    key = WORKER_KWARGS["env_kwargs"]
    configured = kwargs[key]
    kwargs[key] = dict(configured)
    return configured.worker_config, kwargs


def is_worker_entry(target: Any) -> bool:
    """Whether ``target`` is the target of a managed env's worker process."""
    return isinstance(target, _ManagedEntry)


def _rebuild_entry(name: str, previous: Callable[..., Any] | None) -> _ManagedEntry:
    return _ManagedEntry(name, _resolve_entry(name) if previous is None else previous)


def _entry_patch(name: str) -> ScopedPatch:
    def make(previous: Callable[..., Any]) -> _ManagedEntry:
        return _ManagedEntry(name, previous)

    return ScopedPatch(batched_envs, name, make)


_ENTRY_PATCHES = [_entry_patch(name) for name in (_SHARED_MEM_ENTRY, _DIRECT_ENTRY)]


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


_MP_PATCH = ScopedPatch(batched_envs, _MP_NAME, _ContextRouter)


@contextlib.contextmanager
def worker_context(env: Any, context: Any) -> Iterator[None]:
    """While active, ``env._start_workers`` (TorchRL's) starts its processes from ``context``
    (``None``: unchanged). TorchRL reads ``_mp_start_method`` to pick its process class, so
    it is ``"forkserver"`` for the duration and ``None`` again after, as the user left it."""
    if context is None:
        yield
        return
    upstream = Upstream(env)
    previous = upstream.mp_start_method
    upstream.mp_start_method = context.get_start_method()
    _route.context = context
    try:
        with _MP_PATCH.active():
            yield
    finally:
        _route.context = None
        upstream.mp_start_method = previous


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

    @classmethod
    def none(cls) -> SupervisedWorkers:
        """The list of a closed env: no workers, nothing to report."""
        return cls([], _closed_env_check)


def _closed_env_check() -> None:
    """Fault check of a closed env."""


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
        current = getattr(batched_envs, _FAULT_CHECK)
        if not isinstance(current, _FaultCheck):
            setattr(batched_envs, _FAULT_CHECK, _FaultCheck(current))


# --------------------------------------------------------------------------- spec reading
def get_env_metadata_patch(make: Callable[[Any], Any]) -> ScopedPatch:
    """A scoped patch of the function ``ParallelEnv.__init__`` reads env specs with."""
    return ScopedPatch(batched_envs, METADATA_READER, make)
