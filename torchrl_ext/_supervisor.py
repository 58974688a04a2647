"""The supervisor: owns the process state of one started ManagedParallelEnv.

It records every worker (pid, create time, process group) and, twice a second, every
descendant; a watcher thread waits on the workers' sentinels, so a death is seen when it
happens rather than at the next poll. On a death it kills and reaps the dead worker's whole
tree at once and keeps the failure, which the env raises on its pending or next call. Its
:meth:`WorkerSupervisor.shutdown` is the bounded close sequence; see the NOTE "shutdown and
failure order" in ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing.connection
import multiprocessing.popen_forkserver
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from . import _identity, _platform, _reaper_client
from ._done_signal import DoneSignal
from ._errors import WorkerDiedError, WorkerHungError, format_exitcode
from ._lifecycle import CLOSE_MESSAGE_SHARE, SIGKILL_SHARE, SIGTERM_SHARE
from ._report import Outcome, SupervisionReport, WorkerOutcome
from ._tag import Tag
from ._wire import read_report, rebuild_exception

__all__ = ["WorkerSupervisor", "is_forwarded_call"]

log = logging.getLogger("torchrl_ext")

SNAPSHOT_INTERVAL = 0.5
FALLBACK_POLL_INTERVAL = 0.1
#: How long a closed pipe may precede the death of its worker becoming visible.
LOST_PIPE_WAIT = 1.0


class _ParentChannel:
    """The parent's end of a worker pipe, remembering the last command sent.

    A read that finds the worker gone raises the worker's failure (``on_eof``, set by the
    supervisor) instead of a bare ``EOFError``: the exception its env raised, or
    :class:`WorkerDiedError`. That is how a call forwarded to the workers' envs
    (``env.some_method()``) that fails there raises the env's error itself: TorchRL's worker
    loop cannot survive it, and the pipe's EOF is all the caller would see.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.last_command: str | None = None
        self.on_eof: Callable[[], BaseException | None] | None = None
        # Bound once: polled after every step (no __getattr__ on the hot path).
        self.poll = conn.poll

    def send(self, obj: Any) -> None:
        if isinstance(obj, tuple) and obj and isinstance(obj[0], str):
            self.last_command = obj[0]
        self._conn.send(obj)

    def recv(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            failure = self.on_eof() if self.on_eof is not None else None
            if failure is not None:
                raise failure from None
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


#: Commands TorchRL's worker loop answers through the shared buffers and done flags only (with
#: restarts, specs are tensor-only: no non-tensor answer on the pipe either).
_NO_PIPE_ANSWER = frozenset({"init", "reset", "step", "step_and_maybe_reset", "close", "load_state_dict"})
#: Every command of TorchRL's worker loop; anything else sent is a call forwarded to the env.
_COMMANDS = _NO_PIPE_ANSWER | {"seed", "state_dict", "set_env_snapshot"}


def is_forwarded_call(command: str | None) -> bool:
    """Whether ``command`` (a channel's last) was a call forwarded to the worker's env."""
    return command is not None and command not in _COMMANDS


class _RestartableChannel(_ParentChannel):
    """A worker pipe of an env with restarts on.

    A send to a lost worker does not raise (the loss is handled where the env waits for the
    answer); the last message is kept (a reset in flight is replayed on the replacement);
    answers still owed on the pipe are counted, so that they can be drained before the next
    call (no later call may read an earlier call's answer); a read that finds the worker gone
    raises the worker's loss (``on_eof``); ``intercept`` (set on a replacement that owes its
    slot a marked transition) may take a command instead of sending it.
    """

    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        self.last_message: Any = None
        self.intercept: Any = None
        self.owed = 0

    def send(self, obj: Any) -> None:
        command = obj[0] if isinstance(obj, tuple) and obj else None
        if command is not None:
            if self.intercept is not None and self.intercept(obj):
                return
            self.last_command = command if isinstance(command, str) else repr(command)
            self.last_message = obj
        try:
            self._conn.send(obj)
        except (OSError, EOFError):
            return
        if command is not None and not (isinstance(command, str) and command in _NO_PIPE_ANSWER):
            self.owed += 1

    def recv(self) -> Any:
        message = super().recv()
        if self.owed:
            self.owed -= 1
        return message

    def drain(self, until: float) -> None:
        """Read and drop the answers still owed, waiting until ``until`` (monotonic) at most."""
        while self.owed:
            if not self._conn.poll(max(0.0, until - time.monotonic())):
                return
            try:
                self._conn.recv()
            except (EOFError, OSError):
                self.owed = 0
                return
            self.owed -= 1


@dataclass
class _Worker:
    index: int
    process: Any  # multiprocessing.Process
    pid: int
    create_time: float
    channel: _ParentChannel
    descendants: dict[tuple[int, float], psutil.Process] = field(default_factory=dict)
    failure: BaseException | None = None
    exitcode: int | None = None
    descendants_killed: int = 0
    finished: bool = False
    sentinel: int = -1
    pidfd: int | None = None
    #: Set when the env killed it for not answering within ``hang_timeout`` seconds.
    hung: bool = False
    hang_timeout: float = 0.0
    #: ``time.monotonic()`` when its exit was noticed.
    lost_at: float = 0.0
    #: Set once its exit has been handled (tree killed, failure recorded).
    handled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        # A pidfd becomes readable when the process exits. The multiprocessing sentinel is a
        # pipe that forked grandchildren (fork-context DataLoader workers) keep open after the
        # worker died, so it is only the fallback where pidfds are unavailable.
        self.pidfd = _platform.open_pidfd(self.pid)
        self.sentinel = self.pidfd if self.pidfd is not None else int(self.process.sentinel)

    def exited(self) -> bool:
        try:
            return self.process.exitcode is not None
        except ValueError:  # multiprocessing.Process.close() was called
            return True


class WorkerSupervisor:
    """Supervises the workers of one start of a ManagedParallelEnv."""

    def __init__(self, tag: Tag, shutdown_timeout: float, label: str, base_dir: str | None = None) -> None:
        self.tag = tag
        self.owner_pid = os.getpid()
        self.shutdown_timeout = shutdown_timeout
        self.label = label
        # Inside the reaper's directory when there is one: the reaper removes it if we die.
        self.report_dir = tempfile.mkdtemp(prefix="reports-", dir=base_dir)
        self._workers: list[_Worker] = []
        self._lock = threading.RLock()
        self._failure_seen = threading.Event()
        self._closing = False
        self._stopped = False
        self._wake_r, self._wake_w = os.pipe()
        #: Where workers say "done" and where a death wakes the env's waiting main thread.
        self.done_signal = DoneSignal(os.path.join(self.report_dir, "done.fifo"))
        self._thread: threading.Thread | None = None
        self.first_failure: BaseException | None = None
        #: With restarts on: lost workers (tree already killed) the env has not handled yet;
        #: their failures are not raised here (``first_failure`` stays None).
        self.restartable = False
        self.lost: list[_Worker] = []
        self.restarts = 0
        self._retired_fds: list[int] = []

    # ------------------------------------------------------------------ set-up
    def report_path(self, index: int) -> str:
        return os.path.join(self.report_dir, f"worker-{index}.report")

    def attach(self, processes: list[Any], channels: list[Any]) -> list[_ParentChannel]:
        """Record started workers; returns channels that remember the last command."""
        wrapped = []
        with self._lock:
            for index, (process, channel) in enumerate(zip(processes, channels, strict=True)):
                worker = self._record(index, process, channel)
                wrapped.append(worker.channel)
                self._workers.append(worker)
        self._snapshot()
        self._thread = threading.Thread(
            target=self._watch, name=f"torchrl_ext-supervisor-{self.label}", daemon=True
        )
        self._thread.start()
        return wrapped

    def _record(self, index: int, process: Any, channel: Any) -> _Worker:
        recorder = channel
        if not isinstance(channel, _ParentChannel):
            recorder = _RestartableChannel(channel) if self.restartable else _ParentChannel(channel)
        try:
            ctime = psutil.Process(process.pid).create_time()
        except psutil.Error:
            ctime = time.time()
        _reaper_client.watch(process.pid, ctime, process.pid)
        worker = _Worker(index, process, process.pid, ctime, recorder)
        recorder.on_eof = functools.partial(self._loss_of, worker)
        return worker

    def _loss_of(self, worker: _Worker) -> BaseException | None:
        """``worker``'s failure once its exit is handled (a closed pipe precedes the exit)."""
        deadline = time.monotonic() + LOST_PIPE_WAIT
        while not worker.handled.is_set() and time.monotonic() < deadline:
            self.poll()
            worker.handled.wait(0.02)
        return worker.failure

    def drain_owed(self, timeout: float) -> None:
        """Drop the answers live workers still owe on their pipes (see _RestartableChannel)."""
        until = time.monotonic() + timeout
        with self._lock:
            live = [w for w in self._workers if not w.finished]
        for worker in live:
            if isinstance(worker.channel, _RestartableChannel):
                worker.channel.drain(until)

    def replace(self, index: int, process: Any, channel: Any) -> _ParentChannel:
        """Record ``process`` (started) as slot ``index``'s worker in place of the lost one."""
        with self._lock:
            position = next(i for i, w in enumerate(self._workers) if w.index == index)
            old = self._workers[position]
            worker = self._record(index, process, channel)
            self._workers[position] = worker
            self.lost = [w for w in self.lost if w is not old]
            if not self.lost and self.first_failure is None:
                self._failure_seen.clear()
            self.restarts += 1
            if old.pidfd is not None:  # closed by the watcher, which may be waiting on it now
                self._retired_fds.append(old.pidfd)
        _reaper_client.send({"op": "unwatch", "pid": old.pid})
        with contextlib.suppress(ValueError, AssertionError):
            old.process.close()  # its status was collected when it was lost
        old.channel.on_eof = None  # it refers back to the worker
        if isinstance(old.channel, _RestartableChannel):
            old.channel.intercept = None
        with contextlib.suppress(OSError):
            old.channel.close()  # now, not when a collection finds the old record
        self._wake_watcher()
        return worker.channel

    def worker(self, index: int) -> _Worker:
        with self._lock:
            return next(w for w in self._workers if w.index == index)

    def forget_report(self, index: int) -> None:
        """Remove a lost worker's report, so that its replacement starts with none."""
        with contextlib.suppress(OSError):
            os.unlink(self.report_path(index))

    def kill_hung(self, index: int, timeout: float) -> _Worker:
        """SIGKILL slot ``index``'s worker (it did not answer within ``timeout`` seconds); its
        tree is killed and its loss recorded as for any death."""
        worker = self.worker(index)
        worker.hung = True
        worker.hang_timeout = timeout
        self._signal_worker(worker, signal.SIGKILL)
        return worker

    def _wake_watcher(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")

    # ------------------------------------------------------------------ watching
    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                pending = {w.sentinel: w for w in self._workers if not w.finished}
                retired, self._retired_fds = self._retired_fds, []
            for retired_fd in retired:
                with contextlib.suppress(OSError):
                    os.close(retired_fd)
            polled = [w for w in pending.values() if w.pidfd is None]
            # Without pidfds (macOS, old kernels) a sentinel can stay open after the worker died
            # (forked grandchildren inherit it), so those workers are also polled.
            timeout = FALLBACK_POLL_INTERVAL if polled else SNAPSHOT_INTERVAL
            ready = multiprocessing.connection.wait([*pending, self._wake_r], timeout=timeout)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for fd in ready:
                if fd in pending:
                    self._on_exit(pending[fd])
            for worker in polled:
                if not worker.finished and worker.exited():
                    self._on_exit(worker)
            self._snapshot()

    def _snapshot(self) -> None:
        with self._lock:
            live = [w for w in self._workers if not w.finished]
        for worker in live:
            # Forget descendants that ended (a DataLoader per reset starts new ones every
            # episode). A new dict replaces the old one, so readers in other threads never see
            # it change size under them.
            descendants = {k: proc for k, proc in worker.descendants.items() if _identity.alive(proc)}
            for proc in _identity.descendants(worker.pid):
                key = _identity.key_of(proc)
                if key is not None:
                    descendants.setdefault(key, proc)
            worker.descendants = descendants

    def poll(self) -> None:
        """Synchronously notice workers that have exited (cheap: one select)."""
        with self._lock:
            pending = {w.sentinel: w for w in self._workers if not w.finished}
        if not pending:
            return
        for fd in multiprocessing.connection.wait(list(pending), timeout=0):
            self._on_exit(pending[fd])  # type: ignore[index]
        for worker in pending.values():
            if worker.pidfd is None and not worker.finished and worker.exited():
                self._on_exit(worker)

    def _on_exit(self, worker: _Worker) -> None:
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

    def _handle_exit(self, worker: _Worker, closing: bool) -> None:
        worker.exitcode = _exitcode(worker)
        if closing:
            return
        failure = self._failure_for(worker)
        # Kill the dead worker's tree before anyone can see the failure: once the error is
        # raised, nothing of that worker is left.
        # It was alive a moment ago, so its process group cannot have been recycled yet.
        worker.descendants_killed = self._kill_tree(worker)
        # With restarts on, the env logs one warning per restart (or raises) instead.
        log.log(
            logging.DEBUG if self.restartable else logging.WARNING,
            "%s worker %d (pid %d) %s; killed and reaped %d descendant process(es)",
            self.label,
            worker.index,
            worker.pid,
            f"hung (no answer within {worker.hang_timeout:g}s)"
            if worker.hung
            else f"died with exit code {format_exitcode(worker.exitcode)}",
            worker.descendants_killed,
        )
        with self._lock:
            worker.failure = failure
            if self.restartable:
                self.lost.append(worker)
            elif self.first_failure is None:
                self.first_failure = failure
        self._failure_seen.set()
        self.done_signal.notify()

    def _failure_for(self, worker: _Worker) -> BaseException:
        last_command = worker.channel.last_command
        if worker.hung:
            return WorkerHungError(worker.index, worker.pid, last_command, worker.hang_timeout)
        report = read_report(self.report_path(worker.index))
        if report is None:
            return WorkerDiedError(worker.index, worker.pid, worker.exitcode, last_command)
        return rebuild_exception(report, worker.index, worker.pid)

    def _tree_of(self, workers: list[_Worker], recent: list[_Worker]) -> list[psutil.Process]:
        """The live processes of ``workers`` (not the workers themselves); the process groups of
        ``recent`` count as anchored (see ``_identity``: their worker was alive a moment ago)."""
        seen = [proc for worker in workers for proc in worker.descendants.values()]
        return _identity.tree(
            {w.pid: (w.create_time, w.pid) for w in workers},
            seen,
            owner=(self.tag.owner_pid, self.tag.owner_create_time),
            env_id=self.tag.env_id,
            worker_index=str(workers[0].index) if len(workers) == 1 else None,
            recent_groups=[w.pid for w in recent],
            include_workers=False,
            dying=True,
        )

    def _kill_tree(self, worker: _Worker) -> int:
        """SIGKILL and reap what is left of a worker that just died."""
        _terminated, killed = _identity.kill_and_reap(
            self._tree_of([worker], recent=[worker]), grace=0.0, kill_wait=2.0
        )
        return len(killed)

    def startup_failure(self) -> BaseException | None:
        """The error that explains a failed start: the earliest env exception, else a death.

        ``None`` when no worker raised and none died abnormally: a worker that reported a
        problem through TorchRL's own protocol and exited 0 leaves TorchRL's error in charge.
        """
        reports = []
        for worker in self._workers:
            report = read_report(self.report_path(worker.index))
            if report is not None:
                reports.append((float(report.get("time", 0.0)), worker.index, worker, report))
        if reports:
            _t, _i, worker, report = min(reports, key=lambda item: item[:2])
            return rebuild_exception(report, worker.index, worker.pid)
        for worker in self._workers:
            if worker.finished or self._exited(worker):
                code = _exitcode(worker)
                if code == 0:
                    continue
                return WorkerDiedError(
                    worker.index, worker.pid, code, "start-up", detail="it died while starting"
                )
        return None

    # ------------------------------------------------------------------ failures
    def raise_known_failure(self) -> None:
        """Raise the first failure the watcher thread has handled; no system call."""
        failure = self.first_failure
        if failure is not None:
            raise failure

    def wait_for_failure(self, timeout: float, lost_counts: bool = False) -> BaseException | None:
        """Wait up to ``timeout`` seconds for a worker death to be noticed; with
        ``lost_counts``, a loss waiting for a restart counts too."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            found = self.first_failure
            if found is None and lost_counts and self.lost:
                found = self.lost[0].failure
            if found is not None or time.monotonic() >= deadline:
                return found
            self._failure_seen.wait(min(0.02, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, reason: str, timeout: float | None = None) -> SupervisionReport:
        """Close the workers within one deadline: close message, SIGTERM, SIGKILL, sweep, reap."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        t0 = time.monotonic()
        with self._lock:
            self._closing = True
            workers = list(self._workers)
        # One deadline for everything, see NOTE [shutdown order] in _lifecycle: the close
        # message, then SIGTERM, then SIGKILL; the sweep and reaping use what is left, and no
        # wait runs past the deadline (SIGKILLed processes die at once: milliseconds).
        deadline = t0 + timeout
        graceful_until = t0 + CLOSE_MESSAGE_SHARE * timeout
        term_until = t0 + SIGTERM_SHARE * timeout
        kill_until = t0 + SIGKILL_SHARE * timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        outcome: dict[int, Outcome] = {}
        for worker in workers:
            if worker.finished or worker.exited():
                outcome[worker.index] = "died"  # exited before anyone asked it to
                continue
            try:
                worker.channel.send(("close", None))
            except (OSError, EOFError, ValueError):
                pass
        self._wait_exit(workers, graceful_until)
        for worker in workers:
            if worker.index not in outcome and self._exited(worker):
                outcome[worker.index] = "graceful"
        escalation: tuple[tuple[int, float, Outcome], ...] = (
            (signal.SIGTERM, term_until, "terminated"),
            (signal.SIGKILL, kill_until, "killed"),
        )
        for sig, until, name in escalation:
            pending = [w for w in workers if w.index not in outcome and not self._exited(w)]
            if not pending:
                break
            for worker in pending:
                log.warning(
                    "%s worker %d (pid %d) did not exit within %.1fs of %s (%s); "
                    "sending %s to its process group",
                    self.label,
                    worker.index,
                    worker.pid,
                    time.monotonic() - t0,
                    "the close message" if sig == signal.SIGTERM else "SIGTERM",
                    reason,
                    _platform.signal_name(sig),
                )
                self._signal_worker(worker, sig)
            self._wait_exit(pending, min(deadline, max(until, time.monotonic() + 0.05)))
            for worker in pending:
                if self._exited(worker):
                    outcome[worker.index] = name
        # Sweep: everything recorded, every group member, every tagged process of this env.
        # A worker that had died before the close anchors its group only through a live process
        # of ours in it: its group id may have been recycled by a stranger since.
        leftovers = self._tree_of(workers, recent=[w for w in workers if outcome.get(w.index) != "died"])
        grace = min(0.5, left() / 2)  # 0 once the deadline is near: SIGKILL at once
        swept_t, swept_k = _identity.kill_and_reap(
            leftovers, grace, what=f"{self.label} leftover", kill_wait=left()
        )
        swept = len(swept_t) + len(swept_k)
        # Whatever dies after the deadline (re-parented to us) is still collected, in the background.
        _identity.reap_later(leftovers)
        if swept:
            log.warning("%s: swept %d leftover process(es) after the workers exited", self.label, swept)
        for worker in workers:
            try:
                worker.process.join(timeout=left())
            except (ValueError, AssertionError):
                pass
            worker.exitcode = _exitcode(worker, wait=min(left(), 1.0))
            worker.finished = True
            _reaper_client.send({"op": "unwatch", "pid": worker.pid})
        # A worker that is reaped has handed its children over: those that died before it are
        # our zombies now (NOTE [shutdown order]); collect them before close() returns.
        _identity.reap_if_child(leftovers, wait=min(left(), _identity.ZOMBIE_WAIT))
        self.stop()
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

    def _exited(self, worker: _Worker) -> bool:
        if worker.exited():
            return True
        return not _identity.running(worker.pid, worker.create_time)

    def _wait_exit(self, workers: list[_Worker], until: float) -> None:
        while True:
            pending = [w for w in workers if not self._exited(w)]
            remaining = until - time.monotonic()
            if not pending or remaining <= 0:
                return
            multiprocessing.connection.wait([w.sentinel for w in pending], timeout=min(remaining, 0.1))

    def _signal_worker(self, worker: _Worker, sig: int) -> None:
        proc = _identity.same_process(worker.pid, worker.create_time)
        if proc is None:  # gone, or its pid was reused: never signal a stranger
            return
        if _platform.process_group_of(worker.pid) == worker.pid:
            try:
                _platform.kill_process_group(worker.pid, sig)
                return
            except (OSError, ValueError):
                pass
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass

    def stop(self) -> None:
        """Stop the watcher thread and remove the report directory. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            retired, self._retired_fds = self._retired_fds, []
        fds = [self._wake_r, self._wake_w, *retired] + [w.pidfd for w in self._workers if w.pidfd is not None]
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.done_signal.close()
        shutil.rmtree(self.report_dir, ignore_errors=True)


def _reap_if_orphaned(worker: _Worker) -> None:
    """A fork-server child whose server died is re-parented to us (the subreaper) and nobody
    else will collect it; a child we started ourselves is left to multiprocessing."""
    proc = _identity.same_process(worker.pid, worker.create_time)
    if proc is not None:
        _identity.reap_if_child([proc])


def _exitcode(worker: _Worker, wait: float = 1.0) -> int | None:
    """The worker's exit code, polled for up to ``wait`` seconds.

    The pidfd and the multiprocessing sentinel turn readable while the kernel is still
    tearing the process down, a moment before its status can be collected.
    """
    deadline = time.monotonic() + wait
    orphan_prone = isinstance(getattr(worker.process, "_popen", None), multiprocessing.popen_forkserver.Popen)
    while True:
        try:
            code = worker.process.exitcode  # collects a child we started ourselves
        except (ValueError, AssertionError):  # Process.close() was called
            return worker.exitcode
        if worker.pidfd is not None and (code is None or (code == 255 and orphan_prone)):
            # The kernel's status, read without collecting it: a fork-server child re-parented
            # to us after its server died reports 255 through multiprocessing.
            peeked = _platform.peek_exit_status(worker.pidfd)
            code = code if peeked is None else peeked
        if code is not None:
            if orphan_prone:
                _reap_if_orphaned(worker)
            return int(code)
        if time.monotonic() >= deadline:
            return worker.exitcode
        time.sleep(0.002)
