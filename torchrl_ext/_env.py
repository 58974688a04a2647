"""``ManagedParallelEnv``: TorchRL's ``ParallelEnv`` whose workers may have children.

Only the ``ParallelEnv`` overrides live here, each a short delegation: the options
(``_options``), the start plan (``_plan``), the start and the close (``_start``), what happens
around each call (``_calls``: the failure check, the wait, the measurement), ``stats()``
(``_stats``). TorchRL's private names are reached through ``_compat.Upstream`` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torchrl.envs import EnvBase, ParallelEnv

from . import _calls
from ._compat import (
    HAS_DAEMON_KWARG,
    HAS_SHUTDOWN_TIMEOUT_KWARG,
    Upstream,
    check_supported,
    default_start_method,
)
from ._errors import named_as_upstream
from ._marks import add_restart_keys
from ._options import DEFAULT_SHUTDOWN_TIMEOUT, Options
from ._plan import preload_modules, spec_reader
from ._policy import DEFAULT_RESTART_BACKOFF, RestartRecord
from ._report import SupervisionReport
from ._start import EnvState, start_workers, stop_workers
from ._stats import RESET, STEP, STEP_AND_MAYBE_RESET, StatsView, snapshot, stats_view
from ._step_path import StepPath
from ._step_path import step_and_maybe_reset as managed_step_and_maybe_reset

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "ManagedParallelEnv"]

log = logging.getLogger("torchrl_ext")


def _upstream_accepts(num_workers: int, create_env_fn: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``ParallelEnv.__init__`` takes these arguments (a misspelt keyword: no)."""
    try:
        inspect.signature(ParallelEnv.__init__).bind(None, num_workers, create_env_fn, **kwargs)
    except TypeError:
        return False
    return True


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
            ``spin_wait`` seconds, and only while results usually arrive within that; its
            workers spin as long for their next command, on the same rule.
            ``None`` (default): 250 microseconds; ``0``: never spin;
            ``float("inf")``: TorchRL's own wait (workers sleep on the pipe).
        exit_with_parent: when the process that started this one through ``multiprocessing``
            dies (the training process of a collector worker), close the envs and end this
            process with SIGTERM. ``None`` (default): when this process was started by
            ``multiprocessing``; a top-level program is never affected.
        preload: with non-daemonic workers, no ``mp_start_method`` and no global start method
            chosen by the program, workers (and the spec-reading env) are forked from a
            preloaded, supervised fork server that has already imported torch, TorchRL and the
            factory's module (see docs/guarantees.md, "Fast start"). A sequence of module names adds
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
            ``0`` (default): the first loss raises :class:`WorkerDiedError` (fail fast).
            Needs TorchRL's shared buffers (``use_buffers``, the default) and tensor-only specs.
        restart_window: seconds over which ``max_restarts`` is counted; ``None`` (default):
            the env's whole life.
        step_timeout: seconds a worker may take to answer a step or reset; one that takes
            longer is killed with its tree, then restarted (within ``max_restarts``) or
            :class:`WorkerHungError` is raised. ``None`` (default): TorchRL's own wait.
        restart_on_error: an exception raised by the env's own code restarts the slot too
            (within ``max_restarts``): ``True`` for any, or an exception type or tuple of them
            (as ``except`` takes) for those only; by default it is re-raised with its type and
            traceback.
        restart_backoff: ``(first, cap)`` seconds: the second restart in a row of one slot
            waits ``first``, each further one twice as long, at most ``cap`` (a row ends once
            a slot's worker ran 60 s). ``None``: never wait. Default ``(0.1, 10.0)``.
        on_restart: called in the main process with each :class:`RestartRecord` (restarts and
            recycles) once the new worker is ready; what it raises is logged, not raised.
        start_timeout: seconds a worker may take to build its env (the first start and every
            replacement); past it, it is killed with its tree and, within ``max_restarts``,
            started again, else :class:`WorkerStartTimeoutError`. ``None`` (default):
            TorchRL's own wait.
        recycle_memory: bytes, or a string such as ``"4GiB"``: once a worker's tree (it and
            all its descendants, DataLoader workers included) holds more of its own (its USS:
            the pages no other process maps; RSS where ``/proc/PID/smaps_rollup`` cannot be
            read), its slot's next reset goes to a fresh worker started ahead of time, and the
            old one is closed; no transition is marked (see docs/restarts.md, "Recycling").
        recycle_every: the same after this many episodes (resets) of one worker.
        envs_per_worker: how many of the envs one worker process steps (default 1: one process
            per env, as upstream). With more envs than cores, ``k > 1`` puts envs ``0..k-1`` in
            one process, ``k..2k-1`` in the next, and so on: a batched step wakes one process per
            ``k`` envs and steps them one after the other there (see docs/design.md, "Several
            envs per worker"). The envs of a process share its global state (torch's global RNG:
            an env that draws from it is not bit for bit upstream's), and a process that dies
            loses all its envs (each is restarted, as its own process, within ``max_restarts``).
            Needs TorchRL >= 0.11; not with ``recycle_memory``/``recycle_every``.
        **kwargs: everything ``torchrl.envs.ParallelEnv`` accepts.

    Example:
        >>> from torchrl.envs import GymEnv  # doctest: +SKIP
        >>> env = ManagedParallelEnv(2, lambda: GymEnv("Pendulum-v1"), daemon_workers=False)  # doctest: +SKIP
        >>> td = env.rollout(10)  # doctest: +SKIP
        >>> env.close()  # doctest: +SKIP
        >>> env.supervision_report.clean  # doctest: +SKIP
        True
    """

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
        restart_on_error: bool | type[BaseException] | tuple[type[BaseException], ...] = False,
        restart_backoff: tuple[float, float] | None = DEFAULT_RESTART_BACKOFF,
        on_restart: Callable[[RestartRecord], Any] | None = None,
        start_timeout: float | None = None,
        recycle_memory: int | str | None = None,
        recycle_every: int | None = None,
        collect_stats: bool = True,
        envs_per_worker: int = 1,
        **kwargs: Any,
    ) -> None:
        if not _upstream_accepts(num_workers, create_env_fn, kwargs):
            # TorchRL's own TypeError, word for word, raised by its own signature before any of
            # its code runs, and before anything of ours starts (the preloaded server included).
            super().__init__(num_workers, create_env_fn, **kwargs)
        options = Options.validated(
            daemon_workers=daemon_workers,
            daemon=daemon,
            shutdown_timeout=shutdown_timeout,
            handle_signals=handle_signals,
            reap_orphans=reap_orphans,
            metadata_in_subprocess=metadata_in_subprocess,
            spin_wait=spin_wait,
            exit_with_parent=exit_with_parent,
            preload=preload,
            child_start_method=child_start_method,
            max_restarts=max_restarts,
            restart_window=restart_window,
            step_timeout=step_timeout,
            restart_on_error=restart_on_error,
            restart_backoff=restart_backoff,
            on_restart=on_restart,
            start_timeout=start_timeout,
            recycle_memory=recycle_memory,
            recycle_every=recycle_every,
            collect_stats=collect_stats,
            envs_per_worker=envs_per_worker,
        )
        check_supported()
        modules = preload_modules(options, create_env_fn, kwargs.get("mp_start_method"))
        self.__dict__["_managed_state"] = EnvState(options, modules)
        self.__dict__["_managed_step_path"] = StepPath()
        if HAS_DAEMON_KWARG:
            kwargs["daemon"] = options.daemon_workers
        if HAS_SHUTDOWN_TIMEOUT_KWARG:
            kwargs["shutdown_timeout"] = options.shutdown_timeout
        with spec_reader(options, modules, kwargs):
            super().__init__(num_workers, create_env_fn, **kwargs)

    @property
    def _state(self) -> EnvState:
        state: EnvState = self.__dict__["_managed_state"]
        return state

    @property
    def start_method(self) -> str:
        """How workers start: ``"preloaded"`` (forks of the preloaded server) or the
        ``multiprocessing`` start method TorchRL uses."""
        if self._state.preload_modules is not None:
            return "preloaded"
        return default_start_method(Upstream(self).mp_start_method)

    # ------------------------------------------------------------------ public extras
    @property
    def daemon_workers(self) -> bool:
        """Whether workers are daemonic (and so may not have children)."""
        return self._state.options.daemon_workers

    @property
    def shutdown_timeout(self) -> float:
        """Upper bound, in seconds, of ``close()``."""
        return self._state.options.shutdown_timeout

    @shutdown_timeout.setter
    def shutdown_timeout(self, value: float) -> None:
        # TorchRL >= 0.13 assigns this attribute in its own __init__.
        state: EnvState | None = self.__dict__.get("_managed_state")
        if state is not None:
            state.options = dataclasses.replace(state.options, shutdown_timeout=float(value))
            # Read at the next start, as upstream's (its _start_workers copies it to _timeout).
            state.keeper.use_options(state.options)

    @property
    def supervision_report(self) -> SupervisionReport | None:
        """What the last ``close()`` had to do, per worker (``None`` before the first close)."""
        return self._state.report

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the current (or last) workers."""
        supervisor = self._state.supervisor
        return supervisor.pids() if supervisor is not None else list(self._state.worker_pids)

    @property
    def restarts(self) -> list[RestartRecord]:
        """Every worker restart of this env so far, oldest first (see ``max_restarts``)."""
        return list(self._state.keeper.restarts)

    def stats(
        self, *, workers: StatsView | bool = "aggregate", reset: bool = False
    ) -> dict[str, float | int]:
        """A cheap snapshot of what the env's workers did and use, in TorchRL's ``stats()``
        convention: a flat mapping of scalars, safe to call from any thread while the env runs
        (no worker is asked anything), which ``LoggerMonitor(logger).watch(env)`` logs.

        ``workers`` chooses the view, as for TorchRL's multi-process collectors:
        ``"aggregate"`` (default), the env's keys; ``"per_worker"``, the keys of each slot
        ``i``, ``worker_<i>/<metric>``, instead; ``"both"``, the union. ``workers`` and
        ``workers_alive`` are in every view. A bool, this method's former argument, is
        deprecated (``DeprecationWarning``): ``True`` is ``"both"``, ``False`` is
        ``"aggregate"``. Any other value raises ``ValueError``.

        The env's keys count calls and resets (``steps``, ``boundary_steps``, ``resets``,
        ``reset_calls``), time them (``step_ms_p50``/``_p95``/``_max``, ``boundary_ms_*``,
        ``reset_ms_*``, ``wait_s``), count losses, restarts and recycles by cause, and measure
        the live workers' trees (``tree_rss_bytes``, ``tree_pss_bytes``, ``tree_uss_bytes``,
        ``descendants``, ``fds``); each slot's are ``worker_<i>/alive``, ``/resets``,
        ``/restarts``, ``/recycles`` and, once sampled, its tree's. docs/watching.md defines
        every key, when each is NaN, and how often the trees are sampled.
        ``reset=True`` clears the call counters, the latency windows and ``wait_s`` after the
        snapshot, whatever the view (the loss and restart counts are the env's history and
        stay). With ``collect_stats=False`` nothing is measured: the latencies and the tree are
        NaN or 0.

        Example:
            >>> from torchrl.envs import PendulumEnv
            >>> env = ManagedParallelEnv(2, PendulumEnv, mp_start_method="fork")  # not started yet
            >>> sorted(env.stats(workers="per_worker"))
            ['worker_0/alive', 'worker_0/recycles', 'worker_0/resets', 'worker_0/restarts',
             'worker_1/alive', 'worker_1/recycles', 'worker_1/resets', 'worker_1/restarts',
             'workers', 'workers_alive']
            >>> stats = env.stats(workers="both")
            >>> stats["steps"], stats["workers_alive"], stats["worker_1/resets"]
            (0, 0, 0)
            >>> "worker_0/alive" in env.stats()  # "aggregate"
            False
            >>> env.close(raise_if_closed=False)
        """
        view = stats_view(workers)
        state = self._state
        supervisor = state.supervisor
        alive = supervisor.alive() if supervisor is not None else []
        out = snapshot(
            state.stats,
            num_workers=int(self.num_workers),
            alive=alive,
            restarts=list(state.keeper.restarts),
            view=view,
            reset=reset,
        )
        path: StepPath = self.__dict__["_managed_step_path"]
        if view != "per_worker":
            out["managed_step_path"] = int(path.plan is not None)
            out["managed_steps"] = path.steps
            if reset:
                path.steps = 0
        return out

    def _set_properties(self) -> None:
        try:
            super()._set_properties()
        except Exception as err:  # TorchRL's spec checks name the class
            named_as_upstream(err, self)
            raise
        state: EnvState | None = self.__dict__.get("_managed_state")
        if state is not None and state.keeper.restarts_on:
            added = add_restart_keys(self)
            if Upstream(self).owns_workers:  # a view's keys are its owner's
                state.keeper.mark_keys = added

    # ------------------------------------------------------------------ start
    def _start_workers(self) -> None:
        start_workers(self, self._state, super()._start_workers)

    def _send_worker_buffers(self) -> None:
        """TorchRL >= 0.15 (#4341) hands each worker that sent its specs the shared buffers;
        what it sent is recorded, so that a replacement gets the same hand-off."""
        with self._state.keeper.starter.recording_handoff(Upstream(self)):
            super()._send_worker_buffers()  # type: ignore[misc,unused-ignore]

    def _cleanup_failed_worker_startup(self) -> None:
        """TorchRL >= 0.14 calls this on a failed start; ``_start.abort_start`` does it instead."""

    def _make_batched_view(self, indices: Sequence[int]) -> Any:
        """TorchRL >= 0.14 indexing: a view, remembered so that restarts reach its lists."""
        view = super()._make_batched_view(indices)
        self._state.keeper.remember_view(view)
        return view

    # ------------------------------------------------------------------ calls (_calls)
    def _wait_for_workers(self, workers_range: Any) -> None:
        _calls.wait(self, workers_range, super()._wait_for_workers)

    @functools.wraps(ParallelEnv.reset)  # upstream's signature and docstring
    def reset(self, tensordict: Any = None, **kwargs: Any) -> Any:
        try:
            return super().reset(tensordict, **kwargs)
        except Exception as err:  # TorchRL's checks of the arguments name the class
            named_as_upstream(err, self)
            raise

    def _reset(self, tensordict: Any, **kwargs: Any) -> Any:
        out = _calls.measured(self, RESET, functools.partial(super()._reset, **kwargs), tensordict)
        self._state.keeper.after_reset(Upstream(self), out)
        return out

    def _step(self, tensordict: Any) -> Any:
        return _calls.measured(self, STEP, super()._step, tensordict)

    def step_and_maybe_reset(self, tensordict: Any) -> Any:
        return _calls.measured(self, STEP_AND_MAYBE_RESET, self._managed_step_and_maybe_reset, tensordict)

    def _managed_step_and_maybe_reset(self, tensordict: Any) -> Any:
        if not Upstream(self).owns_workers:  # an indexed view: TorchRL's path
            return super().step_and_maybe_reset(tensordict)
        path: StepPath = self.__dict__["_managed_step_path"]
        return managed_step_and_maybe_reset(self, path, tensordict, super().step_and_maybe_reset)

    @property
    def step_path(self) -> tuple[str, str]:
        """Which path this env's batched steps take: ``("managed", why)`` (ours, see
        docs/design.md, "The step path") or ``("torchrl", why)`` (TorchRL's, as upstream).

        Example:
            >>> from torchrl.envs import PendulumEnv
            >>> env = ManagedParallelEnv(2, PendulumEnv, mp_start_method="fork")
            >>> env.step_path
            ('torchrl', 'not started yet')
            >>> _ = env.reset(); env.step_path[0]
            'managed'
            >>> env.close()
        """
        path: StepPath = self.__dict__["_managed_step_path"]
        if Upstream(self).owns_workers and Upstream(self).closed is False:
            path.plan_for(self)
        if path.reason is None:
            return ("managed", "tensor-only CPU specs in shared buffers")
        return ("torchrl", path.reason)

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        return _calls.seeded(self, functools.partial(super().set_seed, seed, static_seed))

    def state_dict(self) -> Any:
        return _calls.guarded(self, super().state_dict)

    def load_state_dict(self, state_dict: Any, **kwargs: Any) -> None:
        _calls.guarded(
            self, _calls.loaded, self, functools.partial(super().load_state_dict, state_dict, **kwargs)
        )

    # ------------------------------------------------------------------ close
    def _shutdown_workers(self) -> None:
        stop_workers(self, self._state)

    def close(self, *, raise_if_closed: bool = True) -> None:
        """Close the workers within ``shutdown_timeout``; never fails because a worker died.

        As upstream, closing a closed env raises ``RuntimeError`` unless
        ``raise_if_closed=False``, and closing an indexed view closes only the view. The report
        of what it took is in :attr:`supervision_report`.
        """
        if not Upstream(self).owns_workers:
            super().close(raise_if_closed=raise_if_closed)
            return
        state = self._state
        if state.closing:
            return
        if Upstream(self).closed:
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
            Upstream(self).closed = True

    def __enter__(self) -> ManagedParallelEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(raise_if_closed=False)

    def _close_for(self, reason: str) -> None:
        self._state.close_reason = reason
        self.close(raise_if_closed=False)

    def __del__(self) -> None:
        if not Upstream(self).owns_workers:
            with contextlib.suppress(Exception):
                self.close(raise_if_closed=False)
            return
        state: EnvState | None = self.__dict__.get("_managed_state")
        if state is not None and state.supervisor is not None and Upstream(self).closed is False:
            with contextlib.suppress(Exception):
                self._close_for("garbage collection")
