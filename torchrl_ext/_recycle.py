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

import collections
import dataclasses
import logging
import multiprocessing.connection
import time
from typing import Any, Literal

from . import _platform
from ._channel import RestartableChannel
from ._compat import Upstream
from ._errors import format_exitcode
from ._options import Options
from ._policy import RecycleCause, RestartRecord, replacement_seed
from ._replace import Launch, Launcher, await_answers, greet, read_answer, send_seed
from ._stats import SAMPLE_INTERVAL, WATCH_SHARE
from ._supervisor import WorkerSupervisor
from ._worker import PREPARE_RESET

__all__ = ["Recycler"]

log = logging.getLogger("torchrl_ext")

#: The phase of a standby's NOTE [prepared reset], as a dropped standby's warning names it.
_PREPARE = "reset its env ahead"


@dataclasses.dataclass(frozen=True)
class _Reading:
    """One slot's tree at a boundary where its USS was read (NOTE [unique memory])."""

    uss: int
    #: Its RSS in the same read: what the RSS grew since is added to ``uss`` to estimate it.
    rss: int
    #: ``time.monotonic()`` until which an estimate from it may stand.
    until: float


class Recycler:
    """What one env does to recycle its workers (see the module docstring).

    Fields (the env's calling thread only): ``episodes`` counts, per slot, the resets of its
    current worker; ``due`` holds the slots to recycle at their next boundary and why;
    ``standby`` their next workers once started; ``translated`` the slots whose
    ``step_and_maybe_reset`` in flight was sent as ``step``; ``held_at`` each slot's tree
    memory (NOTE [unique memory]) at its last boundary and ``readings`` its last read
    (``recycle_memory``); ``prepared`` the standbys sent :data:`PREPARE_RESET` (``"sent"``)
    and those whose answer was read (``"answered"``).
    """

    def __init__(self, options: Options, launcher: Launcher) -> None:
        self.memory = options.recycle_memory
        self.every = options.recycle_every
        self.options = options
        self.launcher = launcher
        self.episodes: collections.Counter[int] = collections.Counter()
        self.due: dict[int, RecycleCause] = {}
        self.standby: dict[int, Launch] = {}
        self.translated: set[int] = set()
        self.held_at: dict[int, int] = {}
        self.readings: dict[int, _Reading] = {}
        self.prepared: dict[int, Literal["sent", "answered"]] = {}
        self._seen_samples: object = None
        #: Whether this env warned that RSS is its measure (no ``smaps_rollup``): once.
        self._warned_rss = False
        #: Per standby, the seed it was given (``(seed, static_seed)``; ``None``: never seeded).
        self._standby_seed: dict[int, tuple[int, bool] | None] = {}
        #: Per slot swapped whose first reset is still awaited: its record, the swap's time, the
        #: label to log, and the old worker's channel (sent "close" once that reset is answered).
        self._records: dict[int, tuple[RestartRecord, float, str, RestartableChannel]] = {}

    def forget(self) -> None:
        """At close: every slot's count, due cause, standby and pending record is dropped (the
        supervisor's shutdown ended the standbys); a reopened env starts recycling over."""
        self.episodes.clear()
        self.due.clear()
        self.standby.clear()
        self.translated.clear()
        self.held_at.clear()
        self.readings.clear()
        self.prepared.clear()
        self._seen_samples = None
        self._standby_seed.clear()
        self._records.clear()

    @property
    def on(self) -> bool:
        return self.memory is not None or self.every is not None

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
                for slot, sample in samples.items():
                    held = sample.uss if unique else sample.rss
                    current = slot < len(pids) and sample.pid == pids[slot]
                    if current and held is not None and held > self.memory:
                        self.due.setdefault(slot, "memory")
        return any(self.prepared.get(slot) != "answered" for slot in self.due)

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

    def prepare(self, env: Upstream, supervisor: WorkerSupervisor, engine: Any) -> None:
        """Start the due slots' standbys; finish the handshake of those that built their env
        and have them reset it ahead (NOTE [prepared reset]); read the answers that came."""
        for slot in self.due:
            if slot not in self.standby:
                self._launch(supervisor, slot, engine)
        for launch in list(self.standby.values()):
            if launch.ready or self._try_ready(env, supervisor, engine, launch, wait=False):
                self._prepared_reset(supervisor, launch)

    def _launch(self, supervisor: WorkerSupervisor, slot: int, engine: Any) -> None:
        supervisor.forget_report(slot)
        launch = self.launcher.launch(slot, supervisor.tag)
        launch.channel = supervisor.add_standby(slot, launch.process, launch.channel)
        self.standby[slot] = launch
        engine.incarnations[slot] += 1
        seed = engine.seeds.get(slot)
        self._standby_seed[slot] = (
            None if seed is None else (replacement_seed(seed[0], slot, engine.incarnations[slot]), seed[1])
        )

    def _try_ready(
        self, env: Upstream, supervisor: WorkerSupervisor, engine: Any, launch: Launch, wait: bool
    ) -> bool:
        """Finish ``launch``'s handshake (and seeding) as a replacement's (``_replace``); with
        ``wait``, up to ``start_timeout``. A standby that died or is late is discarded (started
        again at the next call)."""
        slot = launch.slot
        limit = self.options.start_timeout
        deadline = launch.launched_at + (limit if limit is not None else float("inf"))
        phase, late = "build its env", None
        while True:
            if launch.channel.poll(0):
                if not greet(launch, engine.answer_limit(env)):
                    break
                seed = self._standby_seed.get(slot)
                if seed is not None:
                    send_seed(launch, *seed)
                    phase = "answer its seed"
                    if not launch.channel.poll(engine.answer_limit(env)):
                        late = engine.answer_bound(env)
                    if late is not None or not read_answer(launch.channel):
                        launch.ready = False
                        break
                return True
            if supervisor.succession.gone(slot):
                break
            if time.monotonic() >= deadline:
                late = f"start_timeout={limit:g}s"
                break
            if not wait:
                return False
            multiprocessing.connection.wait([launch.channel, launch.process.sentinel], timeout=0.02)
        self._drop(supervisor, launch, phase, late)
        return False

    def _prepared_reset(self, supervisor: WorkerSupervisor, launch: Launch) -> bool:
        """NOTE [prepared reset]: ask ready ``launch`` to reset its env ahead (once), and read
        its answer if it came (no wait). True once read; False while it is not there yet, or
        if the standby died (dropped then)."""
        slot = launch.slot
        if slot not in self.prepared:
            launch.channel.send((PREPARE_RESET, None))
            self.prepared[slot] = "sent"
        if self.prepared[slot] == "answered":
            return True
        return launch.channel.poll(0) and self._read_prepared(supervisor, launch)

    def _await_prepared(
        self, supervisor: WorkerSupervisor, launch: Launch, engine: Any, env: Upstream
    ) -> bool:
        """:meth:`_prepared_reset`, waiting for the answer up to the engine's answer limit. False
        if the standby died or passed that limit (dropped then)."""
        if self._prepared_reset(supervisor, launch):
            return True
        if launch.slot not in self.standby:  # it died: dropped
            return False
        deadline = time.monotonic() + engine.answer_limit(env)
        while not launch.channel.poll(0):
            if supervisor.succession.gone(launch.slot):
                self._drop(supervisor, launch, _PREPARE)
                return False
            if time.monotonic() >= deadline:
                self._drop(supervisor, launch, _PREPARE, engine.answer_bound(env))
                return False
            multiprocessing.connection.wait([launch.channel, launch.process.sentinel], timeout=0.02)
        return self._read_prepared(supervisor, launch)

    def _read_prepared(self, supervisor: WorkerSupervisor, launch: Launch) -> bool:
        """Read ``launch``'s answer to :data:`PREPARE_RESET` (it is in its pipe, or EOF)."""
        if not read_answer(launch.channel):
            self._drop(supervisor, launch, _PREPARE)
            return False
        self.prepared[launch.slot] = "answered"
        return True

    def _drop(
        self, supervisor: WorkerSupervisor, launch: Launch, phase: str, late: str | None = None
    ) -> None:
        """``launch`` (a standby) exited before it could do ``phase``, or did not do it within
        ``late`` (the limit, named): kill it; the slot's current worker goes on. The warning
        says which, with the exit code of one that exited."""
        if late is not None:
            why = f"it did not {phase} within {late}"
        else:
            code = supervisor.succession.exitcode(launch.slot)
            why = f"it exited with exit code {format_exitcode(code)} before it could {phase}"
        log.warning(
            "%s could not start slot %d's next worker (pid %s) for recycling: %s; its current "
            "worker goes on, and another is started at the next call",
            supervisor.label,
            launch.slot,
            launch.process.pid,
            why,
        )
        self._forget_standby(supervisor, launch.slot)

    def _forget_standby(self, supervisor: WorkerSupervisor, slot: int) -> None:
        """Slot ``slot``'s standby, if any, is killed and forgotten."""
        self.prepared.pop(slot, None)
        if self.standby.pop(slot, None) is not None:
            supervisor.succession.discard(slot)

    # ------------------------------------------------------------------ boundaries
    def route(self, env: Upstream, supervisor: WorkerSupervisor, engine: Any, slot: int, message: Any) -> Any:
        """A command to slot ``slot``'s channel: ``None`` to send it as is, else
        ``(channel, message)`` to send instead (see the module docstring)."""
        command = message[0]
        if command == "reset":
            if slot in self.due and self._standby_ready(env, supervisor, engine, slot):
                channel = self._swap(env, supervisor, engine, slot, "reset", time.monotonic())
                return channel, message
            self._boundary(supervisor, slot)
            return None
        if command == "step_and_maybe_reset" and slot in self.due and slot in self.standby:
            self.translated.add(slot)
            return None, ("step", message[1])
        return None

    def after_wait(self, env: Upstream, supervisor: WorkerSupervisor, engine: Any, slots: list[int]) -> None:
        """After the answers of ``slots``: a swapped slot's first reset is done (its record is
        kept); episode ends inside ``step_and_maybe_reset`` are counted, and a translated slot
        whose episode ended gets its standby, reset."""
        owner = env.owner
        for slot in slots:
            if slot in self._records:
                self._finish_record(engine, slot)
            translated = slot in self.translated
            channel = owner.channels[slot]
            if not translated and getattr(channel, "last_command", None) != "step_and_maybe_reset":
                continue
            self.translated.discard(slot)
            if not _episode_ended(owner, slot):
                continue
            if not translated:
                self._boundary(supervisor, slot)  # the worker reset its env itself
                continue
            t0 = time.monotonic()
            target = channel
            if self._standby_ready(env, supervisor, engine, slot):
                target = self._swap(env, supervisor, engine, slot, "step_and_maybe_reset", t0)
            # Else the standby could not start: the old worker resets its env, as it was asked.
            target.send(("reset", (False, {})))  # counted by the route
            await_answers(supervisor, env, [slot], engine.answer_limit(env))
            if slot in self._records:
                self._finish_record(engine, slot)

    def _boundary(self, supervisor: WorkerSupervisor, slot: int) -> None:
        """Slot ``slot``'s worker starts an episode: count it; is the slot due now?"""
        self.episodes[slot] += 1
        if self.every is not None and self.episodes[slot] >= self.every:
            self.due.setdefault(slot, "episodes")
        if self.memory is not None and slot not in self.due:
            held = self._held(supervisor, slot, self.memory)
            if held is not None:
                grew = max(0, held - self.held_at.get(slot, held))
                self.held_at[slot] = held
                if held + grew > self.memory:  # over, or would be after one more such episode
                    self.due.setdefault(slot, "memory")

    def _held(self, supervisor: WorkerSupervisor, slot: int, cap: int) -> int | None:
        """Slot ``slot``'s tree memory now, read, or estimated where the estimate says it is
        not due (NOTE [unique memory]); ``None`` if its worker is gone, or if its RSS alone
        shows that it is not due (its USS is no more than its RSS)."""
        tree = supervisor.sample_tree(slot, smaps=False)
        if tree is None:
            return None
        if not self._unique(supervisor):
            return tree.rss
        if tree.rss + max(0, tree.rss - self.held_at.get(slot, tree.rss)) <= cap:
            return None
        now = time.monotonic()
        last = self.readings.get(slot)
        if last is not None and now < last.until:
            estimate = last.uss + max(0, tree.rss - last.rss)
            if estimate + max(0, estimate - self.held_at.get(slot, estimate)) <= cap:
                return estimate
        t0 = time.perf_counter()
        tree = supervisor.sample_tree(slot, smaps=True)
        if tree is None or tree.uss is None:
            return None
        # The reads that refresh estimates take at most WATCH_SHARE of the time, all slots together.
        spacing = (time.perf_counter() - t0) * len(supervisor.pids()) / WATCH_SHARE
        self.readings[slot] = _Reading(tree.uss, tree.rss, now + max(SAMPLE_INTERVAL, spacing))
        return tree.uss

    def _standby_ready(self, env: Upstream, supervisor: WorkerSupervisor, engine: Any, slot: int) -> bool:
        """Whether slot ``slot``'s standby can take the slot now: its handshake (if it was not
        built before the boundary) and its prepared reset awaited. Every standby's env is reset
        ahead, late or not, so that the slot's data never depends on when it got ready (a
        reset with an input is the env's second either way)."""
        launch = self.standby.get(slot)
        if launch is None:
            return False
        if not launch.ready and not self._try_ready(env, supervisor, engine, launch, wait=True):
            return False
        return self._await_prepared(supervisor, launch, engine, env)

    def _swap(
        self, env: Upstream, supervisor: WorkerSupervisor, engine: Any, slot: int, command: str, t0: float
    ) -> Any:
        """The standby takes slot ``slot``; the old worker retires (it is sent "close" once the new
        one has answered its first reset: the two do not share the cores meanwhile). Returns
        the new channel."""
        launch = self.standby.pop(slot)
        self.prepared.pop(slot, None)
        cause = self.due.pop(slot)
        old_pid = supervisor.pids()[slot]
        new, old = supervisor.promote(slot, self.options.shutdown_timeout)
        assert isinstance(new, RestartableChannel) and isinstance(old, RestartableChannel)
        self.launcher.install(env, launch, new)
        new.route = old.route
        old.route = None
        old.intercept = None
        self.episodes[slot] = 0
        self.held_at.pop(slot, None)
        self.readings.pop(slot, None)
        seed = self._standby_seed.pop(slot, None)
        record = RestartRecord(
            slot,
            old_pid,
            launch.process.pid,
            cause,
            command,
            time.time(),
            0.0,
            seed=None if seed is None else seed[0],
        )
        self._records[slot] = (record, t0, supervisor.label, old)
        return new

    def _finish_record(self, engine: Any, slot: int) -> None:
        """Slot ``slot``'s new worker answered its first reset: its record, with the time the
        swap took (the reset included), goes to ``env.restarts`` and ``on_restart``."""
        record, t0, label, old = self._records.pop(slot)
        done = dataclasses.replace(record, ready_after=time.monotonic() - t0)
        old.send(("close", None))
        engine.restarts.append(done)
        log.info("%s recycled worker %s", label, done)
        engine.notify(done)

    def forget_slot(self, supervisor: WorkerSupervisor, slot: int) -> None:
        """Slot ``slot`` lost its worker (restarted): its recycling starts over."""
        self.episodes[slot] = 0
        self.due.pop(slot, None)
        self.translated.discard(slot)
        self.held_at.pop(slot, None)
        self.readings.pop(slot, None)
        pending = self._records.pop(slot, None)
        if pending is not None:
            pending[3].send(("close", None))  # the retired worker: its successor was lost
        self._forget_standby(supervisor, slot)


def _episode_ended(owner: Upstream, slot: int) -> bool:
    """Whether slot ``slot``'s last answer ended its episode (its ``("next", "done")``)."""
    done = owner.slot_buffers[slot].get(("next", "done"), None)
    return bool(done is not None and done.any())
