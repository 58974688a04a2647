"""Recycling workers at episode boundaries: ``recycle_memory`` and ``recycle_every``.

A slot becomes *due* when its worker's tree (it and every descendant) holds more than
``recycle_memory`` bytes of its own, or is about to (its figure at an episode boundary plus
what its last episode added), or when the worker has run ``recycle_every`` episodes. "Of its
own" is the tree's USS: per process, the resident pages no other process maps, summed (see
NOTE [unique memory]). Between two calls
the recycler starts the due slot's next worker ahead of time (a *standby*, supervised from
birth, touching no shared buffer), has it build its env, seeds it and has it reset its env
(NOTE [prepared reset], in ``_worker``: the result is kept in the standby). At the slot's next
episode boundary the standby takes the slot and the old worker is sent "close":

    the slot's next reset              the recycler (env's calling thread)
    ─────────────────────              ───────────────────────────────────
    "reset" sent to the slot      ──►  promote the standby, send the reset to it (a plain
                                       one publishes the prepared result)
    "step_and_maybe_reset"        ──►  sent as "step" (no reset in the old worker); if the
                                       step ended the episode, promote the standby, reset it
                                       (its observation is the root's), else nothing

The old worker closes its env and exits by itself (the supervisor kills it with its tree past
``shutdown_timeout``); nothing is marked: the episode had ended. ``env.restarts`` gets a record
whose cause is ``"memory"`` or ``"episodes"``. A standby that dies or does not build its env
within ``start_timeout`` is killed and started again later; the old worker goes on meanwhile.

NOTE [unique memory]: RSS counts every page a process maps, so a tree's RSS counts torch's
libraries and the copy-on-write pages a forked DataLoader worker shares with its parent once
per process (a healthy worker with DataLoader(num_workers=4) in its reset: 288 MiB between
resets, 1.1 GiB during one). USS counts no page another process maps (17 MiB and at most 28
MiB for that worker), read from ``/proc/PID/smaps_rollup``, which costs about 10 ms per process
with torch loaded against 0.1 ms for RSS. So a boundary reads the tree's RSS first: USS is no
more than RSS, so a tree whose RSS (plus the projection) is under ``recycle_memory`` is not due,
and nothing more is read. Else it estimates the USS as the last USS read plus what the RSS grew
since, and reads the USS again only when that estimate (plus the projection) is over
``recycle_memory``, or when the last read is older than ``max(SAMPLE_INTERVAL, its cost x
workers / WATCH_SHARE)`` (the refreshing reads take at most 5 % of the time): a slot is made
due on a read, never on an estimate. Pages a worker shares with its own forked children (a leak
older than its DataLoader workers) count for none of them while those live. Where
``smaps_rollup`` cannot be read (macOS), RSS is the measure, with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Literal

from . import _platform
from ._channel import RestartableChannel
from ._compat import Upstream
from ._errors import format_exitcode
from ._options import Options
from ._policy import RestartRecord
from ._slots import Reading, Slot, Slots, Swap
from ._starting import StartingWorker, WorkerStarter, await_answers, finish_handshake, read_answer, send_seed
from ._stats import SAMPLE_INTERVAL, WATCH_SHARE
from ._supervisor import WorkerSupervisor
from ._wait import Late, on, wait_for
from ._worker import PREPARE_RESET

__all__ = ["Recycler"]

log = logging.getLogger("torchrl_ext")

#: The phase of a standby's NOTE [prepared reset], as a dropped standby's warning names it.
_PREPARE = "reset its env ahead"


class Recycler:
    """What one env does to recycle its workers (see the module docstring); its per-slot state
    is the slots' (``_slots.Slot``: ``episodes``, ``due``, ``standby``, ``prepared``, ...).
    Its fields are written on the env's calling thread only.
    """

    def __init__(self, options: Options, starter: WorkerStarter, slots: Slots) -> None:
        #: ``recycle_memory`` and ``recycle_every``, as given (``None``: that cause is off). Set here only.
        self.memory = options.recycle_memory
        self.every = options.recycle_every
        #: The env's options; replaced whole by the keeper's ``use_options``.
        self.options = options
        #: The keeper's starter and slots, shared (the keeper owns them).
        self.starter = starter
        self.slots = slots
        #: Records of swaps whose new worker answered its first reset, until
        #: :meth:`take_finished` hands them to the keeper.
        self.finished: list[RestartRecord] = []
        #: The supervisor's last memory sample looked at (:meth:`pending`).
        self._seen_samples: object = None
        #: Whether this env warned, once, that RSS is its measure.
        self._warned_rss = False

    def forget(self) -> None:
        """At close: every slot's recycling starts over (the supervisor's shutdown ended the
        standbys and the retiring workers); a reopened env starts recycling over."""
        for slot in self.slots:
            slot.end_recycling()
        self._seen_samples = None

    def take_finished(self) -> list[RestartRecord]:
        """The records of the swaps finished since the last call (for ``env.restarts``)."""
        finished, self.finished = self.finished, []
        return finished

    # ------------------------------------------------------------------ between calls
    def pending(self, supervisor: WorkerSupervisor) -> bool:
        """Whether a standby must be started or is starting (no system call)."""
        if self.memory is not None and supervisor.stats is not None:
            sampler = supervisor.stats.sampler
            sampler.unique_over = self.memory  # the trees whose USS the sampler reads
            samples = sampler.samples
            if samples is not self._seen_samples:  # a new sample (once a second)
                self._seen_samples = samples
                unique = self._unique(supervisor)
                pids = supervisor.pids()
                for index, sample in samples.items():
                    held = sample.uss if unique else sample.rss
                    current = index < len(pids) and sample.pid == pids[index]
                    slot = self.slots[index]
                    if current and held is not None and held > self.memory and slot.due is None:
                        slot.due = "memory"
        return any(slot.prepared != "answered" for slot in self.slots.due())

    def _unique(self, supervisor: WorkerSupervisor) -> bool:
        """Whether USS is the measure here (``smaps_rollup`` readable); else RSS, said once."""
        if _platform.has_smaps_rollup():
            return True
        if not self._warned_rss:
            self._warned_rss = True
            log.warning(
                "%s: recycle_memory counts each worker tree's resident memory (RSS) here, as "
                "/proc/PID/smaps_rollup cannot be read: pages the tree's processes share (torch's "
                "libraries, what a DataLoader worker shares with its parent) count once per "
                "process; set recycle_memory above a healthy tree's worker_<i>/rss_bytes of "
                "stats() during a reset",
                supervisor.label,
            )
        return False

    def prepare(self, env: Upstream, supervisor: WorkerSupervisor) -> None:
        """Start the due slots' standbys; finish the handshake of those that built their env
        and have them reset it ahead (NOTE [prepared reset]); read the answers that came."""
        for slot in self.slots.due():
            if slot.standby is None:
                self._start_standby(supervisor, slot)
        for slot in self.slots:
            standby = slot.standby
            if standby is not None and (standby.ready or self._try_ready(env, supervisor, slot, wait=False)):
                self._prepared_reset(supervisor, slot)

    def _start_standby(self, supervisor: WorkerSupervisor, slot: Slot) -> None:
        supervisor.forget_report(slot.index)
        standby = self.starter.start(slot.index, supervisor.tag)
        standby.channel = supervisor.add_standby(slot.index, standby.process, standby.channel)
        slot.standby = standby
        slot.standby_seed = slot.next_seed()

    def _try_ready(self, env: Upstream, supervisor: WorkerSupervisor, slot: Slot, wait: bool) -> bool:
        """Finish the standby's handshake (and seeding) as a replacement's (``_starting``); with
        ``wait``, up to ``start_timeout``. A standby that died or is late is discarded (started
        again at the next call)."""
        standby = slot.standby
        assert standby is not None
        limit = self.options.start_timeout
        deadline = standby.started_at + (limit if limit is not None else math.inf)
        limit_name = "no start_timeout" if limit is None else f"start_timeout={limit:g}s"
        answer_limit = self.options.answer_limit(env.pipe_timeout)
        got: Literal["answered", "gone"] | Late | None
        if wait:
            got = _wait_answered_or_gone(supervisor, slot.index, standby, deadline, limit_name)
        else:
            got = _answered_or_gone(supervisor, slot.index, standby)
        if not got and not wait and time.monotonic() < deadline:
            return False  # not built yet: looked at again at the next call
        phase, late = "build its env", None
        if isinstance(got, Late) or not got:
            late = limit_name
        elif got == "answered" and finish_handshake(standby, answer_limit):
            seed = slot.standby_seed
            if seed is None:
                return True
            send_seed(standby, *seed)
            phase = "answer its seed"
            if not standby.channel.poll(answer_limit):
                late = self.options.describe_answer_limit(env.pipe_timeout)
            elif read_answer(standby.channel):
                return True
            standby.ready = False
        self._drop(supervisor, slot, phase, late)
        return False

    def _prepared_reset(self, supervisor: WorkerSupervisor, slot: Slot) -> bool:
        """NOTE [prepared reset]: ask the ready standby to reset its env ahead (once), and read
        its answer if it came (no wait). True once read; False while it is not there yet, or
        if the standby died (dropped then)."""
        standby = slot.standby
        assert standby is not None
        if slot.prepared is None:
            standby.channel.send((PREPARE_RESET, None))
            slot.prepared = "sent"
        if slot.prepared == "answered":
            return True
        return standby.channel.poll(0) and self._read_prepared(supervisor, slot)

    def _await_prepared(self, supervisor: WorkerSupervisor, slot: Slot, env: Upstream) -> bool:
        """:meth:`_prepared_reset`, waiting for the answer up to the answer limit. False if the
        standby died or passed that limit (dropped then)."""
        if self._prepared_reset(supervisor, slot):
            return True
        standby = slot.standby
        if standby is None:  # it died: dropped
            return False
        deadline = time.monotonic() + self.options.answer_limit(env.pipe_timeout)
        limit_name = self.options.describe_answer_limit(env.pipe_timeout)
        got = _wait_answered_or_gone(supervisor, slot.index, standby, deadline, limit_name)
        if got != "answered":
            self._drop(supervisor, slot, _PREPARE, got.reason if isinstance(got, Late) else None)
            return False
        return self._read_prepared(supervisor, slot)

    def _read_prepared(self, supervisor: WorkerSupervisor, slot: Slot) -> bool:
        """Read the standby's answer to :data:`PREPARE_RESET` (it is in its pipe, or EOF)."""
        standby = slot.standby
        assert standby is not None
        if not read_answer(standby.channel):
            self._drop(supervisor, slot, _PREPARE)
            return False
        slot.prepared = "answered"
        return True

    def _drop(self, supervisor: WorkerSupervisor, slot: Slot, phase: str, late: str | None = None) -> None:
        """The standby exited before it could do ``phase``, or did not do it within ``late``
        (the limit, named): kill it; the slot's current worker goes on. The warning says
        which, with the exit code of one that exited."""
        standby = slot.standby
        assert standby is not None
        if late is not None:
            why = f"it did not {phase} within {late}"
        else:
            code = supervisor.handovers.exitcode(slot.index)
            why = f"it exited with exit code {format_exitcode(code)} before it could {phase}"
        log.warning(
            "%s could not start slot %d's next worker (pid %s) for recycling: %s; its current "
            "worker goes on, and another is started at the next call",
            supervisor.label,
            slot.index,
            standby.process.pid,
            why,
        )
        self._forget_standby(supervisor, slot)

    def _forget_standby(self, supervisor: WorkerSupervisor, slot: Slot) -> None:
        """The slot's standby, if any, is killed and forgotten."""
        if slot.drop_standby() is not None:
            supervisor.handovers.discard(slot.index)

    # ------------------------------------------------------------------ boundaries
    def route(self, env: Upstream, supervisor: WorkerSupervisor, index: int, message: Any) -> Any:
        """A command to slot ``index``'s channel: ``None`` to send it as is, else
        ``(channel, message)`` to send instead (see the module docstring)."""
        slot = self.slots[index]
        command = message[0]
        if command == "reset":
            if slot.due is not None and self._standby_ready(env, supervisor, slot):
                channel = self._swap(env, supervisor, slot, "reset", time.monotonic())
                return channel, message
            self._boundary(supervisor, slot)
            return None
        if command == "step_and_maybe_reset" and slot.due is not None and slot.standby is not None:
            slot.translated = True
            return None, ("step", message[1])
        return None

    def after_wait(self, env: Upstream, supervisor: WorkerSupervisor, indices: list[int]) -> None:
        """After the answers of slots ``indices``: a swapped slot's first reset is done (its
        record is finished); episode ends inside ``step_and_maybe_reset`` are counted, and a
        translated slot whose episode ended gets its standby, reset."""
        owner = env.owner
        for index in indices:
            slot = self.slots[index]
            if slot.swap is not None:
                self._finish_swap(slot)
            translated = slot.translated
            channel = owner.channels[index]
            if not translated and getattr(channel, "last_command", None) != "step_and_maybe_reset":
                continue
            slot.translated = False
            if not _episode_ended(owner, index):
                continue
            if not translated:
                self._boundary(supervisor, slot)  # the worker reset its env itself
                continue
            t0 = time.monotonic()
            target = channel
            if self._standby_ready(env, supervisor, slot):
                target = self._swap(env, supervisor, slot, "step_and_maybe_reset", t0)
            # Else the standby could not start: the old worker resets its env, as it was asked.
            target.send(("reset", (False, {})))  # counted by the route
            await_answers(supervisor, env, [index], self.options.answer_limit(env.pipe_timeout))
            if slot.swap is not None:
                self._finish_swap(slot)

    def _boundary(self, supervisor: WorkerSupervisor, slot: Slot) -> None:
        """The slot's worker starts an episode: count it; is the slot due now?"""
        slot.episodes += 1
        if self.every is not None and slot.episodes >= self.every and slot.due is None:
            slot.due = "episodes"
        if self.memory is not None and slot.due is None:
            held = self._held(supervisor, slot, self.memory)
            if held is not None:
                over = _after_one_more(slot, held) > self.memory  # now, or after one more
                slot.boundary_memory = held
                if over:
                    slot.due = "memory"

    def _held(self, supervisor: WorkerSupervisor, slot: Slot, cap: int) -> int | None:
        """The slot's tree memory now, read, or estimated where the estimate says it is not due
        (NOTE [unique memory]); ``None`` if its worker is gone, or if its RSS alone shows that
        it is not due (its USS is no more than its RSS)."""
        tree = supervisor.sample_tree(slot.index, smaps=False)
        if tree is None:
            return None
        if not self._unique(supervisor):
            return tree.rss
        if _after_one_more(slot, tree.rss) <= cap:
            return None
        now = time.monotonic()
        last = slot.reading
        if last is not None and now < last.until:
            estimate = last.uss + max(0, tree.rss - last.rss)
            if _after_one_more(slot, estimate) <= cap:
                return estimate
        t0 = time.perf_counter()
        tree = supervisor.sample_tree(slot.index, smaps=True)
        if tree is None or tree.uss is None:
            return None
        # The reads that refresh estimates take at most WATCH_SHARE of the time, all slots together.
        spacing = (time.perf_counter() - t0) * len(supervisor.pids()) / WATCH_SHARE
        slot.reading = Reading(tree.uss, tree.rss, now + max(SAMPLE_INTERVAL, spacing))
        return tree.uss

    def _standby_ready(self, env: Upstream, supervisor: WorkerSupervisor, slot: Slot) -> bool:
        """Whether the slot's standby can take the slot now: its handshake (if it was not built
        before the boundary) and its prepared reset awaited. Every standby's env is reset ahead,
        late or not, so that the slot's data never depends on when it got ready (a reset with
        an input is the env's second either way)."""
        standby = slot.standby
        if standby is None:
            return False
        if not standby.ready and not self._try_ready(env, supervisor, slot, wait=True):
            return False
        return self._await_prepared(supervisor, slot, env)

    def _swap(self, env: Upstream, supervisor: WorkerSupervisor, slot: Slot, command: str, t0: float) -> Any:
        """The standby takes the slot; the old worker retires (it is sent "close" once the new
        one has answered its first reset: the two do not share the cores meanwhile). Returns
        the new channel."""
        cause, seed = slot.due, slot.standby_seed
        standby = slot.drop_standby()
        assert standby is not None and cause is not None
        slot.due = None
        old_pid = supervisor.pids()[slot.index]
        new, old = supervisor.promote(slot.index, self.options.shutdown_timeout)
        assert isinstance(new, RestartableChannel) and isinstance(old, RestartableChannel)
        self.starter.install(env, standby, new)
        new.hook, old.hook = old.hook, None
        slot.new_worker()
        record = RestartRecord(
            slot.index,
            old_pid,
            standby.process.pid,
            cause,
            command,
            time.time(),
            0.0,
            seed=None if seed is None else seed[0],
        )
        slot.swap = Swap(record, t0, supervisor.label, old)
        return new

    def _finish_swap(self, slot: Slot) -> None:
        """The slot's new worker answered its first reset: its record, with the time the swap
        took (the reset included), is finished; the old worker is sent "close"."""
        swap = slot.swap
        assert swap is not None
        slot.swap = None
        done = dataclasses.replace(swap.record, ready_after=time.monotonic() - swap.started)
        swap.retiring.send(("close", None))
        log.info("%s recycled worker %s", swap.label, done)
        self.finished.append(done)

    def forget_slot(self, supervisor: WorkerSupervisor, index: int) -> None:
        """Slot ``index`` lost its worker (restarted): its recycling starts over."""
        slot = self.slots[index]
        if slot.swap is not None:
            slot.swap.retiring.send(("close", None))  # the retired worker: its successor was lost
        self._forget_standby(supervisor, slot)
        slot.end_recycling()


