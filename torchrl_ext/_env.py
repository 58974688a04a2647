"""``ManagedParallelEnv``: TorchRL's ``ParallelEnv`` whose workers may have children.

This module holds no OS calls: process state lives in ``_supervisor``, the in-worker set-up in
``_worker``, process-wide hooks in ``_lifecycle``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from torchrl.envs import EnvBase, ParallelEnv

from . import _forkserver, _identity, _lifecycle, _platform, _reaper_client
from ._compat import (
    HAS_DAEMON_KWARG,
    HAS_SHUTDOWN_TIMEOUT_KWARG,
    UPSTREAM_DEFAULTS,
    ConfiguredKwargs,
    SupervisedWorkers,
    install_fault_check,
    is_worker_entry,
    managed_worker_targets,
    worker_context,
)
from ._done_signal import DEFAULT_SPIN, has_spare_core, timeout_error
from ._errors import DaemonicParentError, WorkerDiedError, WorkerHungError
from ._metadata import metadata_in_subprocess as metadata_in_subprocess_ctx
from ._report import SupervisionReport
from ._restart import (
    RestartBudget,
    RestartRecord,
    add_restart_keys,
    clear_marks,
    clear_root_marks,
    copy_unstarted,
    mark_transition,
    recording_starts,
)
from ._supervisor import LOST_PIPE_WAIT, WorkerSupervisor, is_forwarded_call
from ._tag import Tag, new_env_tag, tagged_spawns
from ._worker import WorkerConfig

__all__ = ["ManagedParallelEnv"]

log = logging.getLogger("torchrl_ext")

#: Longest pause between checks while a replacement starts or resets.
_POLL_SLICE = 0.02
#: How long the supervisor may take to handle a worker's exit (its tree's SIGKILL included).
_LOSS_WAIT = 10.0


#: Worker kwargs made anew for each replacement (TorchRL's names).
_PER_START = frozenset({"parent_pipe", "child_pipe", "mp_event"})


class _Lost(Exception):
    """A worker was lost while the env waited (restarts on): handled by the wait loop."""


class _Hung(Exception):
    """The wait passed ``step_timeout``: handled by the wait loop."""


class _ReplacementLost(Exception):
    """A replacement died or hung while starting; its loss is in ``supervisor.lost``."""


def _check_restartable(env: Any) -> None:
    """Restarts and hang detection work on TorchRL's shared buffers, with tensors only."""
    if not env.__dict__.get("_use_buffers"):
        raise ValueError(
            "max_restarts and step_timeout need TorchRL's shared buffers; this env has "
            "use_buffers=False. Pass use_buffers=True, or max_restarts=0 and step_timeout=None."
        )
    if env.__dict__.get("_non_tensor_keys"):
        raise ValueError(
            "max_restarts and step_timeout are not supported for envs with non-tensor specs "
            f"({env._non_tensor_keys}); pass max_restarts=0 and step_timeout=None."
        )


#: As the installed TorchRL: 10 s (TorchRL 0.10 hard-codes the same wait).
DEFAULT_SHUTDOWN_TIMEOUT: float = UPSTREAM_DEFAULTS["shutdown_timeout"]


class _ManagedState:
    """Our per-env state, kept in one ``__dict__`` entry (see the ``__getattr__`` trap)."""

    def __init__(
        self,
        daemon_workers: bool,
        shutdown_timeout: float,
        handle_signals: bool,
        reap_orphans: bool,
        spin_wait: float | None = None,
        exit_with_parent: bool | None = None,
        preload: bool | tuple[str, ...] = True,
        child_start_method: str | None = None,
        max_restarts: int = 0,
        restart_window: float | None = None,
        step_timeout: float | None = None,
        restart_on_error: bool = False,
    ):
        self.daemon_workers = daemon_workers
        self.shutdown_timeout = shutdown_timeout
        self.handle_signals = handle_signals
        self.reap_orphans = reap_orphans
        self.spin_wait = spin_wait
        #: What the wait uses: ``spin_wait`` with its default resolved.
        self.spin = DEFAULT_SPIN if spin_wait is None else spin_wait
        self.exit_with_parent = exit_with_parent
        self.preload = preload
        self.child_start_method = child_start_method
        #: Modules the preloaded server is asked for (base ones excluded); ``None``: not used.
        self.preload_modules: tuple[str, ...] | None = None
        self.supervisor: WorkerSupervisor | None = None
        self.report: SupervisionReport | None = None
        self.closing = False
        self.close_reason = "close"
        self.worker_pids: list[int] = []
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.step_timeout = step_timeout
        self.restart_on_error = restart_on_error
        #: Our own wait loop (restarts, hang detection) instead of TorchRL's.
        self.own_wait = max_restarts > 0 or step_timeout is not None
        self.budget = RestartBudget(max_restarts, restart_window)
        self.restarts: list[RestartRecord] = []
        #: Per slot, the worker process as TorchRL built it, unstarted (see _restart).
        self.templates: list[Any] = []
        #: Context of the workers' pipes and events (a replacement needs the same).
        self.worker_ctx: Any = None
        #: Done entries only restarts write, and the slots whose "next" holds a mark.
        self.mark_keys: list[str] = []
        self.marked: set[int] = set()
        #: Per slot, the observation its replacement's first reset gave, until the slot's marked
        #: transition is written: TorchRL's partial reset of other slots copies a slot's last
        #: "next" over its root, so the root cannot be trusted to still hold it.
        self.fresh_obs: dict[int, Any] = {}
        #: Indexed views of this env (weak references; see ``_envs_of_slot``).
        self.views: list[weakref.ref[Any]] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _ManagedState,
            (
                self.daemon_workers,
                self.shutdown_timeout,
                self.handle_signals,
                self.reap_orphans,
                self.spin_wait,
                self.exit_with_parent,
                self.preload,
                self.child_start_method,
                self.max_restarts,
                self.restart_window,
                self.step_timeout,
                self.restart_on_error,
            ),
        )


