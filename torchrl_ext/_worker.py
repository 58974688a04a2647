"""The worker bootstrap: code that runs *inside* each ParallelEnv worker process.

While a :class:`ManagedParallelEnv` starts its workers, TorchRL's worker functions are
replaced by entries that find our :class:`WorkerConfig` next to the user's env kwargs (see
``_compat``) and call :func:`run_managed`: it prepares the process (own process group,
parent-death signal, tag, daemon flag, report to the reaper) and then runs TorchRL's own
worker loop. Exceptions the env raises are written to a report file for the parent before the
worker exits, and printed there by ``multiprocessing`` only when the parent may not raise them
(restarts on errors, recycling); after a normal "close" the worker ends its own descendants and
exits at once instead of waiting out interpreter teardown.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.process
import multiprocessing.util
import os
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _cpython, _identity, _platform, _reaper_client, _stacks
from ._channel import command_name
from ._done_signal import NotifyingFlags
from ._errors import DaemonicWorkerError
from ._hosts import HOST_STEP_BYTES
from ._step_path import STEP_BYTES, WorkerPlan, kwargs_reason
from ._wire import write_report

__all__ = ["WorkerConfig", "exit_now", "prepare_process", "run_managed"]

log = logging.getLogger("torchrl_ext")

#: Grace given to a worker's own descendants after a normal close before SIGKILL.
CHILD_GRACE = 1.0
#: The recycler's command to a standby, answered by this module and never seen by TorchRL's
#: loop: reset the env now, ahead of the slot's turn (NOTE [prepared reset]). The answer is
#: ``(PREPARE_RESET, True)``, or ``False`` when the env raised (its turn resets it again).
PREPARE_RESET = "torchrl_ext.prepare_reset"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to know about its supervision. Picklable."""

    index: int
    tag: str
    daemon_workers: bool
    arm_pdeathsig: bool
    owner_pid: int
    owner_create_time: float
    report_path: str
    reaper_fifo: str | None
    done_fifo: str | None = None
    #: Default start method inside the worker (what a DataLoader built there without a
    #: ``multiprocessing_context`` uses); ``None`` leaves the inherited one.
    child_start_method: str | None = None
    #: The owner raises every exception the env raises here, with the traceback this worker
    #: reports as its cause (``Options.raises_env_errors``): the worker does not print it too.
    owner_raises_errors: bool = False
    #: Longest spin of a worker on the managed step path for its next command, in seconds
    #: (``spin_wait``; 0: it sleeps on the pipe as TorchRL's loop does).
    command_spin: float = 0.0
    #: Why the main process runs TorchRL's step path by choice (``_step_path.switched_off``
    #: at the start); ``None``: this worker plans its steps where it can.
    step_path_off: str | None = None
    #: This process hosts other slots too (``_hosts``), and its first slot answers a batched
    #: step of every slot of it (``_hosts.HOST_STEP``). Set by the start, on the host's config only.
    host_step: bool = False


