"""Starting workers in place of others: from the slot's recorded process, on fresh pipes, with
every handshake, seed and reset of one round sent first and awaited together.

TorchRL builds its worker processes in several ways across releases; a copy of what it built is
the one way to build the same again. :func:`recording_starts` keeps a copy of every process the
calling thread starts (before ``start()`` drops its target and kwargs), and
:func:`copy_unstarted` makes a new, unstarted process like one of them with new kwargs.

The slot keeper (``_keeper``) replaces lost workers with it; the recycler (``_recycle``)
starts a slot's next worker ahead of time with it. A :class:`StartingWorker` is one such
process from its start until it answers its first command; the :class:`WorkerStarter` holds what
every start needs (the templates recorded at the env's start, how it started, the reaper's
FIFO) and installs a started worker in the env's by-position lists and views.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import math
import multiprocessing.connection
import multiprocessing.process
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from . import _identity, _platform
from ._compat import PER_START_KWARGS, WORKER_KWARGS, Upstream
from ._cpython import copy_unstarted_process, process_kwargs, process_start_method
from ._done_signal import Answers
from ._intercept import ConfiguredKwargs
from ._patch import ScopedPatch
from ._plan import StartPlan
from ._supervisor import WorkerSupervisor
from ._wait import on, wait_for

__all__ = [
    "StartingWorker",
    "WorkerStarter",
    "await_all",
    "await_answers",
    "copy_unstarted",
    "finish_handshake",
    "handshake",
    "read_answer",
    "recording_starts",
    "reset_all",
    "seed_all",
    "send_seed",
]

log = logging.getLogger("torchrl_ext")

#: How long the supervisor may take to handle a worker's exit (its tree's SIGKILL included).
LOSS_WAIT = 10.0


_recording = threading.local()


def _recording_start(previous: Any) -> Any:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        recorded = getattr(_recording, "into", None)
        if recorded is not None:
            recorded.append(copy.copy(self))  # before start(), which drops target and kwargs
        previous(self)

    start.__wrapped__ = previous  # type: ignore[attr-defined]
    return start


_START_PATCH = ScopedPatch(multiprocessing.process.BaseProcess, "start", _recording_start)


@contextlib.contextmanager
def recording_starts() -> Iterator[list[Any]]:
    """While active, every process this thread starts is recorded, unstarted, in the list
    yielded (the slots' templates)."""
    into: list[Any] = []
    _recording.into = into
    try:
        with _START_PATCH.active():
            yield into
    finally:
        _recording.into = None


_copies = itertools.count(1)


def copy_unstarted(template: Any, kwargs: dict[str, Any]) -> Any:
    """A new, unstarted process like ``template`` (recorded by :func:`recording_starts`) with
    ``kwargs`` as its target's keyword arguments."""
    name = str(template.name)
    base = name.rsplit("-", 1)[0] if "-" in name else name
    return copy_unstarted_process(template, kwargs, f"{base}-restart{next(_copies)}")


@dataclass(eq=False)
class StartingWorker:
    """One worker started for ``slot`` (fields set by :class:`WorkerStarter`, then by the keeper)."""

    slot: int
    process: Any
    #: The parent's end of its pipe: raw until it is installed, then the supervisor's channel.
    channel: Any
    #: Its done event (TorchRL 0.10 waits on events).
    done_event: Any
    #: ``time.monotonic()`` when it was started.
    started_at: float
    #: TorchRL >= 0.15's metadata path: the shared buffers' hand-off its slot got at the
    #: env's start, sent again once it reports its specs (``None``: it answers "started").
    handoff: Any = None
    #: Set once it said it built its env and was sent "init".
    ready: bool = False
    #: Its start time as ``_identity`` reads it, taken right after its start (0.0: it was
    #: gone by then); :meth:`kill` signals only the process that has it.
    create_time: float = 0.0

    def kill(self) -> None:
        """SIGKILL it, if its pid still is the process started (never a reused pid: a
        fork-server child is not ours to reap, so its pid may be reused once it died)."""
        proc = _identity.same_process(self.process.pid, self.create_time)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()


class WorkerStarter:
    """Starts copies of the slots' recorded worker processes and installs them in the env.

    Fields and who changes them (the env's calling thread only): ``templates``, ``plan`` and
    ``fifo`` are set at each start (the keeper's ``adopt``), ``handoffs`` during it, and all
    are dropped at close (:meth:`forget`);
    ``views`` holds weak references to the indexed views whose lists must follow a slot.
    """

    def __init__(self) -> None:
        #: Per slot, the worker process as TorchRL built it, unstarted (see recording_starts).
        self.templates: list[Any] = []
        #: How this start went (a replacement starts the same way) and its reaper's FIFO.
        self.plan: StartPlan | None = None
        self.fifo = ""
        self.views: list[weakref.ref[Any]] = []
        #: Per slot, what TorchRL >= 0.15 sent it at this start's buffers hand-off (#4341);
        #: ``None`` where the start had none. Set by :meth:`recording_handoff`, dropped at close.
        self.handoffs: list[Any] | None = None

    def forget(self) -> None:
        """At close: what this start recorded holds the shared buffers and the done flags."""
        self.templates, self.plan, self.handoffs = [], None, None

    def start(self, slot: int, tag: Any) -> StartingWorker:
        """Start a copy of slot ``slot``'s worker on a fresh pipe and event (not installed:
        it touches no shared buffer before its first command)."""
        template = self.templates[slot]
        assert self.plan is not None  # set with the templates
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
                dict(env_kwargs), dataclasses.replace(env_kwargs.worker_config, arm_pdeathsig=arm)
            )
        self.plan.refresh(self.fifo)
        process = copy_unstarted(template, kwargs)
        with self.plan.tagged(tag):
            process.start()
        child_pipe.close()
        handoff = self.handoffs[slot] if self.handoffs is not None else None
        worker = StartingWorker(slot, process, parent_pipe, event, time.monotonic(), handoff)
        ctime = _identity.start_time_of(process.pid)
        if ctime is not None:
            worker.create_time = ctime
        return worker

    @contextlib.contextmanager
    def recording_handoff(self, env: Upstream) -> Iterator[None]:
        """Around TorchRL's ``_send_worker_buffers``: record what it sends each worker."""
        channels = env.channels
        recorders = [_FirstSent(channel) for channel in channels]
        env.channels = recorders
        try:
            yield
        finally:
            env.channels = channels
        self.handoffs = [recorder.first for recorder in recorders]

    def install(self, env: Upstream, worker: StartingWorker, channel: Any) -> None:
        """Put ``worker`` (recorded by the supervisor as ``channel``) in the owner's lists and
        in those of every indexed view holding its slot (TorchRL >= 0.14 gives a view lists of
        its own, indexed by its position in the view)."""
        worker.channel = channel
        for holder, position in self._holders_of(env.owner, worker.slot):
            holder.workers[position] = worker.process
            holder.channels[position] = channel
            events = holder.events
            if events is not None:
                events[position] = worker.done_event

    def _holders_of(self, owner: Upstream, slot: int) -> list[tuple[Upstream, int]]:
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


