"""How workers start: the start policy, fixed when an env is built (:func:`preload_modules`:
whether workers are forks of the preloaded server, and with which modules), and the start plan,
computed once per start (:class:`StartPlan`: context, start method, the parent-death rule, the
workers' own start method, the owner's identity). A replacement starts by the same plan.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from dataclasses import dataclass
from typing import Any

from . import _cpython, _forkserver, _identity, _lifecycle, _platform, _reaper_client
from ._compat import UPSTREAM_DEFAULTS, default_start_method, unwrap_factory
from ._errors import DaemonicParentError
from ._metadata import metadata_in_subprocess
from ._options import Options
from ._tag import Tag, new_env_tag, tagged_starts

__all__ = [
    "StartPlan",
    "child_start_method",
    "factory_modules",
    "preload_modules",
    "preload_refusal",
    "preloaded_context",
    "spec_reader",
    "start_fork_server",
]

_NOT_PRELOADED = ("__main__", _cpython.MAIN_IMPORTED_AS, "builtins")


def factory_modules(create_env_fn: Any) -> list[str]:
    """Modules defining the env factories (``__main__`` is preloaded through its path)."""
    fns = list(create_env_fn) if isinstance(create_env_fn, list | tuple) else [create_env_fn]
    found: list[str] = []
    for fn in fns:
        fn = unwrap_factory(fn)
        module = getattr(fn, "__module__", None)
        if not isinstance(module, str):
            module = type(fn).__module__
        if module in _NOT_PRELOADED or module.split(".")[0] in ("torchrl", "functools"):
            continue
        if module not in found:
            found.append(module)
    return found


def preload_refusal(
    preload: bool | tuple[str, ...], daemon_workers: bool, mp_start_method: str | None
) -> str | None:
    """Why workers will not be forks of the preloaded server (``None``: they will).

    Example:
        >>> preload_refusal(True, False, "spawn")
        'mp_start_method is given'
    """
    if preload is False:
        return "preload=False"
    if daemon_workers:
        return "daemonic workers (they may not have children)"
    if mp_start_method is not None:
        return "mp_start_method is given"
    if _forkserver.start_method_chosen_by_user():
        return "the program chose a global start method (multiprocessing.set_start_method)"
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "this platform has no forkserver start method"
    return None


def preload_modules(
    options: Options, create_env_fn: Any, mp_start_method: str | None
) -> tuple[str, ...] | None:
    """The modules the preloaded server is asked for (base ones excluded); ``None``: not used."""
    if preload_refusal(options.preload, options.daemon_workers, mp_start_method) is not None:
        return None
    return (*factory_modules(create_env_fn), *options.extra_preload)


def preloaded_context(modules: tuple[str, ...] | None) -> Any:
    """The preloaded server's context (the server running) if ``modules`` is not ``None``."""
    if modules is None:
        return None
    _lifecycle.install_exit_hook()  # stops the server at exit, after every env is closed
    return _forkserver.context(modules)


def start_fork_server(*modules: str) -> str:
    """Start the preloaded fork server now, the one every ``ManagedParallelEnv`` without
    ``mp_start_method`` forks its workers from, and say how it started.

    Call it at the top of the program, under ``if __name__ == "__main__":``, before anything
    starts a thread: the server is then a fork of this process (``"zygote"``), which has
    imported torch and TorchRL already, and the first env starts in a fraction of a second.
    Where this process is not provably safe to fork (another thread runs, CUDA is initialised,
    an OpenMP pool started), the server is a new interpreter that imports them again
    (``"interpreter"``, seconds; the reason is logged and shown in ``stats()``, ``python -m
    torchrl_ext status`` and ``doctor``). A server already running is kept. ``modules`` are
    imported by the server too (as ``ManagedParallelEnv(preload=[...])``). It is stopped at
    exit, after every env is closed.

    Example:
        >>> import torchrl_ext
        >>> torchrl_ext.start_fork_server() in ("zygote", "interpreter")
        True
    """
    preloaded_context(tuple(modules))
    kind = _forkserver.server_kind()[0]
    assert kind is not None  # the server runs: preloaded_context raised otherwise
    return kind


def child_start_method(options: Options, modules: tuple[str, ...] | None) -> str | None:
    """Default start method inside each worker (see ``child_start_method``)."""
    if options.child_start_method is not None:
        return options.child_start_method
    return "fork" if modules is not None else None


def spec_reader(options: Options, modules: tuple[str, ...] | None, kwargs: dict[str, Any]) -> Any:
    """Around ``ParallelEnv.__init__``: with ``metadata_in_subprocess``, the env TorchRL reads
    the specs from is built in a supervised one-shot process started as the workers will be."""
    if not options.metadata_in_subprocess:
        return contextlib.nullcontext()
    current = multiprocessing.current_process()
    if current.daemon:
        raise DaemonicParentError(current.name)
    tag = new_env_tag()
    return metadata_in_subprocess(
        preloaded_context(modules) or default_start_method(kwargs.get("mp_start_method")),
        Tag(tag.owner_pid, tag.owner_create_time, tag.env_id + ".meta"),
        f"ManagedParallelEnv[{tag.env_id}]",
        child_start_method(options, modules),
        int(kwargs.get("num_sub_threads", UPSTREAM_DEFAULTS["num_sub_threads"])),
    )


@dataclass(frozen=True)
class StartPlan:
    """How one start goes, computed once when it begins (:meth:`make`)."""

    #: The preloaded server's context, or ``None`` (TorchRL's own start method).
    context: Any
    #: What the workers' processes are: ``"forkserver"`` for the preloaded server's.
    start_method: str
    #: NOTE [tagged at birth] and the parent-death rule (``_platform``), for this thread.
    arm_pdeathsig: bool
    child_start_method: str | None
    owner: _identity.ProcessKey
    preload_modules: tuple[str, ...] | None
    #: The preloaded server's kind and why it is not a zygote (``_forkserver.server_kind``).
    server: tuple[str | None, str | None] = (None, None)

    @classmethod
    def make(
        cls, options: Options, modules: tuple[str, ...] | None, mp_start_method: str | None
    ) -> StartPlan:
        context = preloaded_context(modules)  # raises PreloadError before anything started
        start_method = "forkserver" if context is not None else default_start_method(mp_start_method)
        return cls(
            context=context,
            start_method=start_method,
            arm_pdeathsig=_platform.parent_death_outlives_worker(start_method),
            child_start_method=child_start_method(options, modules),
            owner=_identity.me(),
            preload_modules=modules,
            server=_forkserver.server_kind() if context is not None else (None, None),
        )

    @property
    def worker_context(self) -> Any:
        """The context of the workers' pipes and events (a replacement needs the same)."""
        return self.context or multiprocessing.get_context(self.start_method)

    def tagged(self, tag: Tag) -> contextlib.AbstractContextManager[None]:
        """Around starting this plan's workers: NOTE [tagged at birth] (``_tag``)."""
        return tagged_starts(tag, self.start_method, preloaded=self.context is not None)

    def watch_server(self, fifo: str) -> None:
        """The reaper behind ``fifo`` kills the preloaded server too if this process dies."""
        if self.context is None:
            return
        server = _forkserver.server_key()
        if server is not None:
            _reaper_client.notify_watch(fifo, server[0], server[1], server[0])

    def refresh(self, fifo: str) -> None:
        """Before a replacement starts: a preloaded server that died meanwhile is replaced,
        and the reaper watches the one running."""
        if self.preload_modules is None:
            return
        _forkserver.context(self.preload_modules)  # the exit hook was installed by make()
        self.watch_server(fifo)
