"""The supervisor: owns the process state of one started ManagedParallelEnv.

It records every worker (pid, create time, process group) and, twice a second, every
descendant (sampling the trees for ``stats()``, ``_stats``); a watcher thread (``_watcher``,
which owns the descriptors it waits on) waits on the workers' sentinels, so a death is seen
when it happens; what each round waits on and does is planned here (:meth:`_plan_round`).
On a death it kills and reaps the dead worker's whole tree at once and keeps the failure,
which the env raises on its pending or next call. :meth:`WorkerSupervisor.shutdown` is the
bounded close, NOTE [shutdown order] in ``_shutdown``.

What the env may ask of it (nothing outside this module takes its lock or reads its records):
the one failure query (:meth:`WorkerSupervisor.failure`), the pending losses
(:meth:`~WorkerSupervisor.losses`), waiting until a loss is handled
(:meth:`~WorkerSupervisor.wait_handled`), replacing a slot's worker, killing a hung one (its
stacks first, ``_stacks``), giving up (:meth:`~WorkerSupervisor.give_up`), and, for recycling,
a slot's standby and retiring workers (``_handover``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

from . import _identity, _reaper_client, _stacks
from ._channel import ParentChannel, RestartableChannel
from ._done_signal import DoneSignal
from ._errors import WorkerDiedError, WorkerHungError, format_exitcode
from ._handover import Handovers
from ._hosts import Hosts
from ._record import Loss, TreeSample, WorkerRecord, kill_worker_tree, startup_failure
from ._report import SupervisionReport, WorkerOutcome
from ._shutdown import close_workers
from ._stats import EnvStats
from ._tag import Tag
from ._wait import Late, wait_for
from ._watcher import Round, Watcher
from ._wire import read_report, rebuild_exception

__all__ = ["LOST_PIPE_WAIT", "WorkerSupervisor"]

log = logging.getLogger("torchrl_ext")

SNAPSHOT_INTERVAL = 0.5
FALLBACK_POLL_INTERVAL = 0.1
#: How long a closed pipe may precede the death of its worker becoming visible.
LOST_PIPE_WAIT = 1.0
#: Longest :meth:`WorkerSupervisor.poll` waits for another thread to finish handling an exit
#: (reading its status and killing its tree, each bounded well within this).
HANDLED_WAIT = 30.0


def _ready_now(fds: Iterable[int]) -> list[int]:
    """The descriptors of ``fds`` with an event now (readable, hung up or closed), as
    ``multiprocessing.connection.wait(fds, timeout=0)`` answers, without its selector object:
    :meth:`WorkerSupervisor.poll` runs after every batched step."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(0)]


