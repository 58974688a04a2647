"""Recycling workers at episode boundaries: ``recycle_memory`` and ``recycle_every``.

A slot becomes *due* when its worker's tree (it and every descendant) holds more than
``recycle_memory`` bytes resident, or is about to (its RSS at an episode boundary plus what its
last episode added), or when the worker has run ``recycle_every`` episodes. Between two calls
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
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing.connection
import time
from typing import TYPE_CHECKING, Any, Literal

from ._channel import RestartableChannel
from ._compat import Upstream
from ._errors import format_exitcode
from ._policy import RecycleCause, RestartRecord, replacement_seed
from ._replace import Launch, Launcher, await_answers, greet, read_answer, send_seed
from ._supervisor import WorkerSupervisor
from ._worker import PREPARE_RESET

if TYPE_CHECKING:
    from ._options import Options

__all__ = ["Recycler"]

log = logging.getLogger("torchrl_ext")

#: The phase of a standby's NOTE [prepared reset], as a dropped standby's warning names it.
_PREPARE = "reset its env ahead"


class Recycler:
    """What one env does to recycle its workers (see the module docstring).

    Fields (the env's calling thread only): ``episodes`` counts, per slot, the resets of its
    current worker; ``due`` holds the slots to recycle at their next boundary and why;
    ``standby`` their next workers once started; ``translated`` the slots whose
    ``step_and_maybe_reset`` in flight was sent as ``step``; ``rss_at`` each slot's tree RSS at
    its last boundary (``recycle_memory``); ``prepared`` the standbys sent
    :data:`PREPARE_RESET` (``"sent"``) and those whose answer was read (``"answered"``).
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
        self.rss_at: dict[int, int] = {}
        self.prepared: dict[int, Literal["sent", "answered"]] = {}
        self._seen_samples: object = None
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
        self.rss_at.clear()
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
            samples = supervisor.stats.sampler.samples
            if samples is not self._seen_samples:  # a new sample (once a second)
                self._seen_samples = samples
                pids = supervisor.pids()
                for slot, sample in samples.items():
                    if slot < len(pids) and sample.pid == pids[slot] and sample.rss > self.memory:
                        self.due.setdefault(slot, "memory")
        return any(self.prepared.get(slot) != "answered" for slot in self.due)

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
                if not greet(launch):
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
        if self.memory is not None:
            rss = supervisor.tree_rss(slot)
            if rss is not None:
                grew = max(0, rss - self.rss_at.get(slot, rss))
                self.rss_at[slot] = rss
                if rss + grew > self.memory:  # over, or would be after one more such episode
                    self.due.setdefault(slot, "memory")

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
        self.rss_at.pop(slot, None)
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
        self.rss_at.pop(slot, None)
        pending = self._records.pop(slot, None)
        if pending is not None:
            pending[3].send(("close", None))  # the retired worker: its successor was lost
        self._forget_standby(supervisor, slot)


def _episode_ended(owner: Upstream, slot: int) -> bool:
    """Whether slot ``slot``'s last answer ended its episode (its ``("next", "done")``)."""
    done = owner.slot_buffers[slot].get(("next", "done"), None)
    return bool(done is not None and done.any())
