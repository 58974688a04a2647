"""Keeping every slot served: the env's own wait, restarts of lost workers, their marks.

Every env has one :class:`SlotKeeper`; it acts when restarts, ``step_timeout`` or recycling
are on. What ``ManagedParallelEnv`` does when a worker is lost with ``max_restarts > 0`` (see
docs/restarts.md and the data flow in docs/design.md): the supervisor has already killed and
reaped the worker's tree and recorded the loss; :class:`SlotKeeper`, on the env's calling
thread, checks the policy (``_policy``: budget, backoff, which env errors restart), starts a
copy of each lost slot's original ``multiprocessing.Process`` on fresh pipes (``_starting``:
all lost slots at once, their handshakes awaited together, each seeded from the env's seed),
puts it in the owner's and every view's lists, and then either replays an in-flight reset, or
resets the new env and writes the marked transition (``_marks``), or, lost between calls, takes
the slot's next step command and answers it with the mark. The keeper also owns the env's own
wait (restarts, ``step_timeout``, recycling), which is where losses and hangs are noticed
mid-call, and hands episode boundaries to the recycler (``_recycle``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Collection
from typing import Any, NoReturn

from . import _identity
from ._channel import is_forwarded_call
from ._compat import PER_START_KWARGS, Upstream, describe_factory
from ._cpython import process_kwargs, process_target, set_process_kwargs
from ._done_signal import Answers, DoneSignal, timeout_error
from ._errors import WorkerDiedError, WorkerHungError, WorkerStartTimeoutError
from ._intercept import is_worker_entry
from ._marks import clear_marks, clear_root_marks, mark_transition
from ._options import Options
from ._plan import StartPlan
from ._policy import Backoff, RestartBudget, RestartRecord, restarts_on_error
from ._record import Loss
from ._recycle import Recycler
from ._slots import Slots
from ._starting import (
    LOSS_WAIT,
    StartingWorker,
    WorkerStarter,
    handshake,
    recording_starts,
    reset_all,
    seed_all,
)
from ._supervisor import LOST_PIPE_WAIT, WorkerSupervisor

__all__ = ["RestartRecord", "SlotKeeper", "raise_failure"]

log = logging.getLogger("torchrl_ext")

#: The replacements of one round: per slot, its starting worker, the loss it replaces, its backoff.
Replacements = dict[int, tuple[StartingWorker, Loss, float]]


# --------------------------------------------------------------------------- the keeper
class SlotKeeper:
    """Everything one env does to keep each slot served by a live worker: its own wait (where
    losses and hangs are noticed), the restart policy, the replacements, the marks, the send
    hooks, recycling's boundaries. The env calls it; it calls the supervisor's operations.
    Its fields are written on the env's calling thread only, never by the watcher.
    """

    def __init__(self, options: Options) -> None:
        #: The env's options; replaced whole by :meth:`use_options`.
        self.options = options
        #: The losses restarted within ``restart_window``; :meth:`_allow` records each.
        self.budget = RestartBudget(options.max_restarts, options.restart_window)
        #: Each slot's row of quick losses and the wait it gives the next replacement (:meth:`_start_round`).
        self.backoff = Backoff(options.restart_backoff)
        #: One record per replacement or recycling; only grows.
        self.restarts: list[RestartRecord] = []
        #: The templates and the plan: set by :meth:`adopt` at each start, dropped by :meth:`forget`.
        self.starter = WorkerStarter()
        #: What the keeper and the recycler remember per slot (``_slots.Slot``).
        self.slots = Slots()
        #: Recycling's policy over the slots; ``None`` when recycling is off (set once, here).
        self.recycler = Recycler(options, self.starter, self.slots) if options.recycling else None
        #: Done entries only restarts write (set by the owner once its specs are known).
        self.mark_keys: list[str] = []

    @property
    def restarts_on(self) -> bool:
        """Restarts (and their marks) are on."""
        return self.options.max_restarts > 0

    def use_options(self, options: Options) -> None:
        """The env's options changed (an assigned ``shutdown_timeout``): every holder reads them."""
        self.options = options
        if self.recycler is not None:
            self.recycler.options = options

    # ------------------------------------------------------------------ start and close
    def recording(self) -> contextlib.AbstractContextManager[list[Any]]:
        """Around TorchRL's start: the processes it starts, recorded unstarted (restarts or
        recycling on)."""
        return recording_starts() if self.options.replaceable_workers else contextlib.nullcontext([])

    def adopt(self, started: list[Any], workers: int, plan: StartPlan, fifo: str) -> None:
        """Keep the worker processes TorchRL built (``started``, in slot order) as templates."""
        templates = [p for p in started if is_worker_entry(process_target(p))]
        for template in templates:  # each replacement gets its own pipes and event
            kwargs = process_kwargs(template)
            set_process_kwargs(template, {k: v for k, v in kwargs.items() if k not in PER_START_KWARGS})
        starter = self.starter
        starter.templates, starter.plan, starter.fifo = templates, plan, fifo
        self.slots.new_start()
        if self.options.replaceable_workers and len(templates) != workers:
            raise RuntimeError(
                f"torchrl_ext could not record the {workers} worker processes TorchRL started "
                f"(found {len(templates)}); restarts cannot work with this TorchRL release. "
                "Pass max_restarts=0 (and no recycle_memory/recycle_every), and please report this."
            )

    def forget(self) -> None:
        """At close: the templates hold the shared buffers and the done flags; recycling
        starts over with the next start (its standbys were ended with the workers)."""
        self.starter.forget()
        if self.recycler is not None:
            self.recycler.forget()

    def attached(self, env: Any, supervisor: WorkerSupervisor) -> None:
        """Once the supervisor has the workers: with recycling on, hook their channels."""
        if self.recycler is not None:
            for slot, channel in enumerate(Upstream(env).channels):
                self._hook(env, supervisor, slot, channel)

    def _hook(self, env: Any, supervisor: WorkerSupervisor, slot: int, channel: Any) -> None:
        """Slot ``slot``'s commands on ``channel`` go through :meth:`_on_send` first."""
        channel.hook = functools.partial(self._on_send, weakref.ref(env), supervisor, slot)

    def _on_send(
        self, env_ref: weakref.ref[Any], supervisor: WorkerSupervisor, index: int, message: Any
    ) -> tuple[Any, Any] | None:
        """The send hook of slot ``index`` (see ``RestartableChannel.hook``): a replacement's first
        step is not sent, its transition is the marked one; with recycling on, the recycler
        routes the command (a boundary may swap the slot's worker)."""
        owner = env_ref()
        if owner is None:
            return None
        env = Upstream(owner)
        slot = self.slots[index]
        if slot.owes_mark:
            command = message[0]
            if command in ("step", "step_and_maybe_reset"):
                slot.owes_mark = False
                self._unhook(env, index)
                self._mark(env, index)
                return None, None
            if command == "reset":
                slot.owes_mark = False
                self._unhook(env, index)
        if self.recycler is not None:
            return self.recycler.route(env, supervisor, index, message)
        return None

    def _unhook(self, env: Upstream, index: int) -> None:
        """Slot ``index``'s policies have nothing more to do with its commands (recycling off)."""
        if self.recycler is None:
            env.owner.channels[index].hook = None

    def remember_view(self, view: Any) -> None:
        self.starter.views.append(weakref.ref(view))

    def remember_seeds(self, env: Upstream) -> None:
        """After ``set_seed``: the seed each slot was sent (its channel's last message)."""
        for slot, channel in enumerate(env.owner.channels or []):
            message = getattr(channel, "last_message", None)
            if isinstance(message, tuple) and message and message[0] == "seed":
                seed, static = message[1]
                self.slots[slot].seed = (int(seed), bool(static))

    # ------------------------------------------------------------------ between calls
    def pending(self, supervisor: WorkerSupervisor) -> bool:
        """Whether the next call must first clear marks or replace lost workers (no system call)."""
        if self.slots.marked or supervisor.has_losses:
            return True
        return self.recycler is not None and self.recycler.pending(supervisor)

    def between_calls(self, env: Upstream, supervisor: WorkerSupervisor) -> None:
        marked = self.slots.marked
        if marked:
            buffers = env.owner.slot_buffers
            for slot in marked:
                clear_marks(buffers[slot], self.mark_keys)
            marked.clear()
        if supervisor.has_losses:
            self.handle_losses(env, supervisor, in_flight=())
        if self.recycler is not None:
            self.recycler.prepare(env, supervisor)

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

        def lost() -> bool:  # raises a failure that is not restarted
            supervisor.check()
            return supervisor.has_losses

        waiting = slots  # the slots whose answer is still to be read (consumed when all are in)
        while True:
            deadline = pipe_deadline if hang_at is None else min(pipe_deadline, hang_at)
            if answers.flags is not None:
                timeout = max(0.0, deadline - time.monotonic())
                outcome = done.wait_for(
                    answers.flags, waiting, timeout, self.options.spin, lost, late="return"
                )
            else:
                timeout = pipe_timeout
                outcome = answers.wait_events(waiting, deadline, timeout, lost, late="return")
            if outcome == "answered":
                waiting = []
                # A worker that answered and then died before this wait ended is lost in this
                # call, whether or not the supervisor thread has run since: look once (one select).
                supervisor.poll()
                if not lost():
                    if self.recycler is not None:
                        self._after_wait(env, supervisor, self.recycler, slots)
                    return
                # Every answer was read: only the replacements' are awaited.
                waiting = [loss.index for loss in supervisor.losses() if loss.index in slots]
            elif outcome == "late":
                if hang_at is None or time.monotonic() < hang_at:
                    raise timeout_error(timeout)  # TorchRL's own wait's error
                assert step_timeout is not None
                for slot in waiting:
                    if not answers.answered(slot) and not supervisor.exit_noticed(slot):  # dead: lost already
                        supervisor.kill_hung(slot, step_timeout)
                        supervisor.wait_handled(slot, LOSS_WAIT)
            self.handle_losses(env, supervisor, in_flight=slots)
            if step_timeout is not None:  # a replayed reset gets the whole timeout
                hang_at = time.monotonic() + step_timeout

    def _after_wait(
        self, env: Upstream, supervisor: WorkerSupervisor, recycler: Recycler, slots: list[int]
    ) -> None:
        """The recycler's part once the answers are in; the swaps it finished are restarts."""
        try:
            recycler.after_wait(env, supervisor, slots)
        finally:
            for record in recycler.take_finished():
                self.restarts.append(record)
                self.notify(record)

    # ------------------------------------------------------------------ replacing
    def handle_losses(self, env: Upstream, supervisor: WorkerSupervisor, in_flight: Collection[int]) -> None:
        """Replace every lost worker (its tree is already gone), all at once, or raise once the
        policy says no. ``in_flight``: slots whose answer the caller is waiting for."""
        # A call interrupted by the loss may have left answers in the other workers' pipes.
        supervisor.drain_owed(self.options.shutdown_timeout)
        # What each slot owes the caller is what its first lost worker was asked.
        owed: dict[int, tuple[str | None, Any]] = {}
        attempts: collections.Counter[int] = collections.Counter()
        done: list[RestartRecord] = []
        while True:
            losses = supervisor.losses()
            if not losses:
                break
            for lost in losses:
                channel = lost.channel
                owed.setdefault(lost.index, (channel.last_command, getattr(channel, "last_message", None)))
                attempts[lost.index] += 1
                self._allow(supervisor, lost, owed[lost.index][0], attempts[lost.index])
            done += self._replace(env, supervisor, losses, owed, in_flight)
        for record in done:
            self.notify(record)

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

    def _allow(self, supervisor: WorkerSupervisor, lost: Loss, command: str | None, attempt: int) -> None:
        """Raise (give up) unless the policy lets slot ``lost.index`` be replaced once more."""
        env_error = not isinstance(lost.failure, WorkerDiedError)
        # A call forwarded to the env (``env.method()``) already raised the env's error to its
        # caller; the worker only died because TorchRL's loop ends on it: a loss like any other.
        # The call is the one the worker says it raised in: the next call may have been sent to
        # it (its channel's last command) before its loss was seen.
        raised_in = lost.raised_in if lost.raised_in is not None else command
        setting = self.options.restart_on_error
        if env_error and not restarts_on_error(setting, lost.failure) and not is_forwarded_call(raised_in):
            self.give_up(supervisor, lost, f"its env raised (restart_on_error={setting!r})")
        if not self.budget.allows(time.monotonic()):
            self.give_up(supervisor, lost, f"more losses than {self.budget.describe()}")
        if attempt > self.options.max_restarts:  # however long the window: no endless retries
            self.give_up(supervisor, lost, f"{self.options.max_restarts} replacement(s) in a row were lost")

    def give_up(self, supervisor: WorkerSupervisor, lost: Loss, reason: str) -> NoReturn:
        failure = lost.failure
        history = "; ".join(str(r) for r in self.restarts[-5:]) or "none"
        detail = f"{reason}; restarts so far ({len(self.restarts)}): {history}"
        timed_out = self._start_timed_out(lost)
        if isinstance(failure, WorkerHungError) and timed_out is not None:
            failure = WorkerStartTimeoutError(
                lost.index, lost.pid, failure.timeout, timed_out, detail, failure.stacks
            )
        elif isinstance(failure, WorkerHungError):
            failure = WorkerHungError(
                lost.index, lost.pid, failure.last_command, failure.timeout, detail, failure.stacks
            )
        elif isinstance(failure, WorkerDiedError):
            failure = WorkerDiedError(
                lost.index, lost.pid, lost.exitcode, failure.last_command, detail, failure.oom
            )
        elif failure is None:
            failure = WorkerDiedError(lost.index, lost.pid, lost.exitcode, lost.channel.last_command, detail)
        elif self.restarts_on:
            failure.add_note(f"torchrl_ext: worker {lost.index} (pid {lost.pid}) not restarted: {detail}")
        raise_failure(supervisor.give_up(failure))

    def _start_timed_out(self, lost: Loss) -> str | None:
        """The env factory the lost worker was killed building (``start_timeout``); None if not."""
        timed_out = self.slots[lost.index].start_timed_out
        return timed_out[1] if timed_out is not None and timed_out[0] == lost.pid else None

    def _cause(self, lost: Loss) -> int | str | None:
        if self._start_timed_out(lost) is not None:
            return "start_timeout"
        if lost.hung or isinstance(lost.failure, WorkerHungError):  # itself, or its host (_hosts)
            return "hung"
        return lost.exitcode if isinstance(lost.failure, WorkerDiedError) else type(lost.failure).__name__

    def _replace(
        self,
        env: Upstream,
        supervisor: WorkerSupervisor,
        losses: list[Loss],
        owed: dict[int, tuple[str | None, Any]],
        in_flight: Collection[int],
    ) -> list[RestartRecord]:
        """One round: start a replacement for every loss (each after its backoff), await all
        their handshakes, seed them, then replay, reset and mark each; a replacement lost in
        the round is a loss of the next. Returns the records of this round."""
        workers = self._start_round(env, supervisor, losses)
        for slot in handshake(
            supervisor,
            [worker for worker, _l, _d in workers.values()],
            self.options.start_limit(env.pipe_timeout),
        ):
            self.slots[slot].start_timed_out = (
                workers[slot][0].process.pid,
                describe_factory(env.factory_of(slot)),
            )
        ready = {slot: item for slot, item in workers.items() if item[0].ready}
        seeds = self._seed_round(supervisor, env, ready)
        records = self._record_round(supervisor, ready, seeds)
        self._reset_round(env, supervisor, ready, owed, in_flight)
        return records

    def _start_round(self, env: Upstream, supervisor: WorkerSupervisor, losses: list[Loss]) -> Replacements:
        """Start each loss's replacement once its backoff (``restart_backoff``) has passed, the
        earliest due first, and install it: ``slot -> (worker, loss, backoff)``."""
        now_started, now = _identity.clock(), time.monotonic()
        plans = []
        for lost in losses:
            lived = (now_started - (now - lost.lost_at)) - lost.create_time
            delay = self.backoff.delay(lost.index, lived)
            plans.append((lost.lost_at + delay, delay, lost))
        workers: Replacements = {}
        for due, delay, lost in sorted(plans, key=lambda plan: plan[0]):
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # restart_backoff: a slot that keeps failing waits
            if self.recycler is not None:
                self.recycler.forget_slot(supervisor, lost.index)
            supervisor.forget_report(lost.index)
            Answers(env.owner.done_flags, None).clear(lost.index)  # its last answer may be there
            worker = self.starter.start(lost.index, supervisor.tag)
            self.slots[lost.index].new_worker()
            self.starter.install(env, worker, supervisor.replace(lost.index, worker.process, worker.channel))
            if self.recycler is not None:
                self._hook(env.owner.env, supervisor, lost.index, worker.channel)
            workers[lost.index] = (worker, lost, delay)
        return workers

    def _seed_round(
        self,
        supervisor: WorkerSupervisor,
        env: Upstream,
        ready: Replacements,
    ) -> dict[int, tuple[StartingWorker, int, bool]]:
        """Count each ready replacement's incarnation and seed those whose slot was seeded
        (``replacement_seed``), all at once. Returns what each was sent."""
        seeds: dict[int, tuple[StartingWorker, int, bool]] = {}
        for slot, (worker, _lost, _delay) in ready.items():
            seed = self.slots[slot].next_seed()
            if seed is not None:
                seeds[slot] = (worker, *seed)
        seed_all(supervisor, seeds, self.options.answer_limit(env.pipe_timeout))
        return seeds

    def _record_round(
        self,
        supervisor: WorkerSupervisor,
        ready: Replacements,
        seeds: dict[int, tuple[StartingWorker, int, bool]],
    ) -> list[RestartRecord]:
        """A record in ``env.restarts`` (and a warning) for each replacement still ready, in the
        order the losses were seen (a backoff may have started a later one first)."""
        records = []
        for slot, (worker, lost, delay) in sorted(ready.items(), key=lambda item: item[1][1].lost_at):
            if not worker.ready:
                continue
            waited = time.monotonic() - lost.lost_at
            record = RestartRecord(
                slot,
                lost.pid,
                worker.process.pid,
                self._cause(lost),
                lost.command,
                time.time() - waited,
                waited,
                stacks=getattr(lost.failure, "stacks", None),
                oom=getattr(lost.failure, "oom", None),
                backoff=delay,
                seed=seeds[slot][1] if slot in seeds else None,
            )
            self.restarts.append(record)
            records.append(record)
            log.warning(
                "%s restarted worker %s (%d descendant process(es) of the old one killed)",
                supervisor.label,
                record,
                lost.descendants_killed,
            )
        return records

    def _reset_round(
        self,
        env: Upstream,
        supervisor: WorkerSupervisor,
        ready: Replacements,
        owed: dict[int, tuple[str | None, Any]],
        in_flight: Collection[int],
    ) -> None:
        """Replay an in-flight reset on its replacement; reset the others, all at once, and
        mark the slot's transition now (a step in flight) or at its next step (lost between
        calls: the send hook)."""
        to_reset = []
        for slot, (worker, _lost, _delay) in ready.items():
            command, message = owed[slot]
            if not worker.ready:
                continue
            if slot in in_flight and command == "reset":
                worker.channel.send(message)  # the same reset again, on the new env; answered as usual
            else:
                to_reset.append(worker)
        reset_all(supervisor, env, to_reset, self.options.answer_limit(env.pipe_timeout))
        owner = env.owner
        for worker in to_reset:
            if not worker.ready:
                continue
            slot = worker.slot
            # TorchRL's partial reset of other slots copies a slot's last "next" over its
            # root: the root cannot be trusted to still hold this observation at the mark.
            self.slots[slot].fresh_obs = owner.slot_buffers[slot].select(*owner.obs_keys).clone()
            if slot in in_flight and owed[slot][0] in ("step", "step_and_maybe_reset"):
                self._mark(env, slot)
            else:  # lost between calls: the slot's next step is answered by a mark
                self.slots[slot].owes_mark = True
                if worker.channel.hook is None:
                    self._hook(owner.env, supervisor, slot, worker.channel)

    def notify(self, record: RestartRecord) -> None:
        """``on_restart``, in the main process: an exception there is logged, never raised (the
        env has already replaced the worker; the call goes on)."""
        callback = self.options.on_restart
        if callback is None:
            return
        try:
            callback(record)
        except Exception:
            log.exception("on_restart raised for %s; the env goes on", record)

    def _mark(self, env: Upstream, slot: int) -> None:
        owner = env.owner
        record = self.slots[slot]
        fresh, record.fresh_obs = record.fresh_obs, None
        slot_td = owner.slot_buffers[slot]
        mark_transition(slot_td, owner.obs_keys, owner.env.reward_keys, owner.env.done_keys, fresh)
        self.slots.marked.add(slot)
        Answers(owner.done_flags, owner.events).set(slot)


def raise_failure(failure: BaseException) -> NoReturn:
    """Raise a worker's failure as the caller's error: a death without the internal context, an
    env's exception with the remote traceback as its cause."""
    if isinstance(failure, WorkerDiedError) or failure.__cause__ is None:
        raise failure from None
    failure.__suppress_context__ = True
    raise failure