def _answered_or_gone(
    supervisor: WorkerSupervisor, index: int, standby: StartingWorker
) -> Literal["answered", "gone"] | None:
    """Whether slot ``index``'s ``standby`` answered (its pipe has data), or exited."""
    if standby.channel.poll(0):
        return "answered"
    return "gone" if supervisor.handovers.gone(index) else None


def _wait_answered_or_gone(
    supervisor: WorkerSupervisor, index: int, standby: StartingWorker, deadline: float, limit: str
) -> Literal["answered", "gone"] | Late | None:
    """:func:`_answered_or_gone`, waited for until ``deadline`` (``limit`` names it if late)."""
    look = functools.partial(_answered_or_gone, supervisor, index, standby)
    return wait_for(look, deadline, limit, sleep=on([standby.channel, standby.process.sentinel]))


def _after_one_more(slot: Slot, held: int) -> int:
    """The slot's memory after one more episode that grows it as much as the last one did,
    from ``held`` now and what it held at its last boundary."""
    last = held if slot.boundary_memory is None else slot.boundary_memory
    return held + max(0, held - last)


def _episode_ended(owner: Upstream, slot: int) -> bool:
    """Whether slot ``slot``'s last answer ended its episode (its ``("next", "done")``)."""
    done = owner.slot_buffers[slot].get(("next", "done"), None)
    return bool(done is not None and done.any())