class _FirstSent:
    """A parent channel that remembers the first message sent through it."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self.first: Any = None

    def send(self, message: Any) -> None:
        if self.first is None:
            self.first = message
        self._channel.send(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)


def await_all(
    supervisor: WorkerSupervisor,
    waits: dict[int, Callable[..., bool]],
    limit: float,
    channels: dict[int, Any] | None = None,
    since: dict[int, float] | None = None,
) -> tuple[set[int], set[int]]:
    """Poll each slot's ``ready`` until true, waking early when a worker (or its channel) does.
    A worker that dies meanwhile, or is not ready ``limit`` seconds after ``since[slot]``
    (default: now), is lost: a late one is killed with its tree (``kill_hung``). Returns the
    lost slots and, among them, the late ones; each loss is handled (the supervisor's next)."""
    now = time.monotonic()
    deadlines = {slot: (since or {}).get(slot, now) + limit for slot in waits}
    pending = dict(waits)
    lost: set[int] = set()
    late: set[int] = set()
    waitables: list[Any] = []  # what the pause wakes on: the pending workers and channels

    def settled() -> bool:
        for slot, ready in list(pending.items()):
            if ready():
                del pending[slot]
            elif supervisor.is_gone(slot):
                supervisor.poll()
                supervisor.wait_handled(slot, LOSS_WAIT)
                lost.add(slot)
                del pending[slot]
            elif time.monotonic() >= deadlines[slot]:
                supervisor.kill_hung(slot, limit)
                supervisor.wait_handled(slot, LOSS_WAIT)
                lost.add(slot)
                late.add(slot)
                del pending[slot]
        waitables[:] = [supervisor.sentinel(slot) for slot in pending]
        waitables.extend(c for slot, c in (channels or {}).items() if slot in pending)
        return not pending

    # No deadline of its own: each slot leaves ``pending`` by its own (late: killed, lost).
    wait_for(settled, math.inf, "no deadline", sleep=on(waitables))
    return lost, late


def _await_pipes(
    supervisor: WorkerSupervisor,
    workers: Collection[StartingWorker],
    limit: float,
    from_start: bool = False,
) -> tuple[set[int], set[int]]:
    """:func:`await_all` over the workers' pipes: each ready once its answer is there to read;
    ``limit`` counts from each one's start with ``from_start``, else from now."""
    waits = {worker.slot: (lambda c=worker.channel: bool(c.poll(0))) for worker in workers}
    channels = {worker.slot: worker.channel for worker in workers}
    since = {worker.slot: worker.started_at for worker in workers} if from_start else None
    return await_all(supervisor, waits, limit, channels, since)


def handshake(supervisor: WorkerSupervisor, workers: Collection[StartingWorker], limit: float) -> set[int]:
    """TorchRL's handshake with every worker at once: each says it built its env, then is sent
    "init". Returns the slots lost meanwhile (``limit``: ``start_timeout``); the others are ready."""
    lost, late = _await_pipes(supervisor, workers, limit, from_start=True)
    for worker in workers:
        if worker.slot not in lost and not finish_handshake(worker, limit):
            supervisor.wait_handled(worker.slot, LOSS_WAIT)
            lost.add(worker.slot)
    return late


def finish_handshake(worker: StartingWorker, limit: float) -> bool:
    """The end of TorchRL's handshake with one worker whose first answer is in its pipe: read
    it ("started"; or its specs, then :func:`hand_off`), send "init"; ``worker`` is then
    ``ready``. False if it died while building its env (EOF), or failed the hand-off."""
    if worker.handoff is not None:
        if not hand_off(worker, limit):
            return False
    elif not read_answer(worker.channel):
        return False
    worker.channel.send(("init", None))
    worker.ready = True
    return True


def hand_off(worker: StartingWorker, limit: float) -> bool:
    """TorchRL >= 0.15's metadata path (#4341), for one worker whose specs are in its pipe:
    send it its slot's shared buffers as the start did, and read its "started" (``limit``
    seconds at most: a worker silent that long is killed). False if it failed on the way."""
    channel = worker.channel
    try:
        kind, detail = channel.recv()  # ("metadata", specs) or ("metadata_error", traceback)
    except Exception:
        return False
    if kind != "metadata":
        slot, pid = worker.slot, worker.process.pid
        log.warning("ManagedParallelEnv worker %d (pid %s) could not build its env:\n%s", slot, pid, detail)
        return False
    channel.send(worker.handoff)
    if not multiprocessing.connection.wait([channel, worker.process.sentinel], timeout=limit):
        worker.kill()  # its loss is handled by the supervisor, as any death
        return False
    try:
        return bool(channel.recv() == "started")
    except Exception:
        return False


def send_seed(worker: StartingWorker, seed: int, static: bool) -> None:
    """Seed ``worker`` as TorchRL's ``set_seed`` does; its answer is ``("seeded", next seed)``."""
    worker.channel.send(("seed", (seed, static)))


def read_answer(channel: Any) -> bool:
    """Read one answer from ``channel``; False if its worker is gone (EOF or a broken pipe)."""
    try:
        channel.recv()
    except Exception:
        return False
    return True


def seed_all(
    supervisor: WorkerSupervisor, seeds: dict[int, tuple[StartingWorker, int, bool]], limit: float
) -> None:
    """Seed each worker (``slot -> (worker, seed, static_seed)``) as TorchRL's ``set_seed`` does
    (``torch.manual_seed`` and the env's ``set_seed`` in the worker), all sent first."""
    for worker, seed, static in seeds.values():
        send_seed(worker, seed, static)
    lost, _late = _await_pipes(supervisor, [worker for worker, _s, _t in seeds.values()], limit)
    for slot, (worker, _seed, _static) in seeds.items():
        if slot in lost:
            worker.ready = False
        elif not read_answer(worker.channel):
            supervisor.wait_handled(slot, LOSS_WAIT)
            worker.ready = False


def await_answers(supervisor: WorkerSupervisor, env: Upstream, slots: list[int], limit: float) -> set[int]:
    """Wait for the answers of ``slots`` (their done flags) as the env's own wait does, woken
    by the done signal the moment they answer; a slot whose worker dies or passes ``limit`` is
    handled as :func:`await_all` does. Returns the lost slots."""
    owner = env.owner
    answers = Answers(owner.done_flags, owner.events)
    if answers.flags is not None and slots:

        def gone() -> bool:
            return any(supervisor.is_gone(slot) for slot in slots)

        if (
            supervisor.done_signal.wait_for(answers.flags, slots, limit, 0.0, gone, late="return")
            == "answered"
        ):
            return set()
        # Stopped or late: some answered (their flags are set still): the polling wait sorts them out.
    waits: dict[int, Callable[..., bool]] = {slot: functools.partial(answers.take, slot) for slot in slots}
    lost, _late = await_all(supervisor, waits, limit)
    return lost


def reset_all(
    supervisor: WorkerSupervisor, env: Upstream, workers: Collection[StartingWorker], limit: float
) -> None:
    """Reset each worker's env (no input, no kwargs), all sent first; a worker lost meanwhile
    is no longer ``ready``."""
    for worker in workers:
        worker.channel.send(("reset", (False, {})))
    lost = await_answers(supervisor, env, [worker.slot for worker in workers], limit)
    for worker in workers:
        if worker.slot in lost:
            worker.ready = False