def _resolve_daemon(daemon_workers: bool | None, daemon: bool | None) -> bool:
    if daemon_workers is not None and daemon is not None and bool(daemon_workers) != bool(daemon):
        raise ValueError(
            f"daemon_workers={daemon_workers!r} and daemon={daemon!r} disagree; `daemon` is an alias "
            "of `daemon_workers`: pass only one (daemon_workers=False lets workers have children)."
        )
    if daemon_workers is not None:
        return bool(daemon_workers)
    if daemon is not None:
        return bool(daemon)
    return bool(UPSTREAM_DEFAULTS["daemon"])


def _start_method(requested: str | None) -> str:
    """The start method ParallelEnv will use for ``mp_start_method=requested``."""
    if requested is not None:
        return requested
    try:
        from torchrl._utils import _get_default_mp_start_method

        return str(_get_default_mp_start_method())
    except ImportError:  # TorchRL 0.10 uses spawn when none is given
        return "spawn"


_NOT_PRELOADED = ("__main__", "__mp_main__", "builtins")


def _factory_modules(create_env_fn: Any) -> list[str]:
    """Modules defining the env factories (``__main__`` is preloaded through its path)."""
    fns = list(create_env_fn) if isinstance(create_env_fn, list | tuple) else [create_env_fn]
    found: list[str] = []
    for fn in fns:
        for _ in range(8):  # unwrap EnvCreator, functools.partial, CloudpickleWrapper
            inner = getattr(fn, "create_env_fn", None) or getattr(fn, "func", None) or getattr(fn, "fn", None)
            if inner is None or inner is fn:
                break
            fn = inner
        module = getattr(fn, "__module__", None)
        if not isinstance(module, str):
            module = type(fn).__module__
        if module in _NOT_PRELOADED or module.split(".")[0] in ("torchrl", "functools"):
            continue
        if module not in found:
            found.append(module)
    return found


