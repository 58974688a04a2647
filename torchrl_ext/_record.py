"""What the supervisor knows of one worker: its identity, its pipe, its tree, its exit and its loss.

Identity lives on the object, as psutil's does: ``(pid, create_time)`` (:attr:`WorkerRecord.key`)
decides whether the process may still be signalled (:meth:`WorkerRecord.signal` never signals a
reused pid) and whether it is still running (:meth:`WorkerRecord.gone`).

Fields and who may change them: the supervisor creates a record when a worker is attached or
replaced; its watcher thread (or a synchronous poll) sets ``finished``, ``lost_at``, ``exitcode``,
``descendants_killed`` and ``failure``, then ``handled``, once per record; the slot keeper
sets ``hung`` and ``hang_timeout`` (through ``WorkerSupervisor.kill_hung``) before the kill;
``descendants`` is replaced as a whole by the snapshot (readers never see it change size).
A :class:`TreeSample` is the worker's tree (memory, descendants, descriptors) at one moment.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from . import _cpython, _identity, _platform
from ._channel import ParentChannel
from ._errors import OomKill, WorkerDiedError
from ._tag import Tag
from ._wait import wait_for
from ._wire import read_report, rebuild_exception

__all__ = ["Loss", "TreeSample", "WorkerRecord", "sample_tree", "startup_failure", "worker_tree"]


@dataclass(frozen=True)
class TreeSample:
    """One worker's tree (the worker and every live descendant) at one moment."""

    pid: int
    #: Resident: each process's pages counted in full, those its processes share too.
    rss: int
    #: Proportional (each page divided by the processes that map it) and unique (the pages
    #: no other process maps, summed per process: see docs/restarts.md); ``None`` until the
    #: first ``smaps_rollup`` read of this worker, or where it cannot be read.
    pss: int | None
    uss: int | None
    descendants: int
    fds: int


def sample_tree(
    pid: int, create_time: float, descendants: Iterable[psutil.Process], smaps: bool
) -> TreeSample | None:
    """The tree of worker ``pid`` now; with ``smaps`` (and ``smaps_rollup`` readable), its USS
    and PSS too, read in the same pass as its RSS (about 10 ms per process with torch)."""
    worker = _identity.same_process(pid, create_time)
    if worker is None:
        return None
    smaps = smaps and _platform.has_smaps_rollup()
    rss = pss = uss = fds = count = 0
    for proc in [worker, *descendants]:
        try:
            if smaps:
                memory = _platform.process_memory(proc.pid)
                if memory is None:
                    continue  # it ended between the listing and the read
                rss, pss, uss = rss + memory.rss, pss + memory.pss, uss + memory.uss
            else:
                rss += proc.memory_info().rss
            fds += proc.num_fds()
        except (psutil.Error, OSError):
            continue  # it ended between the listing and the read
        count += proc is not worker
    if not smaps:
        return TreeSample(pid, rss, None, None, count, fds)
    return TreeSample(pid, rss, pss, uss, count, fds)


@dataclass(frozen=True)
class Loss:
    """A lost worker as the slot keeper sees it: a snapshot, taken once its exit was handled."""

    index: int
    pid: int
    exitcode: int | None
    failure: BaseException | None
    hung: bool
    #: ``time.monotonic()`` when the exit was noticed.
    lost_at: float
    descendants_killed: int
    #: The channel of the lost worker (its last command and message: what the slot owes).
    channel: ParentChannel
    #: Its create time (``_identity.start_time``, on ``_identity.clock()``): its identity, and
    #: how long it ran (the restart backoff's rows).
    create_time: float = 0.0
    #: The command its env raised in, as the worker reported it (``None``: no report, or it
    #: raised while building its env). Not ``channel.last_command``, which may be a later one.
    raised_in: str | None = None

    @property
    def command(self) -> str | None:
        """The command it was lost in: the one its env raised in, else its channel's last."""
        return self.raised_in if self.raised_in is not None else self.channel.last_command


