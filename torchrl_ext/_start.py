"""How a managed env starts its workers: the start sequence, by the start plan (``_plan``).

The sequence (:func:`start_workers`) wraps TorchRL's own start:
our config next to each worker's kwargs, our worker entry, the preloaded context, tagging at
birth, process templates for restarts; then the supervisor takes the workers over. A failed
start is undone by :func:`abort_start`, which reports the worker's error rather than TorchRL's.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from . import _identity, _lifecycle, _platform, _reaper_client, _stacks
from ._compat import Upstream, describe_factory
from ._done_signal import has_spare_core
from ._errors import DaemonicParentError, WorkerStartTimeoutError, unpicklable_note
from ._hosts import Hosts, co_hosting
from ._intercept import (
    ConfiguredKwargs,
    SupervisedWorkers,
    install_fault_check,
    managed_worker_targets,
    worker_context,
)
from ._keeper import SlotKeeper, raise_failure
from ._options import Options
from ._plan import StartPlan
from ._report import SupervisionReport
from ._stats import EnvStats
from ._step_path import switched_off
from ._supervisor import WorkerSupervisor
from ._tag import new_env_tag
from ._worker import WorkerConfig

__all__ = ["EnvState", "abort_start", "release_workers", "start_workers", "stop_workers"]

log = logging.getLogger("torchrl_ext")


@dataclass
class EnvState:
    """One env's own state, kept in one ``__dict__`` entry (see the ``__getattr__`` trap).

    Fields and who changes them: ``options`` (the shutdown_timeout setter replaces them);
    ``preload_modules`` (fixed at construction); ``keeper`` (lives as long as the env: its
    restart records span starts); ``supervisor`` and ``worker_pids`` (set by
    :func:`start_workers`, cleared by the close); ``report``, ``closing`` and ``close_reason``
    (the close). A pickled env carries only its options.
    """

    options: Options
    preload_modules: tuple[str, ...] | None
    keeper: SlotKeeper = field(init=False)
    #: What ``stats()`` reads besides ``keeper.restarts``: lives as long as the env.
    stats: EnvStats = field(default_factory=EnvStats)
    supervisor: WorkerSupervisor | None = None
    report: SupervisionReport | None = None
    closing: bool = False
    close_reason: str = "close"
    worker_pids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keeper = SlotKeeper(self.options)
        self.stats.restarts = self.keeper.restarts

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (a collector worker's) starts its workers by TorchRL's start method, decided
        # where it runs, not by the sender's preloaded server.
        return (EnvState, (self.options, None))


def start_workers(env: Any, state: EnvState, start_upstream: Callable[[], None]) -> None:
    """Start ``env``'s workers through TorchRL's ``start_upstream``, supervised from birth; a
    start whose worker passed ``start_timeout`` is retried whole within ``max_restarts``."""
    while True:
        try:
            _start_once(env, state, start_upstream)
            return
        except WorkerStartTimeoutError as err:
            keeper = state.keeper
            if not keeper.restarts_on or not keeper.budget.allows(time.monotonic()):
                raise
            log.warning("%s; starting all workers again (max_restarts=%d)", err, state.options.max_restarts)


class StartWatch:
    """Bounds TorchRL's start-up handshake by ``start_timeout``: at the deadline, each worker
    that has not built its env (no ``_stacks.built_path`` file) gets its stacks taken and is
    killed with its process group; TorchRL's wait for its "started" then ends in EOF."""

    def __init__(self, env: Upstream, supervisor: WorkerSupervisor, timeout: float | None) -> None:
        self.env, self.supervisor, self.timeout = env, supervisor, timeout
        #: Per slot killed: its pid and stacks (written by the watch thread, read after its join).
        self.timed_out: dict[int, tuple[int, str | None]] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        #: When the watch began, on ``_identity.clock()``: a worker of this start was born after it.
        self._since = _identity.clock()

    def __enter__(self) -> StartWatch:
        self._since = _identity.clock()
        if self.timeout is not None:
            self._thread = threading.Thread(target=self._watch, name="torchrl_ext-start-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        assert self.timeout is not None
        if self._done.wait(self.timeout):
            return
        for index, process in enumerate(list(self.env.workers or [])):
            report = self.supervisor.report_path(index)
            pid = process.pid
            if pid is None or os.path.exists(_stacks.built_path(report)) or process.exitcode is not None:
                continue
            try:
                proc = psutil.Process(pid)
                ctime = _identity.start_time(proc)
            except psutil.Error:
                continue
            if ctime + _identity.BIRTH_SLACK < self._since:
                continue  # its pid is a stranger's now: born before this start began
            stacks = _stacks.capture(pid, ctime, report)
            # A spawned worker still importing has not made its own group yet: kill it alone.
            if _platform.process_group_of(pid) == pid:
                _platform.kill_process_group(pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                proc.kill()
            self.timed_out[index] = (pid, stacks)

    def failure(self) -> WorkerStartTimeoutError | None:
        if not self.timed_out:
            return None
        index = min(self.timed_out)
        pid, stacks = self.timed_out[index]
        assert self.timeout is not None
        name = describe_factory(self.env.factory_of(index))
        return WorkerStartTimeoutError(index, pid, self.timeout, name, stacks=stacks)


def _start_once(env: Any, state: EnvState, start_upstream: Callable[[], None]) -> None:
    options = state.options
    step_path_off = switched_off()  # raises on a value that does not parse, before anything starts
    current = multiprocessing.current_process()
    if current.daemon:
        raise DaemonicParentError(current.name)
    upstream = Upstream(env)
    # TorchRL >= 0.15 resolves an unset use_buffers once the workers sent their specs.
    check_after = (
        options.supervised_wait and upstream.use_buffers is None and bool(upstream.metadata_from_workers)
    )
    if options.supervised_wait and not check_after:
        _check_restartable(upstream)
    plan = StartPlan.make(options, state.preload_modules, upstream.mp_start_method)
    state.stats.server_kind, state.stats.server_fallback = plan.server
    tag = new_env_tag()
    label = f"ManagedParallelEnv[{tag.env_id}]"
    fifo = _reaper_client.acquire()
    keeper = state.keeper
    supervisor = WorkerSupervisor(
        tag,
        options.shutdown_timeout,
        label,
        base_dir=os.path.dirname(fifo),
        stats=state.stats if options.collect_stats else None,
    )
    plan.watch_server(fifo)
    # Our config travels next to each worker's kwargs, not around its factory: see _compat.
    user_kwargs = upstream.env_kwargs
    upstream.env_kwargs = [
        ConfiguredKwargs(
            kwargs,
            WorkerConfig(
                index=i,
                tag=str(tag),
                daemon_workers=options.daemon_workers,
                arm_pdeathsig=plan.arm_pdeathsig,
                owner_pid=plan.owner[0],
                owner_create_time=plan.owner[1],
                report_path=supervisor.report_path(i),
                reaper_fifo=fifo,
                done_fifo=None if options.spin == float("inf") else supervisor.done_signal.path,
                child_start_method=plan.child_start_method,
                owner_raises_errors=options.raises_env_errors,
                command_spin=options.command_spin,
                step_path_off=step_path_off,
            ),
        )
        for i, kwargs in enumerate(user_kwargs)
    ]
    install_fault_check()
    hosts = Hosts(len(user_kwargs), options.envs_per_worker) if options.envs_per_worker > 1 else None
    exit_with_parent = options.exit_with_parent
    if exit_with_parent is None:
        exit_with_parent = _lifecycle.multiprocessing_parent() is not None
    _lifecycle.register(env, options.handle_signals, options.reap_orphans, exit_with_parent)
    watch = StartWatch(upstream, supervisor, options.start_timeout)
    try:
        with (
            managed_worker_targets(),
            worker_context(env, plan.context),
            plan.tagged(tag),
            co_hosting(hosts),
            keeper.recording() as started,
            watch,
        ):
            start_upstream()
    except BaseException as err:
        failure = abort_start(env, supervisor, err, options.shutdown_timeout)
        failure = watch.failure() or failure
        if failure is None:
            explain_pickling(err, plan, upstream, user_kwargs)
            raise
        raise_failure(failure)
    finally:
        upstream.env_kwargs = user_kwargs
    processes: list[Any] = upstream.workers
    try:
        if check_after:
            _check_restartable(upstream, resolved_by_torchrl=True)
        keeper.adopt(started, len(processes), plan, fifo)
    except (RuntimeError, ValueError) as err:
        abort_start(env, supervisor, err, options.shutdown_timeout)
        raise
    # Losses (not failures) from here on: the start succeeded (a failed one reports deaths).
    supervisor.enable_restarts(keeper.restarts_on, replaceable=options.replaceable_workers)
    upstream.channels = supervisor.attach(processes, upstream.channels, hosts)
    keeper.attached(env, supervisor)
    upstream.workers = SupervisedWorkers(processes, supervisor.check)
    supervisor.done_signal.spare_core = has_spare_core(len(processes))
    state.worker_pids = [p.pid for p in processes]
    state.supervisor = supervisor
    log.debug("%s started %d workers: %s", label, len(processes), state.worker_pids)


def explain_pickling(err: BaseException, plan: StartPlan, upstream: Upstream, kwargs: list[Any]) -> None:
    """A start that failed before any worker did, under a start method that pickles each
    worker's factory and kwargs (all but fork): if one of them does not pickle, a note on
    ``err`` (whose type stays the one pickling raised) names it, its worker, and the fixes."""
    if plan.start_method == "fork" or not isinstance(err, Exception):
        return
    start = (
        "the preloaded fork server (the default start)"
        if plan.context is not None
        else f"mp_start_method={plan.start_method!r}"
    )
    probed: set[tuple[int, int]] = set()
    for index, worker_kwargs in enumerate(kwargs):
        fn = upstream.factory_of(index)
        if (id(fn), id(worker_kwargs)) in probed:
            continue
        probed.add((id(fn), id(worker_kwargs)))
        note = unpicklable_note(
            fn, worker_kwargs, name=describe_factory(fn), start=start, destination=f"worker {index}"
        )
        if note is not None:
            err.add_note(note)
            return


def _check_restartable(env: Upstream, resolved_by_torchrl: bool = False) -> None:
    """Restarts and hang detection work on TorchRL's shared buffers, with tensors only."""
    if not env.use_buffers:
        resolved = " (TorchRL chose it: the workers' specs are dynamic)" if resolved_by_torchrl else ""
        raise ValueError(
            "max_restarts, step_timeout and recycling need TorchRL's shared buffers; this env has "
            f"use_buffers=False{resolved}. Pass use_buffers=True, or max_restarts=0, "
            "step_timeout=None and no recycle_memory/recycle_every."
        )
    if env.non_tensor_keys:
        raise ValueError(
            "max_restarts, step_timeout and recycling are not supported for envs with non-tensor "
            f"specs ({env.non_tensor_keys}); pass max_restarts=0, step_timeout=None and no "
            "recycle_memory/recycle_every."
        )


def abort_start(
    env: Any, supervisor: WorkerSupervisor, err: BaseException, timeout: float
) -> BaseException | None:
    """Undo a failed start: kill what started; the failure that explains it, if a worker's."""
    upstream = Upstream(env)
    workers = list(upstream.workers or [])
    channels = list(upstream.channels or [])
    failure: BaseException | None = None
    try:
        if workers:
            supervisor.attach(workers, channels[: len(workers)])
            if not isinstance(err, KeyboardInterrupt | SystemExit):
                supervisor.failure(wait=1.0)
                failure = supervisor.startup_failure()
        supervisor.shutdown("start-up failure", timeout=min(timeout, 3.0))
    finally:
        supervisor.stop()
        release_workers(env)
        upstream.closed = True
    return failure


def stop_workers(env: Any, state: EnvState) -> None:
    """``_shutdown_workers``: the bounded close of ``env``'s workers (NOTE [shutdown order]),
    once; not from a forked copy of this process, whose workers are its parent's."""
    supervisor = state.supervisor
    if supervisor is None:
        return
    if not state.closing and supervisor.failure(wait=1.0) is not None:
        # TorchRL's wait loop calls this right after it sees a dead worker. The supervisor
        # has killed the dead worker's tree; the survivors are closed by the user's close().
        return
    state.supervisor = None
    state.worker_pids = supervisor.pids()  # no lock taken: this may be a forked copy
    if supervisor.owner_pid != os.getpid():
        return  # a forked copy (fork-context DataLoader worker, the user's own fork)
    upstream = Upstream(env)
    try:
        try:
            state.report = supervisor.shutdown(state.close_reason)
        except BaseException:
            # Interrupted (KeyboardInterrupt from a second Ctrl-C): kill fast, then re-raise.
            state.report = supervisor.shutdown("interrupted close", timeout=0.5)
            raise
    finally:
        if upstream.use_buffers:
            upstream.drop_buffers()
        state.stats.calls.ends = None  # it may hold views of the buffers
        state.keeper.forget()
        release_workers(env)
    log.debug("%s", state.report)


def release_workers(env: Any) -> None:
    """Forget ``env``'s workers after a close or a failed start: close the pipes and empty
    TorchRL's by-position lists (empty, not deleted: ``ParallelEnv.__getattr__`` would start
    workers), then stop the exit hooks and the reaper's watch of this env."""
    upstream = Upstream(env)
    for channel in upstream.channels or []:
        with contextlib.suppress(Exception):
            channel.close()
    upstream.workers = SupervisedWorkers.none()
    upstream.channels = []
    upstream.events = None
    upstream.step_event = None
    _lifecycle.unregister(env)
    _reaper_client.release()