class ManagedParallelEnv(ParallelEnv):
    """A drop-in ``torchrl.envs.ParallelEnv`` that supervises its whole process tree.

    With ``daemon_workers=False`` the workers may start children (a ``DataLoader`` with
    ``num_workers > 0``, a simulator subprocess). Each worker runs in its own process group;
    every worker and descendant is recorded, and nothing is left behind however the program
    ends: ``close()`` is bounded by ``shutdown_timeout``, open envs are closed at interpreter
    exit and on SIGTERM/SIGINT/SIGHUP, a worker death raises :class:`WorkerDiedError` and kills
    that worker's tree, and an external reaper kills everything if the main process dies.

    Args:
        num_workers: number of worker processes.
        create_env_fn: env factory (or one per worker), as for ``ParallelEnv``.
        daemon_workers: ``False`` lets workers have children, supervised by this class;
            ``True`` makes them daemonic, which forbids children. ``None`` (default): the
            installed TorchRL's own default (daemonic on 0.10, non-daemonic on >= 0.11).
            Supervision is on either way.
        daemon: alias of ``daemon_workers`` (TorchRL >= 0.11 spelling); conflicting values raise.
        shutdown_timeout: seconds ``close()`` may take at most before everything is killed
            (default: TorchRL's, 10 s).
        handle_signals: install chained SIGTERM/SIGINT/SIGHUP handlers (main thread only).
        reap_orphans: on Linux, make this process a child subreaper so that the children of a
            worker that died are re-parented here and reaped, even where PID 1 does not reap.
        metadata_in_subprocess: build the env TorchRL uses to read specs in a supervised
            one-shot process instead of the main process (default: when
            ``daemon_workers=False``), so its children cannot outlive it.
        spin_wait: TorchRL >= 0.11 spin-polls for the workers' results, holding a core for
            the whole step; a managed env sleeps until they arrive, after spinning at most
            ``spin_wait`` seconds, and only while results usually arrive within that.
            ``None`` (default): 250 microseconds; ``0``: never spin;
            ``float("inf")``: TorchRL's own wait.
        exit_with_parent: when the process that started this one through ``multiprocessing``
            dies (the training process of a collector worker), close the envs and end this
            process with SIGTERM. ``None`` (default): when this process was started by
            ``multiprocessing``; a top-level program is never affected.
        preload: with non-daemonic workers, no ``mp_start_method`` and no global start method
            chosen by the program, workers (and the spec-reading env) are forked from a
            preloaded, supervised fork server that has already imported torch, TorchRL and the
            factory's module (see docs/design.md, "Fast start"). A sequence of module names adds
            them to the server's imports; ``False`` uses TorchRL's default start method.
            An explicit ``mp_start_method`` always wins.
        child_start_method: default start method inside each worker, that is, what a
            ``DataLoader(num_workers>0)`` built there without ``multiprocessing_context`` uses.
            ``None`` (default): ``"fork"`` for workers of the preloaded server (no torch
            import, no interpreter shutdown per DataLoader worker), else left as inherited.
        max_restarts: how many lost workers (dead, hung, or, with ``restart_on_error``,
            whose env raised) are replaced within ``restart_window``; the call in flight returns
            normally and the slot's transition is marked (``("next", "worker_restarted")``,
            ``truncated`` and ``done`` True, ``terminated`` False; see docs/restarts.md).
            ``0`` (default): the first loss raises :class:`WorkerDiedError`, as before.
            Needs TorchRL's shared buffers (``use_buffers``, the default) and tensor-only specs.
        restart_window: seconds over which ``max_restarts`` is counted; ``None`` (default):
            the env's whole life.
        step_timeout: seconds a worker may take to answer a step or reset; one that takes
            longer is killed with its tree, then restarted (within ``max_restarts``) or
            :class:`WorkerHungError` is raised. ``None`` (default): TorchRL's own wait.
        restart_on_error: an exception raised by the env's own code restarts the slot too
            (within ``max_restarts``); by default it is re-raised with its type and traceback.
        **kwargs: everything ``torchrl.envs.ParallelEnv`` accepts.

    Example:
        >>> from torchrl.envs import GymEnv  # doctest: +SKIP
        >>> env = ManagedParallelEnv(2, lambda: GymEnv("Pendulum-v1"), daemon_workers=False)  # doctest: +SKIP
        >>> td = env.rollout(10)  # doctest: +SKIP
        >>> env.close()  # doctest: +SKIP
        >>> env.supervision_report.clean  # doctest: +SKIP
        True
    """

    # Attributes TorchRL's ParallelEnv sets, declared for the type checker.
    create_env_fn: list[Any]
    create_env_kwargs: list[Any]
    parent_channels: list[Any]
    _workers: Any
    _events: Any

    def __init__(
        self,
        num_workers: int,
        create_env_fn: Callable[..., EnvBase] | Sequence[Callable[..., EnvBase]],
        *,
        daemon_workers: bool | None = None,
        daemon: bool | None = None,
        shutdown_timeout: float | None = None,
        handle_signals: bool = True,
        reap_orphans: bool = True,
        metadata_in_subprocess: bool | None = None,
        spin_wait: float | None = None,
        exit_with_parent: bool | None = None,
        preload: bool | Sequence[str] = True,
        child_start_method: str | None = None,
        max_restarts: int = 0,
        restart_window: float | None = None,
        step_timeout: float | None = None,
        restart_on_error: bool = False,
        **kwargs: Any,
    ) -> None:
        if shutdown_timeout is None:
            shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT
        if shutdown_timeout <= 0:
            raise ValueError(f"shutdown_timeout must be positive, got {shutdown_timeout!r}")
        if spin_wait is not None and not spin_wait >= 0:
            raise ValueError(f"spin_wait must be None or >= 0 seconds, got {spin_wait!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if restart_window is not None and not restart_window > 0:
            raise ValueError(f"restart_window must be None or > 0 seconds, got {restart_window!r}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be None or > 0 seconds, got {step_timeout!r}")
        resolved = _resolve_daemon(daemon_workers, daemon)
        methods = multiprocessing.get_all_start_methods()
        if child_start_method is not None and child_start_method not in methods:
            raise ValueError(
                f"child_start_method={child_start_method!r} is not a start method here; "
                f"choose one of {methods} or None"
            )
        preload_setting: bool | tuple[str, ...] = (
            bool(preload) if isinstance(preload, bool) else tuple(str(m) for m in preload)
        )
        state = _ManagedState(
            resolved,
            float(shutdown_timeout),
            handle_signals,
            reap_orphans,
            spin_wait,
            exit_with_parent,
            preload_setting,
            child_start_method,
            max_restarts,
            None if restart_window is None else float(restart_window),
            None if step_timeout is None else float(step_timeout),
            bool(restart_on_error),
        )
        self.__dict__["_trx"] = state
        if (
            preload_setting is not False
            and not resolved
            and kwargs.get("mp_start_method") is None
            and not _forkserver.start_method_chosen_by_user()
            and "forkserver" in methods
        ):
            extra = preload_setting if isinstance(preload_setting, tuple) else ()
            state.preload_modules = (*_factory_modules(create_env_fn), *extra)
        if HAS_DAEMON_KWARG:
            kwargs["daemon"] = resolved
        if HAS_SHUTDOWN_TIMEOUT_KWARG:
            kwargs["shutdown_timeout"] = float(shutdown_timeout)
        if metadata_in_subprocess is None:
            metadata_in_subprocess = not resolved
        current = multiprocessing.current_process()
        if metadata_in_subprocess and current.daemon:
            raise DaemonicParentError(current.name)
        if not metadata_in_subprocess:
            super().__init__(num_workers, create_env_fn, **kwargs)
            return
        tag = new_env_tag()
        start: Any = self._preloaded_context() or _start_method(kwargs.get("mp_start_method"))
        with metadata_in_subprocess_ctx(
            start,
            Tag(tag.owner_pid, tag.owner_create_time, tag.env_id + ".meta"),
            f"ManagedParallelEnv[{tag.env_id}]",
            self._child_start_method(),
            int(kwargs.get("num_sub_threads", UPSTREAM_DEFAULTS["num_sub_threads"])),
        ):
            super().__init__(num_workers, create_env_fn, **kwargs)

    def _preloaded_context(self) -> Any:
        """The preloaded server's context if this env uses it (the server running), else None."""
        state: _ManagedState = self.__dict__["_trx"]
        if state.preload_modules is None:
            return None
        _lifecycle.install_exit_hook()  # stops the server at exit, after every env is closed
        return _forkserver.context(state.preload_modules)

    def _child_start_method(self) -> str | None:
        state: _ManagedState = self.__dict__["_trx"]
        if state.child_start_method is not None:
            return state.child_start_method
        return "fork" if state.preload_modules is not None else None

    @property
    def start_method(self) -> str:
        """How workers start: ``"preloaded"`` (forks of the preloaded server) or the
        ``multiprocessing`` start method TorchRL uses."""
        if self.__dict__["_trx"].preload_modules is not None:
            return "preloaded"
        return _start_method(self.__dict__.get("_mp_start_method"))

    # ------------------------------------------------------------------ public extras
    @property
    def daemon_workers(self) -> bool:
        """Whether workers are daemonic (and so may not have children)."""
        return bool(self.__dict__["_trx"].daemon_workers)

    @property
    def shutdown_timeout(self) -> float:
        """Upper bound, in seconds, of ``close()``."""
        return float(self.__dict__["_trx"].shutdown_timeout)

    @shutdown_timeout.setter
    def shutdown_timeout(self, value: float) -> None:
        # TorchRL >= 0.13 assigns this attribute in its own __init__.
        state = self.__dict__.get("_trx")
        if state is not None:
            state.shutdown_timeout = float(value)

    @property
    def supervision_report(self) -> SupervisionReport | None:
        """What the last ``close()`` had to do, per worker (``None`` before the first close)."""
        return self.__dict__["_trx"].report

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the current (or last) workers."""
        return list(self.__dict__["_trx"].worker_pids)

    @property
    def restarts(self) -> list[RestartRecord]:
        """Every worker restart of this env so far, oldest first (see ``max_restarts``)."""
        return list(self.__dict__["_trx"].restarts)

    def _set_properties(self) -> None:
        super()._set_properties()
        state: _ManagedState | None = self.__dict__.get("_trx")
        if state is not None and state.max_restarts > 0:
            added = add_restart_keys(self)
            if self._owns_workers_():  # a view's keys are its owner's
                state.mark_keys = added

    # ------------------------------------------------------------------ start
    def _start_workers(self) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        current = multiprocessing.current_process()
        if current.daemon:
            raise DaemonicParentError(current.name)
        if state.own_wait:
            _check_restartable(self)
        context = self._preloaded_context()  # raises PreloadError before anything started
        tag = new_env_tag()
        label = f"ManagedParallelEnv[{tag.env_id}]"
        fifo = _reaper_client.acquire()
        supervisor = WorkerSupervisor(tag, state.shutdown_timeout, label, base_dir=os.path.dirname(fifo))
        child_start_method = self._child_start_method()
        if context is not None:
            server = _forkserver.server_key()
            if server is not None:  # the reaper kills it too if this process dies
                _reaper_client.notify_watch(fifo, server[0], server[1], server[0])
        start_method = "forkserver" if context is not None else _start_method(self._mp_start_method)
        arm_pdeathsig = _platform.parent_death_outlives_worker(start_method)
        _pid, owner_ctime = _identity.me()
        # Our config travels next to each worker's kwargs, not around its factory: see _compat.
        user_kwargs: list[Any] = self.create_env_kwargs
        self.create_env_kwargs = [
            ConfiguredKwargs(
                kwargs,
                WorkerConfig(
                    index=i,
                    tag=str(tag),
                    daemon_workers=state.daemon_workers,
                    arm_pdeathsig=arm_pdeathsig,
                    owner_pid=os.getpid(),
                    owner_create_time=owner_ctime,
                    report_path=supervisor.report_path(i),
                    reaper_fifo=fifo,
                    done_fifo=None if state.spin == float("inf") else supervisor.done_signal.path,
                    child_start_method=child_start_method,
                ),
            )
            for i, kwargs in enumerate(user_kwargs)
        ]
        install_fault_check()
        exit_with_parent = state.exit_with_parent
        if exit_with_parent is None:
            exit_with_parent = _lifecycle.multiprocessing_parent() is not None
        _lifecycle.register(self, state.handle_signals, state.reap_orphans, exit_with_parent)
        recording: contextlib.AbstractContextManager[list[Any]] = (
            recording_starts() if state.max_restarts > 0 else contextlib.nullcontext([])
        )
        try:
            with (
                managed_worker_targets(),
                worker_context(self, context),
                tagged_spawns(tag),
                recording as started,
            ):
                super()._start_workers()
        except BaseException as err:
            failure = self._abort_start(supervisor, err)
            if failure is None:
                raise
            _raise_failure(failure)
        finally:
            self.create_env_kwargs = user_kwargs
        processes: list[Any] = self._workers
        channels: list[Any] = self.parent_channels
        # The worker processes TorchRL built, in slot order (nothing else this thread started).
        state.templates = [p for p in started if is_worker_entry(getattr(p, "_target", None))]
        for template in state.templates:  # each replacement gets its own pipes and event
            template._kwargs = {k: v for k, v in template._kwargs.items() if k not in _PER_START}
        if state.max_restarts > 0 and len(state.templates) != len(processes):
            self._abort_start(supervisor, RuntimeError("restarts: worker processes not recorded"))
            raise RuntimeError(
                f"torchrl_ext could not record the {len(processes)} worker processes TorchRL started "
                f"(found {len(state.templates)}); restarts cannot work with this TorchRL release. "
                "Pass max_restarts=0, and please report this."
            )
        state.worker_ctx = context or multiprocessing.get_context(_start_method(self._mp_start_method))
        state.marked = set()
        supervisor.restartable = state.max_restarts > 0
        self.parent_channels = supervisor.attach(processes, channels)
        self._workers = SupervisedWorkers(processes, supervisor.raise_known_failure)
        state.worker_pids = [p.pid for p in processes]
        supervisor.done_signal.spare_core = has_spare_core(len(processes))
        state.supervisor = supervisor
        log.debug("%s started %d workers: %s", label, len(self._workers), state.worker_pids)

    def _cleanup_failed_worker_startup(self) -> None:
        """TorchRL >= 0.14 calls this on a failed start; :meth:`_abort_start` does it instead."""

    def _abort_start(self, supervisor: WorkerSupervisor, err: BaseException) -> BaseException | None:
        workers = list(self.__dict__.get("_workers") or [])
        channels = list(self.__dict__.get("parent_channels") or [])
        failure: BaseException | None = None
        try:
            if workers:
                supervisor.attach(workers, channels[: len(workers)])
                if not isinstance(err, KeyboardInterrupt | SystemExit):
                    supervisor.wait_for_failure(1.0)
                    failure = supervisor.startup_failure()
            supervisor.shutdown("start-up failure", timeout=min(self.shutdown_timeout, 3.0))
        finally:
            supervisor.stop()
            for channel in channels:
                with contextlib.suppress(Exception):
                    channel.close()
            self._workers = SupervisedWorkers([], _no_faults)
            self.parent_channels = []
            self.is_closed = True
            _lifecycle.unregister(self)
            _reaper_client.release()
        return failure

    # ------------------------------------------------------------------ failures
    def _check_failed(self) -> WorkerSupervisor | None:
        """Hot path, before each call: raise a death the supervisor already handled, or (with
        restarts) replace the workers lost since the last call; no system call otherwise. A
        death not handled yet surfaces through the wait loop."""
        state: _ManagedState = self.__dict__["_trx"]
        supervisor = state.supervisor
        if supervisor is not None:
            if supervisor.first_failure is not None:
                _raise_failure(supervisor.first_failure)
            if supervisor.lost or state.marked:
                self._between_calls(supervisor)
        return supervisor

    def _translate(self, err: Exception, supervisor: WorkerSupervisor | None) -> None:
        """``err`` escaped TorchRL: raise the worker's failure instead if a worker is gone
        (decided by the supervisor's facts, never by the message); else return."""
        supervisor = self.__dict__["_trx"].supervisor or supervisor
        if supervisor is None:
            return
        found = supervisor.first_failure
        if found is None:
            # A closed pipe is seen a moment before the death itself, so it gets a short wait.
            lost_pipe = isinstance(err, EOFError | OSError)
            # With restarts on, a loss counts: its slot is replaced at the next call.
            found = supervisor.wait_for_failure(LOST_PIPE_WAIT if lost_pipe else 0.0, lost_counts=True)
        if found is not None:
            _raise_failure(found)

    # ------------------------------------------------------------------ restarts
    def _between_calls(self, supervisor: WorkerSupervisor) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        if state.marked:
            for slot in state.marked:
                clear_marks(self._owner().shared_tensordicts[slot], state.mark_keys)
            state.marked = set()
        if supervisor.lost:
            self._handle_losses(supervisor, in_flight=())

    def _handle_losses(self, supervisor: WorkerSupervisor, in_flight: Collection[int]) -> None:
        """Replace every lost worker (its tree is already gone), or raise once the budget is
        spent. ``in_flight``: slots whose answer the caller is waiting for."""
        # A call interrupted by the loss may have left answers in the other workers' pipes.
        supervisor.drain_owed(self.shutdown_timeout)
        while supervisor.lost:
            self._restart_slot(supervisor, supervisor.lost[0], in_flight)

    def _give_up(self, supervisor: WorkerSupervisor, lost: Any, reason: str) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        failure = lost.failure
        history = "; ".join(str(r) for r in state.restarts[-5:]) or "none"
        detail = f"{reason}; restarts so far ({len(state.restarts)}): {history}"
        if isinstance(failure, WorkerHungError):
            failure = WorkerHungError(lost.index, lost.pid, failure.last_command, failure.timeout, detail)
        elif isinstance(failure, WorkerDiedError):
            failure = WorkerDiedError(lost.index, lost.pid, lost.exitcode, failure.last_command, detail)
        elif state.max_restarts > 0:
            failure.add_note(f"torchrl_ext: worker {lost.index} (pid {lost.pid}) not restarted: {detail}")
        with supervisor._lock:
            supervisor.lost = []
            if supervisor.first_failure is None:
                supervisor.first_failure = failure
        _raise_failure(supervisor.first_failure)

    def _restart_slot(self, supervisor: WorkerSupervisor, lost: Any, in_flight: Collection[int]) -> None:
        """Replace ``lost`` (retrying while replacements are lost too), then replay its
        in-flight reset, or reset the new env and mark the in-flight step's transition, or
        (lost between calls) have the slot's next step answered by a mark."""
        state: _ManagedState = self.__dict__["_trx"]
        slot = lost.index
        # What the slot owes the caller is what the first lost worker was asked.
        command = lost.channel.last_command
        message = lost.channel.last_message
        replay = slot in in_flight and command == "reset"
        for attempt in itertools.count(1):
            env_error = not isinstance(lost.failure, WorkerDiedError)
            # A call forwarded to the env (``env.method()``) already raised the env's error to its
            # caller; the worker only died because TorchRL's loop ends on it: a loss like any other.
            if env_error and not state.restart_on_error and not is_forwarded_call(command):
                self._give_up(supervisor, lost, "its env raised (restart_on_error=False)")
            if not state.budget.allows(time.monotonic()):
                self._give_up(supervisor, lost, f"more losses than {state.budget.describe()}")
            if attempt > state.max_restarts:  # however long the window: no endless retries
                self._give_up(supervisor, lost, f"{state.max_restarts} replacement(s) in a row were lost")
            cause: int | str | None = (
                "hung" if lost.hung else type(lost.failure).__name__ if env_error else lost.exitcode
            )
            supervisor.forget_report(slot)
            try:
                process, channel = self._start_replacement(supervisor, slot)
                ready = time.monotonic()
                waited = ready - lost.lost_at
                asked = lost.channel.last_command
                now = time.time()
                record = RestartRecord(slot, lost.pid, process.pid, cause, asked, now - waited, waited)
                state.restarts.append(record)
                log.warning(
                    "%s restarted worker %s (%d descendant process(es) of the old one killed)",
                    supervisor.label,
                    record,
                    lost.descendants_killed,
                )
                if replay:
                    channel.send(message)  # the same reset again, on the new env; answered as usual
                    return
                self._reset_slot(supervisor, slot, channel)
            except _ReplacementLost:
                lost = supervisor.worker(slot)
                continue
            if slot in in_flight and command in ("step", "step_and_maybe_reset"):
                self._mark(slot)
            else:  # lost between calls: the slot's next step is answered by a mark
                channel.intercept = functools.partial(self._intercept, slot, channel)
            return

    def _start_replacement(self, supervisor: WorkerSupervisor, slot: int) -> tuple[Any, Any]:
        state: _ManagedState = self.__dict__["_trx"]
        template = state.templates[slot]
        ctx = state.worker_ctx
        kwargs = dict(template._kwargs)
        parent_pipe, child_pipe = ctx.Pipe()
        event = ctx.Event()
        kwargs.update(parent_pipe=parent_pipe, child_pipe=child_pipe, mp_event=event)
        env_kwargs = kwargs.get("env_fun_kwargs")
        if isinstance(env_kwargs, ConfiguredKwargs):
            arm = _platform.parent_death_outlives_worker(getattr(template, "_start_method", None))
            kwargs["env_fun_kwargs"] = ConfiguredKwargs(
                dict(env_kwargs), dataclasses.replace(env_kwargs.trx_config, arm_pdeathsig=arm)
            )
        if state.preload_modules is not None:
            self._preloaded_context()  # a fork server that died meanwhile is replaced
            server = _forkserver.server_key()
            fifo = env_kwargs.trx_config.reaper_fifo if isinstance(env_kwargs, ConfiguredKwargs) else None
            if server is not None and fifo:
                _reaper_client.notify_watch(fifo, server[0], server[1], server[0])
        process = copy_unstarted(template, kwargs)
        flags = self._owner().__dict__.get("_shm_done_flags")
        if flags is not None:
            flags[slot] = 0  # the lost worker may have answered before it died
        with tagged_spawns(supervisor.tag):
            process.start()
        child_pipe.close()
        channel = supervisor.replace(slot, process, parent_pipe)
        # The owner's lists, and those of every indexed view (TorchRL >= 0.14 gives a view
        # lists of its own, indexed by its position in the view).
        for env, position in self._envs_of_slot(slot):
            env._workers[position] = process
            env.parent_channels[position] = channel
            if env.__dict__.get("_events") is not None:
                env._events[position] = event
        state.worker_pids[slot] = process.pid
        # TorchRL's handshake: the worker says it built its env, then is sent "init". Building
        # the env is not a command: step_timeout does not apply (a spawned worker imports torch).
        self._await(supervisor, slot, lambda: bool(channel.poll(0)), self.BATCHED_PIPE_TIMEOUT, channel)
        try:
            channel.recv()  # "started"; at EOF, the replacement died while building its env
        except Exception:
            self._await_loss(supervisor, supervisor.worker(slot))
            raise _ReplacementLost from None
        channel.send(("init", None))
        return process, channel

    def _reset_slot(self, supervisor: WorkerSupervisor, slot: int, channel: Any) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        channel.send(("reset", (False, {})))
        limit = state.step_timeout if state.step_timeout is not None else self.BATCHED_PIPE_TIMEOUT
        self._await(supervisor, slot, lambda: self._slot_answered(slot), limit)
        owner = self._owner()
        state.fresh_obs[slot] = owner.shared_tensordicts[slot].select(*owner._env_obs_keys).clone()

    def _owner(self) -> Any:
        """The env that owns the workers: ``self``, or the parent of an indexed view."""
        return self.__dict__.get("_parent_env") or self

    def _envs_of_slot(self, slot: int) -> list[tuple[Any, int]]:
        """The owner and each live view that holds worker ``slot``, with its position there."""
        state: _ManagedState = self.__dict__["_trx"]
        found = [(self._owner(), slot)]
        views = [ref() for ref in state.views]
        state.views = [weakref.ref(view) for view in views if view is not None]
        for view in views:
            indices = None if view is None else view.__dict__.get("_worker_indices")
            if view is not None and indices is not None and slot in indices:
                found.append((view, list(indices).index(slot)))
        return found

    def _make_batched_view(self, indices: Sequence[int]) -> Any:
        """TorchRL >= 0.14 indexing: a view, remembered so that restarts reach its lists."""
        view = super()._make_batched_view(indices)
        self.__dict__["_trx"].views.append(weakref.ref(view))
        return view

    def _slot_answered(self, slot: int) -> bool:
        owner = self._owner()
        flags = owner.__dict__.get("_shm_done_flags")
        if flags is not None:
            if flags[slot]:
                flags[slot] = 0
                return True
            return False
        event = owner._events[slot]
        if event.is_set():
            event.clear()
            return True
        return False

    def _slot_done(self, slot: int) -> None:
        owner = self._owner()
        flags = owner.__dict__.get("_shm_done_flags")
        if flags is not None:
            flags[slot] = 1
        else:
            owner._events[slot].set()

    def _await(
        self,
        supervisor: WorkerSupervisor,
        slot: int,
        ready: Callable[[], bool],
        limit: float,
        channel: Any = None,
    ) -> None:
        """Poll ``ready`` until true, waking early when the worker (or ``channel``) does; a
        replacement that dies or takes more than ``limit`` seconds meanwhile raises
        _ReplacementLost (its loss is then in ``supervisor.lost``)."""
        worker = supervisor.worker(slot)
        hang_at = time.monotonic() + limit
        waitables: list[Any] = [worker.sentinel] + ([channel] if channel is not None else [])
        pause = 1e-4
        while not ready():
            if worker.finished or worker.exited():
                supervisor.poll()
                self._await_loss(supervisor, worker)
                raise _ReplacementLost
            if time.monotonic() >= hang_at:
                supervisor.kill_hung(slot, limit)
                self._await_loss(supervisor, worker)
                raise _ReplacementLost
            multiprocessing.connection.wait(waitables, timeout=pause)
            pause = min(2 * pause, _POLL_SLICE)

    def _await_loss(self, supervisor: WorkerSupervisor, worker: Any) -> None:
        """Wait until the supervisor has handled ``worker``'s exit (tree killed, loss recorded)."""
        if not worker.handled.wait(_LOSS_WAIT):
            supervisor.poll()
        if not worker.handled.is_set():
            asked = worker.channel.last_command
            raise WorkerDiedError(worker.index, worker.pid, None, asked, "its exit was not seen")
        supervisor.raise_known_failure()

    def _mark(self, slot: int) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        owner = self._owner()
        slot_td = owner.shared_tensordicts[slot]
        fresh = state.fresh_obs.pop(slot, None)
        mark_transition(slot_td, owner._env_obs_keys, owner.reward_keys, owner.done_keys, fresh)
        state.marked.add(slot)
        self._slot_done(slot)

    def _intercept(self, slot: int, channel: Any, message: tuple[Any, ...]) -> bool:
        """A replacement's first step is not sent: its transition is the marked one."""
        command = message[0]
        if command in ("step", "step_and_maybe_reset"):
            channel.intercept = None
            self._mark(slot)
            return True
        if command == "reset":
            channel.intercept = None
        return False

    def _wait_own(self, supervisor: WorkerSupervisor, workers_range: Any) -> None:
        """Wait for the workers' answers, replacing lost workers and killing hung ones."""
        state: _ManagedState = self.__dict__["_trx"]
        indices = self.__dict__.get("_worker_indices")
        slots = list(workers_range) if indices is None else [indices[i] for i in workers_range]
        flags = self.__dict__.get("_shm_done_flags")
        pipe_deadline = time.monotonic() + self.BATCHED_PIPE_TIMEOUT
        step_timeout = state.step_timeout
        hang_at = None if step_timeout is None else time.monotonic() + step_timeout

        def check() -> None:
            supervisor.raise_known_failure()
            if supervisor.lost:
                raise _Lost

        def on_timeout() -> None:
            if hang_at is not None and time.monotonic() >= hang_at:
                raise _Hung

        while True:
            deadline = pipe_deadline if hang_at is None else min(pipe_deadline, hang_at)
            try:
                if flags is not None:
                    supervisor.done_signal.wait_for(
                        flags, slots, max(0.0, deadline - time.monotonic()), state.spin, check, on_timeout
                    )
                else:
                    self._wait_events(slots, deadline, check, on_timeout)
                return
            except _Lost:
                self._handle_losses(supervisor, in_flight=slots)
                if step_timeout is not None:  # a replayed reset gets the whole timeout
                    hang_at = time.monotonic() + step_timeout
            except _Hung:
                assert step_timeout is not None
                for slot in slots:
                    answered = flags[slot] if flags is not None else self._events[slot].is_set()
                    if not answered and not supervisor.worker(slot).finished:  # dead ones are lost already
                        worker = supervisor.kill_hung(slot, step_timeout)
                        self._await_loss(supervisor, worker)
                self._handle_losses(supervisor, in_flight=slots)
                hang_at = time.monotonic() + step_timeout  # a replayed reset gets the whole timeout

    def _wait_events(
        self, slots: list[int], deadline: float, check: Callable[[], None], on_timeout: Callable[[], None]
    ) -> None:
        """TorchRL < 0.11: workers answer by setting their ``mp.Event``."""
        events = self._events
        pause = 1e-4
        while True:
            waiting = [slot for slot in slots if not events[slot].is_set()]
            if not waiting:
                for slot in slots:
                    events[slot].clear()
                return
            check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                on_timeout()
                raise timeout_error(self.BATCHED_PIPE_TIMEOUT)
            events[waiting[0]].wait(min(pause, remaining))
            pause = min(2 * pause, _POLL_SLICE)

    @contextlib.contextmanager
    def _supervised(self) -> Iterator[None]:
        supervisor = self._check_failed()
        try:
            yield
        except Exception as err:
            self._translate(err, supervisor)
            raise

    def _wait_for_workers(self, workers_range: Any) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        supervisor = state.supervisor
        if supervisor is not None and state.own_wait:
            self._wait_own(supervisor, workers_range)
            return
        flags = self.__dict__.get("_shm_done_flags")
        if (
            supervisor is None
            or flags is None
            or not self.__dict__.get("_use_buffers")
            or state.spin == float("inf")
        ):
            super()._wait_for_workers(workers_range)
            return
        indices = self.__dict__.get("_worker_indices")
        slots = list(workers_range) if indices is None else [indices[i] for i in workers_range]
        supervisor.done_signal.wait_for(
            flags, slots, self.BATCHED_PIPE_TIMEOUT, state.spin, supervisor.raise_known_failure
        )

    def _reset(self, tensordict: Any, **kwargs: Any) -> Any:
        with self._supervised():
            out = super()._reset(tensordict, **kwargs)
        keys = self.__dict__["_trx"].mark_keys
        if keys:  # only restarts write these, and only in "next"
            parent = self._owner().__dict__.get("shared_tensordict_parent")
            if parent is not None:
                clear_root_marks(parent, keys)
            if out is not None:
                clear_root_marks(out, keys)
        return out

    # The two per-step calls skip the context manager (a generator per step).
    def _step(self, tensordict: Any) -> Any:
        supervisor = self._check_failed()
        try:
            return super()._step(tensordict)
        except Exception as err:
            self._translate(err, supervisor)
            raise

    def step_and_maybe_reset(self, tensordict: Any) -> Any:
        supervisor = self._check_failed()
        try:
            return super().step_and_maybe_reset(tensordict)
        except Exception as err:
            self._translate(err, supervisor)
            raise

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        supervisor = self._check_failed()
        try:
            return super().set_seed(seed, static_seed)
        except Exception as err:
            if supervisor is None or not supervisor.restartable:
                self._translate(err, supervisor)
                raise
            # Seeding is one worker after the other and deterministic: replace and seed again.
            supervisor.wait_for_failure(LOST_PIPE_WAIT if isinstance(err, EOFError | OSError) else 0.0, True)
            if supervisor.first_failure is None and supervisor.lost:
                self._handle_losses(supervisor, in_flight=())
                return super().set_seed(seed, static_seed)
            self._translate(err, supervisor)
            raise

    def state_dict(self) -> Any:
        with self._supervised():
            return super().state_dict()

    def load_state_dict(self, state_dict: Any, **kwargs: Any) -> None:
        with self._supervised():
            super().load_state_dict(state_dict, **kwargs)
            supervisor: WorkerSupervisor | None = self.__dict__["_trx"].supervisor
            if supervisor is not None and supervisor.restartable:
                # TorchRL waits out a lost worker's event and returns: its state never arrived.
                lost = supervisor.wait_for_failure(0.0, lost_counts=True)
                if lost is not None:
                    _raise_failure(lost)

    # ------------------------------------------------------------------ close
    def _shutdown_workers(self) -> None:
        state: _ManagedState = self.__dict__["_trx"]
        supervisor = state.supervisor
        if supervisor is None:
            return
        if not state.closing and supervisor.wait_for_failure(1.0) is not None:
            # TorchRL's wait loop calls this right after it sees a dead worker. The supervisor
            # has killed the dead worker's tree; the survivors are closed by the user's close().
            return
        state.supervisor = None
        if supervisor.owner_pid != os.getpid():
            # A forked copy of this env (fork-context DataLoader worker, fork of the user's own):
            # the workers belong to the parent process, which closes them.
            return
        try:
            try:
                state.report = supervisor.shutdown(state.close_reason)
            except BaseException:
                # Interrupted (KeyboardInterrupt from a second Ctrl-C): kill fast, then re-raise.
                state.report = supervisor.shutdown("interrupted close", timeout=0.5)
                raise
        finally:
            for channel in self.__dict__.get("parent_channels") or []:
                with contextlib.suppress(Exception):
                    channel.close()
            if self.__dict__.get("_use_buffers"):
                self.__dict__.pop("shared_tensordicts", None)
                self.__dict__.pop("shared_tensordict_parent", None)
            # Empty lists, not deleted attributes: ParallelEnv.__getattr__ restarts workers.
            self._workers = SupervisedWorkers([], _no_faults)
            self.parent_channels = []
            self._cuda_events = None
            self._events = None
            self.event = None
            state.templates = []  # they hold the shared buffers and the done flags
            state.worker_ctx = None
            _lifecycle.unregister(self)
            _reaper_client.release()
        log.debug("%s", state.report)

    def close(self, *, raise_if_closed: bool = True) -> None:
        """Close the workers within ``shutdown_timeout``; never fails because a worker died.

        As upstream, closing a closed env raises ``RuntimeError`` unless
        ``raise_if_closed=False``, and closing an indexed view closes only the view. The report
        of what it took is in :attr:`supervision_report`.
        """
        if not self._owns_workers_():
            super().close(raise_if_closed=raise_if_closed)
            return
        state: _ManagedState = self.__dict__["_trx"]
        if state.closing:
            return
        if self.is_closed:
            if raise_if_closed:
                super().close(raise_if_closed=True)  # upstream's own error
            return
        state.closing = True
        try:
            super().close(raise_if_closed=False)
        finally:
            if state.supervisor is not None:  # super().close() failed before reaching us
                self._shutdown_workers()
            state.closing = False
            state.close_reason = "close"
            self.is_closed = True

    def _owns_workers_(self) -> bool:
        """False for a view made by indexing (TorchRL >= 0.14), which shares our state."""
        return bool(self.__dict__.get("_owns_workers", True))

    def __enter__(self) -> ManagedParallelEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(raise_if_closed=False)

    def _close_for(self, reason: str) -> None:
        self.__dict__["_trx"].close_reason = reason
        self.close(raise_if_closed=False)

    def __del__(self) -> None:
        if not self._owns_workers_():
            with contextlib.suppress(Exception):
                self.close(raise_if_closed=False)
            return
        state = self.__dict__.get("_trx")
        if state is not None and state.supervisor is not None and not self.__dict__.get("is_closed", True):
            with contextlib.suppress(Exception):
                self._close_for("garbage collection")


def _no_faults() -> None:
    """Fault check of a closed env: nothing to report."""


def _raise_failure(failure: BaseException) -> None:
    if isinstance(failure, WorkerDiedError) or failure.__cause__ is None:
        raise failure from None
    failure.__suppress_context__ = True
    raise failure