@dataclass(eq=False)
class WorkerRecord:
    """One worker process of one start, from its start until it is reaped. Each field: its
    invariant; who writes it. "Whoever ends it": the supervisor at the exit of a worker it holds
    (watcher or poll, under its lock), the handovers for a standby or retiring worker, the close
    (``_shutdown``) for those left at close."""

    #: The slot it holds, or will hold as a standby. Set at start.
    index: int
    #: Its ``multiprocessing.Process``, kept after its exit (``release_process``). Set at start.
    process: Any
    #: Its pid; with ``create_time``, its identity (:attr:`key`). Set at start.
    pid: int
    create_time: float
    #: The parent's end of its pipe. Set at start.
    channel: ParentChannel
    #: Its live descendants, as last seen; replaced whole, never changed in place. :meth:`refresh`.
    descendants: dict[_identity.ProcessKey, psutil.Process] = field(default_factory=dict)
    #: Why it was lost (a ``WorkerError``, or its env's exception); ``None`` while it runs. The supervisor.
    failure: BaseException | None = None
    #: The command its env raised in, from its own report (``None``: no report, or it raised
    #: while building its env): a command sent after it raised may be its channel's last
    #: already. The supervisor, with ``failure``.
    raised_in: str | None = None
    #: Its exit code, once collected (``None`` before, or if it could not be). Whoever ends it.
    exitcode: int | None = None
    #: How many descendants were killed with its tree at its exit. The supervisor.
    descendants_killed: int = 0
    #: Set once, when its exit is noticed. Whoever ends it.
    finished: bool = False
    #: What a wait on its exit wakes on: its pidfd, else its ``multiprocessing`` sentinel. Set at start.
    sentinel: int = -1
    #: Its pidfd; ``None`` where there is none, or once closed by whoever ends it.
    pidfd: int | None = None
    #: Set when the env killed it for not answering within ``hang_timeout`` seconds (set with it).
    #: The supervisor's ``kill_hung``.
    hung: bool = False
    hang_timeout: float = 0.0
    #: What the hung worker's threads were doing when it was killed (``_stacks``), if it said.
    stacks: str | None = None
    #: Its memory cgroup and that cgroup's OOM-kill count, as of the last refresh (``None``:
    #: unknown); compared at its death (:meth:`oom_kill`). :meth:`refresh`.
    cgroup: str | None = None
    oom_kills: int | None = None
    #: Set at its death when the kernel's OOM killer killed it. The supervisor.
    oom: OomKill | None = None
    #: ``time.monotonic()`` when its exit was noticed. The supervisor, with ``finished``.
    lost_at: float = 0.0
    #: Set once its exit has been handled (tree killed, failure recorded). Whoever ends it.
    handled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        # A pidfd becomes readable when the process exits. The multiprocessing sentinel is a
        # pipe that forked grandchildren (fork-context DataLoader workers) keep open after the
        # worker died, so it is only the fallback where pidfds are unavailable.
        self.pidfd = _platform.open_pidfd(self.pid)
        self.sentinel = self.pidfd if self.pidfd is not None else int(self.process.sentinel)

    @property
    def key(self) -> _identity.ProcessKey:
        return (self.pid, self.create_time)

    def loss(self) -> Loss:
        return Loss(
            self.index,
            self.pid,
            self.exitcode,
            self.failure,
            self.hung,
            self.lost_at,
            self.descendants_killed,
            self.channel,
            self.create_time,
            self.raised_in,
        )

    def refresh(self, found: list[psutil.Process]) -> None:
        """While it runs: forget descendants that ended (a DataLoader per reset starts new ones
        every episode) and add the new ones (a new dict replaces the old one, so readers in
        other threads never see it change size under them); read its cgroup's OOM-kill count.

        ``found``: its descendants as the caller just listed them (``_identity.descendants_of``:
        one pass over the process table for every worker)."""
        cgroup = _platform.memory_cgroup(self.pid)
        count = None if cgroup is None else _platform.cgroup_oom_kills(cgroup)
        # Read after the count: a worker already dying (the OOM killer counts its kill when
        # it sends SIGKILL, a moment before the exit) keeps the baseline it had.
        if not _platform.is_dying(self.pid):
            self.cgroup, self.oom_kills = cgroup, count
        descendants = {k: proc for k, proc in self.descendants.items() if _identity.alive(proc)}
        for proc in found:
            key = _identity.key_of(proc)
            if key is not None:
                descendants.setdefault(key, proc)
        self.descendants = descendants

    def oom_kill(self, tree_rss: int | None) -> OomKill | None:
        """Once it died of SIGKILL: whether its cgroup counted an OOM kill since the last refresh
        (``tree_rss``: its tree's last sampled RSS, for the message)."""
        if self.exitcode != -signal.SIGKILL or self.cgroup is None or self.oom_kills is None:
            return None
        now = _platform.cgroup_oom_kills(self.cgroup)
        if now is None or now <= self.oom_kills:
            return None
        return OomKill(self.cgroup, _platform.cgroup_memory_limit(self.cgroup), tree_rss)

    def sample(self, smaps: bool) -> TreeSample | None:
        """It and its known descendants now (``None``: it is gone), with their USS and PSS if
        ``smaps`` (``_stats``; the recycler, at an episode boundary)."""
        return sample_tree(self.pid, self.create_time, self.descendants.values(), smaps)

    def exited(self) -> bool:
        """Whether multiprocessing has collected its exit (cheap; no identity check)."""
        try:
            return self.process.exitcode is not None
        except ValueError:  # multiprocessing.Process.close() was called
            return True

    def release_process(self) -> None:
        """Release the fds its ``multiprocessing.Process`` holds (the sentinel pipes, until the
        object is closed or collected) once its exit is collected; while it runs, keep them.
        The object itself stays as upstream leaves its workers: ``is_alive()`` and ``exitcode``
        still answer for whoever holds it (TorchRL's own tests keep ``env._workers``)."""
        _cpython.release_exited_process(self.process)

    def gone(self) -> bool:
        """Exited, or no process of this identity runs any more."""
        return self.exited() or not _identity.running(self.pid, self.create_time)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group (itself if it leads none); never to a stranger."""
        proc = _identity.same_process(self.pid, self.create_time)
        if proc is None:  # gone, or its pid was reused
            return
        if _platform.process_group_of(self.pid) == self.pid:
            try:
                _platform.kill_process_group(self.pid, sig)
                return
            except (OSError, ValueError):
                pass
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass

    def read_exitcode(self, wait: float = 1.0) -> int | None:
        """Its exit code, polled for up to ``wait`` seconds.

        The pidfd and the multiprocessing sentinel turn readable while the kernel is still
        tearing the process down, a moment before its status can be collected.
        """
        orphan_prone = _cpython.is_forkserver_child(self.process)

        def collected() -> tuple[int | None] | None:  # a tuple: exit code 0 is false
            try:
                code = self.process.exitcode  # collects a child we started ourselves
            except (ValueError, AssertionError):  # Process.close() was called
                return (self.exitcode,)
            if self.pidfd is not None and (code is None or (code == 255 and orphan_prone)):
                # The kernel's status, read without collecting it: a fork-server child
                # re-parented to us after its server died reports 255 through multiprocessing.
                peeked = _platform.peek_exit_status(self.pidfd)
                if peeked is not None and code is None and not orphan_prone:
                    code = self.process.exitcode  # it exited between the two looks: collect it now
                code = code if peeked is None else peeked
            if code is None:
                return None
            if orphan_prone:
                self._reap_if_orphaned()
            return (int(code),)

        reason = f"the exit status of pid {self.pid} was not collected within {wait:g} s"
        # The status follows the sentinel by a moment: a short slice keeps that latency small.
        found = wait_for(collected, time.monotonic() + wait, reason, slice=0.002)
        return found[0] if found else self.exitcode

    def _reap_if_orphaned(self) -> None:
        """A fork-server child whose server died is re-parented to us (the subreaper) and
        nobody else will collect it; a child we started ourselves is left to multiprocessing."""
        proc = _identity.same_process(self.pid, self.create_time)
        if proc is not None:
            _identity.reap_if_child([proc])


def worker_tree(
    workers: Sequence[WorkerRecord], recent: Sequence[WorkerRecord], tag: Tag | None
) -> list[psutil.Process]:
    """The live processes of ``workers`` (not the workers themselves): their recorded
    descendants, their process groups (those of ``recent`` anchored: their worker was alive a
    moment ago, see ``_identity``) and, with ``tag``, every process carrying the env's tag
    (one worker's: that worker's only)."""
    return _identity.tree(
        {w.pid: (w.create_time, w.pid) for w in workers},
        [proc for w in workers for proc in w.descendants.values()],
        owner=None if tag is None else tag.owner,
        env_id=None if tag is None else tag.env_id,
        worker_index=str(workers[0].index) if tag is not None and len(workers) == 1 else None,
        recent_groups=[w.pid for w in recent],
        include_workers=False,
        dying=True,
    )


def kill_worker_tree(workers: Sequence[WorkerRecord], tag: Tag | None) -> int:
    """SIGKILL and reap what is left of ``workers`` (see :func:`worker_tree`); how many
    processes it killed."""
    tree = worker_tree(workers, workers, tag)
    _terminated, killed = _identity.kill_and_reap(tree, grace=0.0, kill_wait=2.0, collect_late=True)
    return len(killed)


def startup_failure(
    workers: Sequence[WorkerRecord], report_path: Callable[[int], str]
) -> BaseException | None:
    """The error that explains a failed start of ``workers``: the earliest env exception (from
    the report files ``report_path(index)``), else a death.

    ``None`` when no worker raised and none died abnormally: a worker that reported a problem
    through TorchRL's own protocol and exited 0 leaves TorchRL's error in charge.
    """
    reports = []
    for worker in workers:
        report = read_report(report_path(worker.index))
        if report is not None:
            reports.append((float(report.get("time", 0.0)), worker.index, worker, report))
    if reports:
        _t, _i, first, report = min(reports, key=lambda item: item[:2])
        return rebuild_exception(report, first.index, first.pid)
    for worker in workers:
        if worker.finished or worker.gone():
            code = worker.read_exitcode()
            if code != 0:
                return WorkerDiedError(
                    worker.index, worker.pid, code, "start-up", detail="it died while starting"
                )
    return None
