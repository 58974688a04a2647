"""Restarting a lost worker's slot: the engine, its budget, its records, the process templates.

What ``ManagedParallelEnv`` does when a worker is lost with ``max_restarts > 0`` (see
docs/restarts.md and the data flow in docs/design.md): the supervisor has already killed and
reaped the worker's tree and recorded the loss; :class:`RestartEngine`, on the env's calling
thread, checks the budget (:class:`RestartBudget`), starts a copy of the slot's original
``multiprocessing.Process`` (recorded unstarted by :func:`recording_starts`) on fresh pipes,
puts it in the owner's and every view's lists, and then either replays an in-flight reset, or
resets the new env and writes the marked transition (``_marks``), or, lost between calls, takes
the slot's next step command and answers it with the mark. The engine also owns the env's own
wait (restarts and ``step_timeout``), which is where losses and hangs are noticed mid-call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from . import _platform
from ._channel import is_forwarded_call
from ._compat import PER_START_KWARGS, WORKER_KWARGS, ConfiguredKwargs, Upstream, is_worker_entry
from ._cpython import process_kwargs, process_start_method, process_target, set_process_kwargs
from ._done_signal import Answers, DoneSignal
from ._errors import OomKill, WorkerDiedError, WorkerHungError
from ._marks import clear_marks, clear_root_marks, mark_transition
from ._options import Options
from ._record import Loss
from ._supervisor import LOST_PIPE_WAIT, WorkerSupervisor
from ._tag import tagged_spawns
from ._templates import copy_unstarted, recording_starts

if TYPE_CHECKING:  # _start builds the engine
    from ._start import StartPlan

__all__ = [
    "RestartBudget",
    "RestartEngine",
    "RestartRecord",
    "raise_failure",
]

log = logging.getLogger("torchrl_ext")

#: Longest pause between checks while a replacement starts or resets.
_POLL_SLICE = 0.02
#: How long the supervisor may take to handle a worker's exit (its tree's SIGKILL included).
_LOSS_WAIT = 10.0


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
    #: A hung worker's stacks, every thread, when it was killed (see ``WorkerHungError.stacks``).
    stacks: str | None = None
    #: Set when the kernel's OOM killer killed the old worker (see ``WorkerDiedError.oom``).
    oom: OomKill | None = None

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


# --------------------------------------------------------------------------- the engine
class _Lost(Exception):
    """A worker was lost while the env waited (restarts on): handled by the wait loop."""


class _Hung(Exception):
    """The wait passed ``step_timeout``: handled by the wait loop."""


class _ReplacementLost(Exception):
    """A replacement died or hung while starting; its loss is the supervisor's next."""