class WorkerSupervisor:
    """Supervises the workers of one start of a ManagedParallelEnv."""

    def __init__(
        self,
        tag: Tag,
        shutdown_timeout: float,
        label: str,
        base_dir: str | None = None,
        stats: EnvStats | None = None,
    ) -> None:
        #: The tag every process of this env carries (the leak check and the sweeps read it).
        self.tag = tag
        #: The env's statistics (``None``: not collected): the watcher counts losses there and
        #: samples the workers' trees into it (and publishes the env's status: ``_status``).
        self.stats = stats
        #: The process that made it: a fork of that process does not close its workers (``_start``).
        self.owner_pid = os.getpid()
        #: Seconds a closing worker gets before its tree is killed. Set here only.
        self.shutdown_timeout = shutdown_timeout
        #: The env's name in log lines and errors. Set here only.
        self.label = label
        #: Workers' exit reports, the done fifo, the status file; inside the reaper's directory
        #: when there is one (the reaper removes it if we die). Set here only.
        self.report_dir = tempfile.mkdtemp(prefix="reports-", dir=base_dir)
        #: The slots' current workers, one per slot (:meth:`attach`, :meth:`replace`,
        #: :meth:`promote`, under ``_lock``).
        self._workers: list[WorkerRecord] = []
        #: Guards the fields the watcher and the env's thread both write.
        self._lock = threading.RLock()
        #: Set when a failure is recorded; cleared when the last lost slot is replaced.
        self._failure_seen = threading.Event()
        #: Set once by :meth:`shutdown`: exits from then on are the close's, not losses.
        self._closing = False
        #: Where workers say "done" and where a death wakes the env's waiting main thread.
        self.done_signal = DoneSignal(os.path.join(self.report_dir, "done.fifo"))
        if stats is not None:
            stats.bind(label, os.path.join(self.report_dir, "status.json"))
        #: The thread that waits on the workers' exits, and the descriptors it waits on.
        self._watcher = Watcher(f"torchrl_ext-supervisor-{label}", self._lock, self._plan_round)
        #: The env's failure, raised at its next call: the first loss with restarts off, or the
        #: one the restarts gave up on (:meth:`give_up`). Set once, under ``_lock``.
        self.first_failure: BaseException | None = None
        #: With restarts on (set once, by :meth:`enable_restarts`, before :meth:`attach`): lost
        #: workers (tree already killed) the env has not handled yet; their failures are not
        #: raised here (``first_failure`` stays None).
        self.restartable = False
        #: Channels are restartable ones (restarts or recycling may replace a worker); set with it.
        self._replaceable = False
        #: Lost workers not replaced yet (restarts on): the watcher adds; :meth:`replace` removes
        #: one, :meth:`give_up` and :meth:`shutdown` all. Under ``_lock``.
        self.lost: list[WorkerRecord] = []
        #: Workers replaced so far; only grows. :meth:`replace`.
        self.restarts = 0
        #: Recycling (``_recycle``): the slots' standby and retiring workers.
        self.handovers = Handovers(label, self._lock, self._watcher.retire_fd)
        #: The slots that share a worker process (``_hosts``; ``None``: one process each). Set by
        #: :meth:`attach`; its groups are broken up by :meth:`replace`, under ``_lock``.
        self.hosts: Hosts | None = None
        #: The trees have not been sampled for ``stats()`` yet: the watcher's first round does
        #: it at once (:meth:`attach` leaves it to the watcher). Cleared by that round's plan.
        self._sample_due = True

    # ------------------------------------------------------------------ set-up
    def enable_restarts(self, on: bool, replaceable: bool = False) -> None:
        """Once the start succeeded, before :meth:`attach`: deaths become losses to restart
        (``on``); the channels are restartable ones when workers may be replaced at all
        (restarts or recycling: ``replaceable``)."""
        self.restartable = on
        self._replaceable = on or replaceable

    def report_path(self, index: int) -> str:
        return os.path.join(self.report_dir, f"worker-{index}.report")

    def attach(
        self, processes: list[Any], channels: list[Any], hosts: Hosts | None = None
    ) -> list[ParentChannel]:
        """Record started workers (``hosts``: the slots that share a process, ``_hosts``);
        returns channels that remember the last command."""
        wrapped = []
        with self._lock:
            self.hosts = hosts
            for index, (process, channel) in enumerate(zip(processes, channels, strict=True)):
                worker = self._record(index, process, channel)
                if hosts is not None:
                    worker.channel.step_role = hosts.role(index)
                wrapped.append(worker.channel)
                self._workers.append(worker)
        # The descendants and OOM baselines now; the trees' first sample (a page walk per
        # worker: a tenth of a second at 16) by the watcher, while the first reset runs.
        self._snapshot(sample=False)
        self._watcher.start()
        return wrapped

    def _record(self, index: int, process: Any, channel: Any) -> WorkerRecord:
        recorder = channel
        if not isinstance(channel, ParentChannel):
            recorder = RestartableChannel(channel) if self._replaceable else ParentChannel(channel)
        ctime = _identity.start_time_of(process.pid)
        if ctime is None:
            ctime = 0.0  # already gone: no process of today has this identity
        _reaper_client.watch(process.pid, ctime, process.pid)
        worker = WorkerRecord(index, process, process.pid, ctime, recorder)
        recorder.on_eof = functools.partial(self._loss_of, worker)
        return worker

    def _loss_of(self, worker: WorkerRecord) -> BaseException | None:
        """``worker``'s failure once its exit is handled (a closed pipe precedes the exit)."""

        def handled() -> bool:
            if not worker.handled.is_set():
                self.poll()
            return worker.handled.is_set()

        wait_for(
            handled,
            time.monotonic() + LOST_PIPE_WAIT,
            f"the exit of worker {worker.index} was not handled within {LOST_PIPE_WAIT:g} s",
            sleep=worker.handled.wait,
        )
        return worker.failure

    def drain_owed(self, timeout: float) -> None:
        """Drop the answers live workers still owe on their pipes (see RestartableChannel)."""
        until = time.monotonic() + timeout
        with self._lock:
            live = [w for w in self._workers if not w.finished]
        for worker in live:
            if isinstance(worker.channel, RestartableChannel):
                worker.channel.drain(until)

    def replace(self, index: int, process: Any, channel: Any) -> ParentChannel:
        """Record ``process`` (started) as slot ``index``'s worker in place of the lost one."""
        with self._lock:
            position = self._position(index)
            old = self._workers[position]
            worker = self._record(index, process, channel)
            self._workers[position] = worker
            self.lost = [w for w in self.lost if w is not old]
            if not self.lost and self.first_failure is None:
                self._failure_seen.clear()
            self.restarts += 1
            if self.hosts is not None:  # its host is gone: each of its slots steps alone now
                for slot in self.hosts.break_group(index):
                    self._workers[self._position(slot)].channel.step_role = None
            if old.pidfd is not None:  # closed by the watcher, which may be waiting on it now
                self._watcher.retire_fd(old.pidfd)
        _reaper_client.unwatch(old.pid)
        old.release_process()  # its status was collected when it was lost
        old.channel.on_eof = None  # it refers back to the worker
        if isinstance(old.channel, RestartableChannel):
            old.channel.hook = None  # the slot's hook goes with the slot, not the dead channel
        with contextlib.suppress(OSError):
            old.channel.close()  # now, not when a collection finds the old record
        self._watcher.wake()
        return worker.channel

    # ------------------------------------------------------------------ recycling
    def add_standby(self, index: int, process: Any, channel: Any) -> ParentChannel:
        """Record ``process`` (started) as slot ``index``'s next worker; returns its channel."""
        with self._lock:
            worker = self._record(index, process, channel)
            self.handovers.standby[index] = worker
        return worker.channel

    def sample_tree(self, index: int, smaps: bool) -> TreeSample | None:
        """Slot ``index``'s worker tree now (see ``WorkerRecord.sample``)."""
        return self._worker(index).sample(smaps)

    def promote(self, index: int, close_within: float) -> tuple[ParentChannel, ParentChannel]:
        """Slot ``index``'s standby becomes its worker; the old one retires (it is sent "close"
        by the caller, and killed with its tree if it has not exited ``close_within`` seconds
        from now). Returns the new channel and the old one."""
        with self._lock:
            new = self.handovers.standby.pop(index)
            position = self._position(index)
            old = self._workers[position]
            self._workers[position] = new
            self.handovers.retiring.append((old, time.monotonic() + close_within))
        self._watcher.wake()
        return new.channel, old.channel

    def _worker(self, index: int) -> WorkerRecord:
        with self._lock:
            return self._workers[self._position(index)]

    def _position(self, index: int) -> int:
        """Where slot ``index``'s worker is in ``_workers`` (call it holding ``_lock``)."""
        return next(i for i, w in enumerate(self._workers) if w.index == index)

    def pids(self) -> list[int]:
        """The current worker pids, by slot (no lock: safe in a forked copy of this process)."""
        return [w.pid for w in sorted(list(self._workers), key=lambda w: w.index)]

    def alive(self) -> list[bool]:
        """By slot, whether its current worker runs (its exit not noticed; no lock, no system call)."""
        return [not w.finished for w in sorted(list(self._workers), key=lambda w: w.index)]

    def sentinel(self, index: int) -> int:
        """What becomes readable when slot ``index``'s current worker exits."""
        return self._worker(index).sentinel

    def exit_noticed(self, index: int) -> bool:
        """Whether the exit of slot ``index``'s current worker has been noticed (watcher or poll)."""
        return self._worker(index).finished

    def is_gone(self, index: int) -> bool:
        """Whether slot ``index``'s current worker has exited (noticed or not)."""
        worker = self._worker(index)
        return worker.finished or worker.exited()

    def forget_report(self, index: int) -> None:
        """Remove a lost worker's report, so that its replacement starts with none."""
        with contextlib.suppress(OSError):
            os.unlink(self.report_path(index))

    def kill_hung(self, index: int, timeout: float) -> None:
        """SIGKILL slot ``index``'s worker (it did not answer within ``timeout`` seconds); its
        tree is killed and its loss recorded as for any death."""
        worker = self._worker(index)
        worker.hung = True
        worker.hang_timeout = timeout
        worker.stacks = _stacks.capture(worker.pid, worker.create_time, self.report_path(index))
        worker.signal(signal.SIGKILL)

    # ------------------------------------------------------------------ watching
    def _plan_round(self) -> Round:
        """The watcher's next round (under the lock): the current workers' exits and the
        retiring workers (``_handover``), then the snapshot."""
        pending = {w.sentinel: w for w in self._workers if not w.finished}
        retiring = self.handovers.sentinels()
        polled = [w for w in pending.values() if w.pidfd is None]
        # Without pidfds (macOS, old kernels) a sentinel can stay open after the worker died
        # (forked grandchildren inherit it), so those workers are also polled.
        timeout = FALLBACK_POLL_INTERVAL if polled or retiring else SNAPSHOT_INTERVAL
        if self._sample_due:
            self._sample_due, timeout = False, 0.0

        def handle(ready: list[int]) -> None:
            if retiring:
                self.handovers.watch([fd for fd in ready if fd in retiring])
            for fd in ready:
                if fd in pending:
                    self._on_exit(pending[fd])
            for worker in polled:
                if not worker.finished and worker.exited():
                    self._on_exit(worker)
            self._snapshot()

        return Round([*pending, *retiring], timeout, handle)

    def _snapshot(self, sample: bool = True) -> None:
        """Refresh each live worker's descendants; with ``sample``, sample their trees for
        ``stats()`` if due."""
        with self._lock:
            live = [w for w in self._workers if not w.finished]
            standby = list(self.handovers.standby.values())
        workers = live + standby  # a standby's descendants too: they die with it
        trees = _identity.descendants_of([w.pid for w in workers])
        for worker in workers:
            worker.refresh(trees[worker.pid])
        if sample and self.stats is not None:
            self.stats.observe(live, self.tag.owner)

    def poll(self) -> None:
        """Synchronously notice workers that have exited (cheap: one select). When it returns,
        every exit it saw, and every exit another thread had begun to handle, is handled."""
        with self._lock:
            pending = {w.sentinel: w for w in self._workers if not w.finished}
            handling = [w for w in self._workers if w.finished and not w.handled.is_set()]
        for worker in handling:  # the supervisor thread saw it first and is killing its tree
            worker.handled.wait(HANDLED_WAIT)
        if not pending:
            return
        for fd in _ready_now(pending):
            self._on_exit(pending[fd])
        for worker in pending.values():
            if worker.pidfd is None and not worker.finished and worker.exited():
                self._on_exit(worker)

    def _on_exit(self, worker: WorkerRecord) -> None:
        with self._lock:
            if worker.finished:
                return
            worker.finished = True
            worker.lost_at = time.monotonic()
            closing = self._closing
        try:
            self._handle_exit(worker, closing)
        finally:
            worker.handled.set()

    def _handle_exit(self, worker: WorkerRecord, closing: bool) -> None:
        worker.exitcode = worker.read_exitcode()
        worker.oom = worker.oom_kill(self.stats.sampler.rss_of(worker) if self.stats else None)
        if closing:
            return
        failure, raised_in = self._failure_for(worker)
        hung = worker.hung or isinstance(failure, WorkerHungError)  # itself, or its host (_hosts)
        # Kill the dead worker's tree before anyone can see the failure: once the error is
        # raised, nothing of that worker is left.
        # It was alive a moment ago, so its process group cannot have been recycled yet.
        worker.descendants_killed = kill_worker_tree([worker], self.tag)
        # With restarts on, the env logs one warning per restart (or raises) instead.
        log.log(
            logging.DEBUG if self.restartable else logging.WARNING,
            "%s worker %d (pid %d) %s; killed and reaped %d descendant process(es)",
            self.label,
            worker.index,
            worker.pid,
            f"hung (no answer within {getattr(failure, 'timeout', worker.hang_timeout):g}s)"
            if hung
            else f"died with exit code {format_exitcode(worker.exitcode)}",
            worker.descendants_killed,
        )
        if self.stats is not None:
            self.stats.losses.count(hung, failure)
        with self._lock:
            worker.failure, worker.raised_in = failure, raised_in
            if self.restartable:
                self.lost.append(worker)
            elif self.first_failure is None:
                self.first_failure = failure
        self._failure_seen.set()
        self.done_signal.notify()

    def _failure_for(self, worker: WorkerRecord) -> tuple[BaseException, str | None]:
        """Why ``worker`` was lost, and the command its env raised in (from its report). A slot
        of a host (``_hosts``) lost without a cause of its own was lost with its process: the
        cause is a sibling's (one that hung, or whose env raised), whichever slot is seen first."""
        own = self._own_failure(worker)
        if own is not None:
            return own
        siblings = self._siblings(worker)
        for sibling in siblings:
            found = self._own_failure(sibling)
            if found is not None:
                return found
        detail = None
        if siblings:
            slots = ", ".join(str(i) for i in self.hosts.hosted(worker.index)) if self.hosts else ""
            detail = f"its process hosted slots {slots} (envs_per_worker), all lost with it"
        last_command = worker.channel.last_command
        return WorkerDiedError(
            worker.index, worker.pid, worker.exitcode, last_command, detail, worker.oom
        ), None

    def _own_failure(self, worker: WorkerRecord) -> tuple[BaseException, str | None] | None:
        """``worker``'s own cause of loss: it hung, or its env raised (its report); else ``None``."""
        if worker.hung:
            hung = WorkerHungError(
                worker.index,
                worker.pid,
                worker.channel.last_command,
                worker.hang_timeout,
                stacks=worker.stacks,
            )
            return hung, None
        report = read_report(self.report_path(worker.index))
        if report is None:
            return None
        raised_in = report.get("last_command")
        failure = rebuild_exception(report, worker.index, worker.pid)
        return failure, raised_in if isinstance(raised_in, str) else None

    def _siblings(self, worker: WorkerRecord) -> list[WorkerRecord]:
        """The other slots of ``worker``'s process, when it hosts several (``_hosts``)."""
        hosts = self.hosts
        if hosts is None:
            return []
        with self._lock:
            slots = hosts.hosted(worker.index)
            return [w for w in self._workers if w is not worker and w.index in slots and w.pid == worker.pid]

    def startup_failure(self) -> BaseException | None:
        """The error that explains a failed start (see :func:`_record.startup_failure`)."""
        return startup_failure(self._workers, self.report_path)

    # ------------------------------------------------------------------ failures
    def failure(self, wait: float | None = None, *, losses: bool = False) -> BaseException | None:
        """The one failure query: what ends the env (a death with restarts off, or a loss given
        up on), or, with ``losses``, the oldest loss still waiting for its restart.

        ``wait=None`` (the hot path, before every call): only what the watcher thread has
        handled, no system call. ``wait >= 0``: notice exits synchronously, waiting up to
        ``wait`` seconds for one (a closed pipe is seen a moment before its worker's death).
        """

        def found() -> tuple[BaseException] | None:  # a tuple: an exception may be false
            if wait is not None:
                self.poll()
            failure = self.first_failure
            if failure is None and losses and self.lost:
                failure = self.lost[0].failure
            return None if failure is None else (failure,)

        seen: tuple[BaseException] | Late | None
        if wait is None:
            seen = found()
        else:
            reason = f"no failure within {wait:g} s"
            seen = wait_for(found, time.monotonic() + wait, reason, sleep=self._failure_seen.wait)
        return seen[0] if seen else None

    def check(self) -> None:
        """Raise :meth:`failure` (no system call): the hot path, and TorchRL's fault check."""
        failure = self.failure()
        if failure is not None:
            raise failure

    @property
    def has_losses(self) -> bool:
        """Whether a lost worker waits for its restart (no system call)."""
        return bool(self.lost)

    def losses(self) -> list[Loss]:
        """Every loss waiting for its restart, oldest first (their trees are already gone)."""
        with self._lock:
            return [w.loss() for w in self.lost]

    def wait_handled(self, index: int, timeout: float) -> None:
        """Wait until the exit of slot ``index``'s current worker is handled (tree killed, loss
        recorded); then raise the env's failure if there is one. A worker whose exit is not
        seen within ``timeout`` raises :class:`WorkerDiedError`."""
        worker = self._worker(index)
        if not worker.handled.wait(timeout):
            self.poll()
        if not worker.handled.is_set():
            asked = worker.channel.last_command
            raise WorkerDiedError(worker.index, worker.pid, None, asked, "its exit was not seen")
        self.check()

    def give_up(self, failure: BaseException) -> BaseException:
        """No more restarts: every pending loss is dropped and ``failure`` becomes the env's
        failure, unless one is already recorded. Returns the failure to raise."""
        with self._lock:
            self.lost = []
            if self.first_failure is None:
                self.first_failure = failure
            self._failure_seen.set()
            return self.first_failure

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, reason: str, timeout: float | None = None) -> SupervisionReport:
        """Close the workers within one deadline: NOTE [shutdown order] (in ``_shutdown``)."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        t0 = time.monotonic()
        with self._lock:
            self._closing = True
            workers = list(self._workers)
        self.handovers.end_all()
        outcome, swept = close_workers(workers, self.tag, self.label, reason, t0, timeout)
        self.stop(deadline=t0 + timeout)
        return SupervisionReport(
            reason=reason,
            duration=time.monotonic() - t0,
            workers=tuple(
                WorkerOutcome(
                    w.index, w.pid, outcome.get(w.index, "killed"), w.exitcode, w.descendants_killed
                )
                for w in workers
            ),
            leftovers_killed=swept,
            restarts=self.restarts,
        )

    def stop(self, deadline: float | None = None) -> None:
        """Stop the watcher thread (waiting for it until ``deadline``, monotonic, at most 2 s
        from now; ``_watcher``), release the workers' descriptors and remove the report
        directory. Idempotent."""
        if not self._watcher.stop(deadline, self._release):
            return
        self.done_signal.close()
        shutil.rmtree(self.report_dir, ignore_errors=True)

    def _release(self) -> list[int]:
        """Once the watcher is gone (under the lock): close each worker's ``Process`` object
        (its sentinel pipes, as upstream's close drops its own; one still running keeps it)
        and return the pidfds still held, for the watcher to close."""
        fds = []
        for worker in self._workers:
            worker.release_process()
            if worker.pidfd is not None:
                fds.append(worker.pidfd)
                worker.pidfd = None  # nothing reads a closed number, or its next owner's
        return fds