class _CommandRecorder:
    """Wraps the worker's end of the command pipe to remember the last command received."""

    def __init__(self, conn: Any, built_path: str | None = None) -> None:
        self._conn = conn
        self.last_command: str | None = None
        self.saw_eof = False
        self._built_path = built_path
        #: The env TorchRL's loop built in this worker, weakly (:meth:`keep`): the loop's
        #: ``del env`` at close must still drop the last reference.
        self._env: Callable[[], Any] = lambda: None
        #: The worker's own step path (``_step_path``), or ``None``: TorchRL's loop answers all.
        self.plan: WorkerPlan | None = None
        #: The other slots of this host, whose steps this worker answers with its own
        #: (``_hosts``; set once, before the loop runs).
        self.group: list[_Member] = []
        # Bound once: the worker loop polls before every command (no __getattr__ per step).
        self.poll = conn.poll
        self.send: Callable[[Any], None] = self._first_send

    def _first_send(self, obj: Any) -> None:
        """TorchRL's "started" (its env is built): say so in a file first, for start_timeout."""
        self.send = self._conn.send
        if self._built_path is not None:
            with contextlib.suppress(OSError):
                open(self._built_path, "wb").close()
        self._conn.send(obj)

    def recv(self) -> Any:
        plan = self.plan
        while True:
            if plan is not None and plan.ready:
                plan.await_command(self.poll)
            try:
                raw = self._conn.recv_bytes()
            except EOFError:
                self.saw_eof = True
                raise
            if plan is not None and plan.ready and raw == STEP_BYTES:  # the hot path
                self.last_command = "step_and_maybe_reset"
                plan.step_and_maybe_reset()
                continue
            if raw == HOST_STEP_BYTES:  # a host's batched step (_hosts): every slot of it
                self.last_command = "step_and_maybe_reset"
                self.step_host()
                continue
            msg = ForkingPickler.loads(raw)
            if isinstance(msg, tuple) and msg and msg[0] == PREPARE_RESET:
                # ours: answered here, the loop waits for the next
                self._conn.send((PREPARE_RESET, _PreparedReset.prepare(self._env())))
                continue
            self.last_command = command_name(msg) or self.last_command
            if plan is not None and isinstance(msg, tuple) and msg and isinstance(msg[0], str):
                if plan.ready and len(msg) == 2 and plan.handle(msg[0], msg[1]):
                    continue
                if msg[0] == "init":  # TorchRL's loop builds its views too, on return
                    plan.init()
            return msg

    def step_host(self) -> None:
        """Step this slot's env and the host's other slots' (one wake-up byte, the last)."""
        plan = self.plan
        if plan is None or not self.group:
            raise RuntimeError("torchrl_ext: a host step reached a worker that does not host other slots")
        plan.step_and_maybe_reset(quiet=True)
        last = len(self.group) - 1
        for n, member in enumerate(self.group):
            other = member.recorder
            other.last_command = self.last_command
            assert other.plan is not None  # run_managed groups planned slots only
            other.plan.wait_ready()
            try:
                other.plan.step_and_maybe_reset(quiet=n < last)
            except Exception as exc:  # that slot's env raised: reported as that slot's
                raise _RaisedInHostedSlot(member.config, exc) from exc

    def kept_env(self) -> Any:
        """The env TorchRL's loop built here (``None`` before it exists)."""
        return self._env()

    def keep(self, env: Any) -> None:
        """Remember ``env`` (weakly) for a prepared reset."""
        with contextlib.suppress(TypeError):  # no weak reference to it: nothing prepared
            self._env = weakref.ref(env)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _KeepsEnv:
    """Stands in for the env factory in TorchRL's loop: builds the env as the loop would (same
    callable, same kwargs) and has the recorder keep it, for a prepared reset."""

    __slots__ = ("_factory", "_recorder")

    def __init__(self, factory: Callable[..., Any], recorder: _CommandRecorder) -> None:
        self._factory = factory
        self._recorder = recorder

    def __call__(self, **kwargs: Any) -> Any:
        env = self._factory(**kwargs)
        self._recorder.keep(env)
        return env


class _PreparedReset:
    """NOTE [prepared reset]: a recycled slot's next worker resets its env while the old one
    still runs the slot's last episode, and its turn only publishes that result.

    The recycler sends a standby :data:`PREPARE_RESET` once it is seeded. The env is reset
    then, exactly as the slot's reset would do it (``env.reset()``: no input, no kwargs), and
    this object stands in for the env's ``reset`` (in the instance ``__dict__``) for one call:
    TorchRL's loop, sent the slot's reset, runs its own code (the shared buffers, the done
    flag) around the result kept here. A reset with an input or kwargs (but a false
    ``set_state``) gets the env's own reset with them, after the prepared one. Once called, the
    env's own method is back.
    """

    __slots__ = ("_env", "_result")

    def __init__(self, env: Any, result: Any) -> None:
        self._env = weakref.ref(env)  # it sits in the env's __dict__: no reference cycle
        self._result = result

    @classmethod
    def prepare(cls, env: Any) -> bool:
        """Reset ``env`` now and keep the result for its next plain reset; False if it raised
        (nothing is kept: the next reset is the env's own, which raises as it will)."""
        if env is None or "reset" in env.__dict__:
            return False
        try:
            result = env.reset()
        except Exception:
            log.debug("prepared reset failed; the slot's reset will reset the env itself", exc_info=True)
            return False
        env.__dict__["reset"] = cls(env, result)
        return True

    def __call__(self, tensordict: Any = None, **kwargs: Any) -> Any:
        env = self._env()
        assert env is not None  # it is the env's own attribute being called
        env.__dict__.pop("reset", None)
        if _is_plain_reset(tensordict, kwargs):
            return self._result
        return env.reset(tensordict, **kwargs)