class RestartEngine:
    """Everything one env does about lost workers: its own wait, the budget, the replacements,
    the marks, the indexed views. The env calls it; it calls the supervisor's operations.

    Fields and who changes them (the env's calling thread only, never the watcher):
    ``restarts`` grows by one record per replacement (never shrinks); ``templates`` and
    ``plan`` are set by :meth:`adopt` at each start and dropped by :meth:`forget`;
    ``mark_keys`` is set once the specs are known; ``marked`` holds the slots whose ``"next"``
    holds a mark until the next call clears it; ``fresh_obs`` holds a replacement's reset
    observation until its mark is written; ``views`` holds weak references to indexed views.
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.budget = RestartBudget(options.max_restarts, options.restart_window)
        self.restarts: list[RestartRecord] = []
        #: Per slot, the worker process as TorchRL built it, unstarted (see recording_starts).
        self.templates: list[Any] = []
        #: How this start went (a replacement starts the same way) and its reaper's FIFO.
        self.plan: StartPlan | None = None
        self.fifo = ""
        #: Done entries only restarts write (set by the owner once its specs are known).
        self.mark_keys: list[str] = []
        self.marked: set[int] = set()
        #: Per slot, the observation its replacement's first reset gave, until the slot's marked
        #: transition is written: TorchRL's partial reset of other slots copies a slot's last
        #: "next" over its root, so the root cannot be trusted to still hold it.
        self.fresh_obs: dict[int, Any] = {}
        self.views: list[weakref.ref[Any]] = []

    @property
    def on(self) -> bool:
        return self.options.max_restarts > 0

    # ------------------------------------------------------------------ start and close
    def recording(self) -> contextlib.AbstractContextManager[list[Any]]:
        """Around TorchRL's start: the processes it starts, recorded unstarted (restarts on)."""
        return recording_starts() if self.on else contextlib.nullcontext([])

    def adopt(self, started: list[Any], workers: int, plan: StartPlan, fifo: str) -> None:
        """Keep the worker processes TorchRL built (``started``, in slot order) as templates."""
        self.templates = [p for p in started if is_worker_entry(process_target(p))]
        for template in self.templates:  # each replacement gets its own pipes and event
            kwargs = process_kwargs(template)
            set_process_kwargs(template, {k: v for k, v in kwargs.items() if k not in PER_START_KWARGS})
        self.plan, self.fifo = plan, fifo
        self.marked = set()
        if self.on and len(self.templates) != workers:
            raise RuntimeError(
                f"torchrl_ext could not record the {workers} worker processes TorchRL started "
                f"(found {len(self.templates)}); restarts cannot work with this TorchRL release. "
                "Pass max_restarts=0, and please report this."
            )

    def forget(self) -> None:
        """At close: the templates hold the shared buffers and the done flags."""
        self.templates = []
        self.plan = None

    def remember_view(self, view: Any) -> None:
        self.views.append(weakref.ref(view))

    # ------------------------------------------------------------------ between calls
    def pending(self, supervisor: WorkerSupervisor) -> bool:
        """Whether the next call must first clear marks or replace lost workers (no system call)."""
        return bool(self.marked) or supervisor.has_losses

    def between_calls(self, env: Upstream, supervisor: WorkerSupervisor) -> None:
        if self.marked:
            buffers = env.owner.slot_buffers
            for slot in self.marked:
                clear_marks(buffers[slot], self.mark_keys)
            self.marked = set()
        if supervisor.has_losses:
            self.handle_losses(env, supervisor, in_flight=())

    def after_reset(self, env: Upstream, out: Any) -> None:
        """Every reset clears the root entries restarts add (marks live in ``"next"``)."""
        if self.mark_keys:
            parent = env.owner.parent_buffer
            if parent is not None:
                clear_root_marks(parent, self.mark_keys)
            if out is not None:
                clear_root_marks(out, self.mark_keys)

    # ------------------------------------------------------------------ the wait
    def wait(self, env: Upstream, supervisor: WorkerSupervisor, positions: Any, done: DoneSignal) -> None:
        """Wait for the answers of ``positions`` of ``env``, replacing lost workers and killing
        hung ones (``step_timeout``)."""
        slots = env.slots(positions)
        answers = Answers(env.done_flags, env.events)
        pipe_timeout = env.pipe_timeout
        pipe_deadline = time.monotonic() + pipe_timeout
        step_timeout = self.options.step_timeout
        hang_at = None if step_timeout is None else time.monotonic() + step_timeout

        def check() -> None:
            supervisor.check()
            if supervisor.has_losses:
                raise _Lost

        def on_timeout() -> None:
            if hang_at is not None and time.monotonic() >= hang_at:
                raise _Hung

        while True:
            deadline = pipe_deadline if hang_at is None else min(pipe_deadline, hang_at)
            try:
                if answers.flags is not None:
                    left = max(0.0, deadline - time.monotonic())
                    done.wait_for(answers.flags, slots, left, self.options.spin, check, on_timeout)
                else:
                    answers.wait_events(slots, deadline, pipe_timeout, check, on_timeout)
                return
            except _Lost:
                self.handle_losses(env, supervisor, in_flight=slots)
            except _Hung:
                assert step_timeout is not None
                for slot in slots:
                    if not answers.answered(slot) and not supervisor.exit_noticed(slot):  # dead: lost already
                        supervisor.kill_hung(slot, step_timeout)
                        supervisor.wait_handled(slot, _LOSS_WAIT)
                self.handle_losses(env, supervisor, in_flight=slots)
            if step_timeout is not None:  # a replayed reset gets the whole timeout
                hang_at = time.monotonic() + step_timeout

    # ------------------------------------------------------------------ replacing
    def handle_losses(self, env: Upstream, supervisor: WorkerSupervisor, in_flight: Collection[int]) -> None:
        """Replace every lost worker (its tree is already gone), or raise once the budget is
        spent. ``in_flight``: slots whose answer the caller is waiting for."""
        # A call interrupted by the loss may have left answers in the other workers' pipes.
        supervisor.drain_owed(self.options.shutdown_timeout)
        while True:
            lost = supervisor.next_loss()
            if lost is None:
                return
            self._restart_slot(env, supervisor, lost, in_flight)

    def replaced_after(self, env: Upstream, supervisor: WorkerSupervisor, err: Exception) -> bool:
        """``set_seed`` raised ``err``: if a worker was lost (restarts on), replace it and return
        True (seeding is one worker after the other and deterministic: the caller seeds again)."""
        if not supervisor.restartable:
            return False
        supervisor.failure(wait=LOST_PIPE_WAIT if isinstance(err, EOFError | OSError) else 0.0, losses=True)
        if supervisor.failure() is not None or not supervisor.has_losses:
            return False
        self.handle_losses(env, supervisor, in_flight=())
        return True

    def give_up(self, supervisor: WorkerSupervisor, lost: Loss, reason: str) -> NoReturn:
        failure = lost.failure
        history = "; ".join(str(r) for r in self.restarts[-5:]) or "none"
        detail = f"{reason}; restarts so far ({len(self.restarts)}): {history}"
        if isinstance(failure, WorkerHungError):
            failure = WorkerHungError(
                lost.index, lost.pid, failure.last_command, failure.timeout, detail, failure.stacks
            )
        elif isinstance(failure, WorkerDiedError):
            failure = WorkerDiedError(
                lost.index, lost.pid, lost.exitcode, failure.last_command, detail, failure.oom
            )
        elif failure is None:
            failure = WorkerDiedError(lost.index, lost.pid, lost.exitcode, lost.channel.last_command, detail)
        elif self.on:
            failure.add_note(f"torchrl_ext: worker {lost.index} (pid {lost.pid}) not restarted: {detail}")
        raise_failure(supervisor.give_up(failure))

    def _restart_slot(
        self, env: Upstream, supervisor: WorkerSupervisor, lost: Loss, in_flight: Collection[int]
    ) -> None:
        """Replace ``lost`` (retrying while replacements are lost too), then replay its
        in-flight reset, or reset the new env and mark the in-flight step's transition, or
        (lost between calls) have the slot's next step answered by a mark."""
        slot = lost.index
        # What the slot owes the caller is what the first lost worker was asked.
        command = lost.channel.last_command
        message = getattr(lost.channel, "last_message", None)
        replay = slot in in_flight and command == "reset"
        for attempt in itertools.count(1):
            env_error = not isinstance(lost.failure, WorkerDiedError)
            # A call forwarded to the env (``env.method()``) already raised the env's error to its
            # caller; the worker only died because TorchRL's loop ends on it: a loss like any other.
            if env_error and not self.options.restart_on_error and not is_forwarded_call(command):
                self.give_up(supervisor, lost, "its env raised (restart_on_error=False)")
            if not self.budget.allows(time.monotonic()):
                self.give_up(supervisor, lost, f"more losses than {self.budget.describe()}")
            if attempt > self.options.max_restarts:  # however long the window: no endless retries
                self.give_up(
                    supervisor, lost, f"{self.options.max_restarts} replacement(s) in a row were lost"
                )
            cause: int | str | None = (
                "hung" if lost.hung else type(lost.failure).__name__ if env_error else lost.exitcode
            )
            supervisor.forget_report(slot)
            try:
                process, channel = self._start_replacement(env, supervisor, slot)
                waited = time.monotonic() - lost.lost_at
                record = RestartRecord(
                    slot,
                    lost.pid,
                    process.pid,
                    cause,
                    lost.channel.last_command,
                    time.time() - waited,
                    waited,
                    stacks=getattr(lost.failure, "stacks", None),
                    oom=getattr(lost.failure, "oom", None),
                )
                self.restarts.append(record)
                log.warning(
                    "%s restarted worker %s (%d descendant process(es) of the old one killed)",
                    supervisor.label,
                    record,
                    lost.descendants_killed,
                )
                if replay:
                    channel.send(message)  # the same reset again, on the new env; answered as usual
                    return
                self._reset_slot(env, supervisor, slot, channel)
            except _ReplacementLost:
                lost = supervisor.loss(slot)
                continue
            if slot in in_flight and command in ("step", "step_and_maybe_reset"):
                self._mark(env, slot)
            else:  # lost between calls: the slot's next step is answered by a mark
                channel.intercept = functools.partial(self._intercept, env, slot, channel)
            return

    def _start_replacement(self, env: Upstream, supervisor: WorkerSupervisor, slot: int) -> tuple[Any, Any]:
        template = self.templates[slot]
        assert self.plan is not None  # set by adopt(), as the templates are
        ctx = self.plan.worker_context
        kwargs = dict(process_kwargs(template))
        parent_pipe, child_pipe = ctx.Pipe()
        event = ctx.Event()
        kwargs.update(zip(PER_START_KWARGS, (parent_pipe, child_pipe, event), strict=True))
        key = WORKER_KWARGS["env_kwargs"]
        env_kwargs = kwargs.get(key)
        if isinstance(env_kwargs, ConfiguredKwargs):
            arm = _platform.parent_death_outlives_worker(process_start_method(template))
            kwargs[key] = ConfiguredKwargs(
                dict(env_kwargs), dataclasses.replace(env_kwargs.trx_config, arm_pdeathsig=arm)
            )
        self.plan.refresh(self.fifo)
        process = copy_unstarted(template, kwargs)
        owner = env.owner
        Answers(owner.done_flags, None).clear(slot)  # the lost worker may have answered before it died
        with tagged_spawns(supervisor.tag):
            process.start()
        child_pipe.close()
        channel = supervisor.replace(slot, process, parent_pipe)
        # The owner's lists, and those of every indexed view (TorchRL >= 0.14 gives a view
        # lists of its own, indexed by its position in the view).
        for holder, position in self._holders_of(owner, slot):
            holder.workers[position] = process
            holder.channels[position] = channel
            events = holder.events
            if events is not None:
                events[position] = event
        # TorchRL's handshake: the worker says it built its env, then is sent "init". Building
        # the env is not a command: step_timeout does not apply (a spawned worker imports torch).
        self._await(supervisor, slot, lambda: bool(channel.poll(0)), env.pipe_timeout, channel)
        try:
            channel.recv()  # "started"; at EOF, the replacement died while building its env
        except Exception:
            supervisor.wait_handled(slot, _LOSS_WAIT)
            raise _ReplacementLost from None
        channel.send(("init", None))
        return process, channel

    def _holders_of(self, owner: Upstream, slot: int) -> list[tuple[Upstream, int]]:
        """The owner and each live view that holds worker ``slot``, with its position there."""
        found = [(owner, slot)]
        views = [ref() for ref in self.views]
        self.views = [weakref.ref(view) for view in views if view is not None]
        for view in views:
            if view is None:
                continue
            held = Upstream(view)
            if held.worker_indices is None:
                continue
            position = held.position_of(slot)
            if position is not None:
                found.append((held, position))
        return found

    def _reset_slot(self, env: Upstream, supervisor: WorkerSupervisor, slot: int, channel: Any) -> None:
        channel.send(("reset", (False, {})))
        timeout = self.options.step_timeout
        owner = env.owner
        answers = Answers(owner.done_flags, owner.events)
        self._await(
            supervisor, slot, lambda: answers.take(slot), env.pipe_timeout if timeout is None else timeout
        )
        self.fresh_obs[slot] = owner.slot_buffers[slot].select(*owner.obs_keys).clone()

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
        _ReplacementLost (its loss is then the supervisor's next)."""
        hang_at = time.monotonic() + limit
        waitables: list[Any] = [supervisor.sentinel(slot)] + ([channel] if channel is not None else [])
        pause = 1e-4
        while not ready():
            if supervisor.is_gone(slot):
                supervisor.poll()
                supervisor.wait_handled(slot, _LOSS_WAIT)
                raise _ReplacementLost
            if time.monotonic() >= hang_at:
                supervisor.kill_hung(slot, limit)
                supervisor.wait_handled(slot, _LOSS_WAIT)
                raise _ReplacementLost
            multiprocessing.connection.wait(waitables, timeout=pause)
            pause = min(2 * pause, _POLL_SLICE)

    def _mark(self, env: Upstream, slot: int) -> None:
        owner = env.owner
        fresh = self.fresh_obs.pop(slot, None)
        slot_td = owner.slot_buffers[slot]
        mark_transition(slot_td, owner.obs_keys, owner.env.reward_keys, owner.env.done_keys, fresh)
        self.marked.add(slot)
        Answers(owner.done_flags, owner.events).set(slot)

    def _intercept(self, env: Upstream, slot: int, channel: Any, message: tuple[Any, ...]) -> bool:
        """A replacement's first step is not sent: its transition is the marked one."""
        command = message[0]
        if command in ("step", "step_and_maybe_reset"):
            channel.intercept = None
            self._mark(env, slot)
            return True
        if command == "reset":
            channel.intercept = None
        return False


def raise_failure(failure: BaseException) -> NoReturn:
    """Raise a worker's failure as the caller's error: a death without the internal context, an
    env's exception with the remote traceback as its cause."""
    if isinstance(failure, WorkerDiedError) or failure.__cause__ is None:
        raise failure from None
    failure.__suppress_context__ = True
    raise failure