def _is_plain_reset(tensordict: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``env.reset(tensordict, **kwargs)`` is the one a prepared reset did: no input
    and no kwargs but a false ``set_state`` (what TorchRL >= 0.14's ``ParallelEnv`` passes the
    workers of an env that supports it, and what such an env resolves no input to anyway)."""
    return tensordict is None and all(key == "set_state" and not value for key, value in kwargs.items())


class _FlagsKeptAtClose:
    """TorchRL's shared done flags, except the write its loop makes after "close": a recycled
    worker closes while its successor already answers through the same slot's flag (TorchRL's
    own close waits on the worker's event, and ours on its exit, never on the flag)."""

    __slots__ = ("_flags", "_recorder")

    def __init__(self, flags: Any, recorder: _CommandRecorder) -> None:
        self._flags = flags
        self._recorder = recorder

    def __setitem__(self, index: int, value: int) -> None:
        if self._recorder.last_command != "close":
            self._flags[index] = value

    def __getitem__(self, index: int) -> Any:
        return self._flags[index]

    def __len__(self) -> int:
        return len(self._flags)


class _GCSkippedAfterClose:
    """Stands in for the ``gc`` module in TorchRL's worker loop.

    On "close" the loop runs ``gc.collect()`` right before the worker exits; with torch
    loaded that one collection takes about 0.2 s on a small machine and only frees memory
    the exit frees anyway. Objects left for the collector (a DataLoader iterator whose
    workers are still running) are handled by :func:`end_own_descendants` instead.
    """

    def __init__(self, *recorders: _CommandRecorder) -> None:
        self._recorders = recorders

    def collect(self, *args: Any) -> int:
        if any(r.last_command == "close" for r in self._recorders):
            return 0
        return gc.collect(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)


def _guarded_start(original: Callable[..., Any]) -> Callable[..., Any]:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        if _cpython.daemon_in_config(multiprocessing.current_process()):
            raise DaemonicWorkerError(f"the child process {self.name!r}")
        original(self)

    start.__wrapped__ = original  # type: ignore[attr-defined]
    return start


def prepare_process(config: WorkerConfig) -> None:
    """Set up this worker process before the user's env exists."""
    _platform.new_process_group()
    # The parent-death signal is not retroactive: if the owner already died, nobody will send it.
    if (
        config.arm_pdeathsig
        and _platform.set_parent_death_signal(signal.SIGKILL)
        and (not _identity.running(config.owner_pid, config.owner_create_time) or os.getppid() == 1)
    ):
        os._exit(1)
    os.environ[_identity.OWNER_VAR] = config.tag
    os.environ[_identity.WORKER_VAR] = str(config.index)
    if config.reaper_fifo:
        pid, ctime = _identity.me()
        _reaper_client.notify_watch(config.reaper_fifo, pid, ctime, os.getpgrp())
    if config.child_start_method is not None:
        multiprocessing.set_start_method(config.child_start_method, force=True)
    current = multiprocessing.current_process()
    if config.daemon_workers:
        base = multiprocessing.process.BaseProcess
        if not hasattr(base.start, "__wrapped__"):
            base.start = _guarded_start(base.start)  # type: ignore[method-assign]
    else:
        # TorchRL <= 0.10 hard-codes daemonic workers; the flag only matters inside this
        # process (it forbids children), and this process's children are supervised.
        _cpython.set_daemon_in_config(current, False)


def _plan_steps(recorder: _CommandRecorder, kwargs: dict[str, Any], config: WorkerConfig) -> None:
    """Give the recorder this worker's own step path where it can serve (``_step_path``)."""
    from ._compat import WORKER_KWARGS  # _compat imports this module

    index = kwargs.get(WORKER_KWARGS["worker_index"])
    reason = kwargs_reason(kwargs, config.step_path_off)
    if reason is not None or index is None:
        log.debug("worker %s steps through TorchRL's loop: %s", index, reason)
        return
    env = recorder.kept_env
    shared, flags = kwargs[WORKER_KWARGS["shared_buffer"]], kwargs[WORKER_KWARGS["done_flags"]]
    reset_keys = kwargs.get(WORKER_KWARGS["reset_keys"])
    recorder.plan = WorkerPlan(env, shared, reset_keys, flags, int(index), config.command_spin)


def end_own_descendants() -> None:
    """TERM, wait, KILL and reap every descendant of this process."""
    children = _identity.descendants(os.getpid())
    _identity.kill_and_reap(children, CHILD_GRACE, what="worker child", kill_wait=1.0)


class _RaisedInHostedSlot(Exception):
    """The env of another slot of this host raised while this worker stepped it (``_hosts``):
    its report is that slot's."""

    def __init__(self, config: WorkerConfig, error: Exception) -> None:
        super().__init__(f"slot {config.index}'s env raised {type(error).__name__}: {error}")
        self.config = config
        self.error = error


class _Member:
    """One slot's TorchRL worker loop in this process: its kwargs wrapped as ours wraps them."""

    def __init__(self, config: WorkerConfig, kwargs: dict[str, Any]) -> None:
        from torchrl.envs import EnvBase

        from ._compat import WORKER_KWARGS  # _compat imports this module

        self.config = config
        self.kwargs = kwargs
        flags_key, pipe_key = WORKER_KWARGS["done_flags"], WORKER_KWARGS["pipe"]
        raw_flags = kwargs.get(flags_key)
        if config.done_fifo and kwargs.get(flags_key) is not None:
            # TorchRL >= 0.11 reports "done" through shared flags; wake the sleeping main process too.
            kwargs[flags_key] = NotifyingFlags(kwargs[flags_key], config.done_fifo)
        recorder = _CommandRecorder(kwargs[pipe_key], _stacks.built_path(config.report_path))
        kwargs[pipe_key] = recorder
        factory_key = WORKER_KWARGS["factory"]
        factory = kwargs[factory_key]
        if isinstance(factory, EnvBase):  # TorchRL's loop uses an env passed itself as is
            recorder.keep(factory)
        else:
            kwargs[factory_key] = _KeepsEnv(factory, recorder)
        if kwargs.get(flags_key) is not None:
            kwargs[flags_key] = _FlagsKeptAtClose(kwargs[flags_key], recorder)
        _plan_steps(recorder, kwargs, config)
        if recorder.plan is not None:
            recorder.plan.quiet_flags = raw_flags
        self.recorder = recorder

    def run(self, original: Callable[..., Any]) -> None:
        """TorchRL's loop for this slot, until a close or the parent's end; an env error is
        reported (its slot's report file) and raised."""
        recorder, config = self.recorder, self.config
        try:
            original(**self.kwargs)
        except BaseException as exc:
            if recorder.saw_eof or recorder.last_command == "close":
                # The parent closed the pipe (it is closing us, or it died): not an env error.
                return
            if isinstance(exc, SystemExit | KeyboardInterrupt):
                raise
            error, command = exc, recorder.last_command
            if isinstance(exc, _RaisedInHostedSlot):  # another slot's env, stepped by this worker
                config, error = exc.config, exc.error
            if write_report(config.report_path, error, command) and config.owner_raises_errors:
                # One traceback per failure: the owner raises it with this one as its cause, so
                # multiprocessing's own print of it (at the same exit code, 1) would be a second.
                raise SystemExit(1) from None
            raise


def run_managed(
    original: Callable[..., Any],
    config: WorkerConfig,
    kwargs: dict[str, Any],
    hosted: Sequence[tuple[WorkerConfig, dict[str, Any]]] = (),
) -> None:
    """Prepare this worker process, then run TorchRL's worker loop ``original`` in it: for its
    own slot, and for each slot it hosts (``hosted``, ``_hosts``) in a thread of its own."""
    from torchrl.envs import batched_envs

    from ._compat import GC_NAME  # _compat imports this module

    prepare_process(config)
    _stacks.arm(_stacks.stacks_path(config.report_path))
    members = [_Member(config, kwargs), *(_Member(c, kw) for c, kw in hosted)]
    if getattr(batched_envs, GC_NAME, None) is gc:  # this process runs only these workers' loops
        setattr(batched_envs, GC_NAME, _GCSkippedAfterClose(*(m.recorder for m in members)))
    if config.host_step:
        first = min(members, key=lambda m: m.config.index)
        plans = [m.recorder.plan for m in members if m is not first]
        if first.recorder.plan is None or any(p is None for p in plans):  # decided on the same kwargs
            raise RuntimeError("torchrl_ext: a host was told to step its slots as one, but they cannot plan")
        first.recorder.group = [m for m in members if m is not first]
        for member in first.recorder.group:  # their steps come through the first slot's pipe
            member.recorder.plan.sleep_on_pipe()  # type: ignore[union-attr]
    host = _Host(original, len(members))
    for member in members[1:]:
        threading.Thread(
            target=host.run, args=(member,), name=f"torchrl_ext-slot-{member.config.index}"
        ).start()
    host.run(members[0])


class _Host:
    """The loops of one worker process (one slot's, or a host's, ``_hosts``): the process ends
    when the last loop ended normally, or at once when one ended in an error (its slot's
    report written: every slot of a host is lost with it)."""

    def __init__(self, original: Callable[..., Any], loops: int) -> None:
        self._original = original
        #: One slot's process: its loop's error ends it as upstream's worker's does. Fixed.
        self._single = loops == 1
        #: Loops still running; written under ``_lock`` by each loop's thread as it ends.
        self._running = loops
        self._lock = threading.Lock()

    def run(self, member: _Member) -> None:
        try:
            member.run(self._original)
        except BaseException:
            if self._single:
                raise  # multiprocessing reports it (unless it is our SystemExit) and exits
            if not isinstance(sys.exc_info()[1], SystemExit) and not member.config.owner_raises_errors:
                traceback.print_exc()
            end_own_descendants()
            exit_now(1)
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            end_own_descendants()
            exit_now(0)


def exit_now(code: int) -> None:
    """Run multiprocessing's finalizers, flush stdio and leave without interpreter teardown.

    The finalizers unlink the named semaphores (``/dev/shm/sem.mp-*``) of spawn-context queues
    the env created (a DataLoader's); skipping them would leave one set per closed worker.
    Call it only once the descendants are gone: it joins children.
    """
    with contextlib.suppress(Exception):
        _cpython.run_exit_finalizers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
