"""Closing one start's workers within one deadline: the close message, SIGTERM, SIGKILL, the sweep.

NOTE [shutdown order]
---------------------
Every way a program ends funnels into ``ManagedParallelEnv.close()`` -> the supervisor's bounded
shutdown, in this order:

1. ``close()`` called by the user (or ``__del__``, or a ``with`` block).
2. ``atexit``: our hook is registered after ``multiprocessing.util`` registered its own, and
   atexit runs last-in-first-out, so open envs are closed *before* multiprocessing joins its
   non-daemonic children (which would otherwise wait on our workers forever).
3. SIGTERM / SIGINT / SIGHUP in the main thread: the handler closes every open env, restores the
   previous handlers, then behaves as the previous handler would: re-raise the default action
   (the process dies by that signal), raise ``KeyboardInterrupt``, or call the user's handler.
   Signals that were ignored stay ignored; a second signal during the handler skips the close.
4. The parent of a process that multiprocessing started (a collector worker) dies while
   envs with ``exit_with_parent`` are open: a watcher thread sends this process SIGTERM, so 3.
   runs; if the process is still alive ``PARENT_EXIT_GRACE`` seconds later (SIGTERM ignored),
   SIGKILL, so 5. runs.
5. The main process dies without running Python code (SIGKILL, OOM killer, native crash): the
   external reaper (``_reaper.py``) sees the owner's pidfd become readable and SIGKILLs every
   recorded worker, group member, snapshot descendant and tagged process; workers armed with
   ``PR_SET_PDEATHSIG`` die by themselves at the same moment.

Inside the supervisor's shutdown, one deadline (``shutdown_timeout``) bounds: the "close"
message (the workers have until ``CLOSE_MESSAGE_SHARE`` = 60 % of it to exit), SIGTERM to each
remaining worker's process group (until ``SIGTERM_SHARE`` = 80 %), SIGKILL (until
``SIGKILL_SHARE`` = 95 %), then, in what is left, a sweep of every recorded descendant, group
member and tagged process and reaping by pid. The workers are reaped before their descendants:
a worker's pipe closes a moment before the kernel hands its children over to this process (the
child subreaper), so the zombies among them are only ours, and collected, once the worker itself
has been reaped; what dies later still is collected by a background late reaper. Last, the
supervisor's watcher thread is stopped, waiting for it only in what is left. No wait runs past
the deadline but one: a worker that is not yet reaped when the deadline comes (SIGKILLed a
moment before, its exit still under way) is waited for up to ``KILLED_REAP_WAIT`` seconds more,
so that ``close()`` returns only once every worker it ended is reaped and its ``Process``
says so (``is_alive()`` False, ``exitcode`` set), as upstream's close does. So ``close()``
returns within ``shutdown_timeout`` plus the time of a few system calls, plus, where a worker
needed SIGKILL, the time its exit takes (at most ``KILLED_REAP_WAIT``).
``docs/design.md`` quotes these numbers; ``tests/test_docs.py`` checks every quote. Code and docs
cite this note by its name.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence

from . import _identity, _platform, _reaper_client
from ._record import WorkerRecord, worker_tree
from ._report import Outcome
from ._tag import Tag
from ._wait import on, wait_for

__all__ = ["CLOSE_MESSAGE_SHARE", "KILLED_REAP_WAIT", "SIGKILL_SHARE", "SIGTERM_SHARE", "close_workers"]

log = logging.getLogger("torchrl_ext")

#: NOTE [shutdown order]: share of ``shutdown_timeout`` the workers get to exit after the
#: "close" message; SIGTERM to their process groups follows.
CLOSE_MESSAGE_SHARE = 0.6
#: NOTE [shutdown order]: share of ``shutdown_timeout`` by which SIGTERMed workers must have
#: exited; SIGKILL follows, and the deadline itself ends the escalation.
SIGTERM_SHARE = 0.8
#: NOTE [shutdown order]: share of ``shutdown_timeout`` by which SIGKILLed workers must be gone;
#: the sweep and reaping use the rest, and nothing waits past the deadline.
SIGKILL_SHARE = 0.95
#: NOTE [shutdown order]: seconds a close waits, past its deadline, for workers not yet reaped
#: (a SIGKILLed process still exiting): the one wait of a close that the deadline does not bound.
KILLED_REAP_WAIT = 2.0


def close_workers(
    workers: Sequence[WorkerRecord], tag: Tag, label: str, reason: str, t0: float, timeout: float
) -> tuple[dict[int, Outcome], int]:
    """NOTE [shutdown order], from the close message to the reaping: how each worker ended
    (by index) and how many leftover processes the sweep killed. Returns by ``t0 + timeout``."""
    workers = list(workers)
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
    _wait_exit(workers, graceful_until)
    #: Each signal, the end of its wait, and the outcome of a worker gone before it is sent.
    escalation: tuple[tuple[int, float, Outcome], ...] = (
        (signal.SIGTERM, term_until, "graceful"),
        (signal.SIGKILL, kill_until, "terminated"),
    )
    for sig, until, before in escalation:
        # A worker gone before this signal is sent ended of what came before it, however late
        # in the previous wait it went: one look decides both its outcome and the signal.
        _settle(outcome, workers, before)
        pending = [w for w in workers if w.index not in outcome]
        if not pending:
            break
        for worker in pending:
            log.warning(
                "%s worker %d (pid %d) did not exit within %.1fs of %s (%s); sending %s to its process group",
                label,
                worker.index,
                worker.pid,
                time.monotonic() - t0,
                "the close message" if sig == signal.SIGTERM else "SIGTERM",
                reason,
                _platform.signal_name(sig),
            )
            worker.signal(sig)
        _wait_exit(pending, min(deadline, max(until, time.monotonic() + 0.05)))
    _settle(outcome, workers, "killed")
    # Sweep: everything recorded, every group member, every tagged process of this env.
    # A worker that had died before the close anchors its group only through a live process
    # of ours in it: its group id may have been recycled by a stranger since.
    leftovers = worker_tree(workers, [w for w in workers if outcome.get(w.index) != "died"], tag)
    grace = min(0.5, left() / 2)  # 0 once the deadline is near: SIGKILL at once
    # Whatever dies after the deadline (re-parented to us) is still collected, in the background.
    swept_t, swept_k = _identity.kill_and_reap(
        leftovers, grace, what=f"{label} leftover", kill_wait=left(), collect_late=True
    )
    swept = len(swept_t) + len(swept_k)
    if swept:
        log.warning("%s: swept %d leftover process(es) after the workers exited", label, swept)
    # Every worker is reaped before close() returns, the SIGKILLed ones still exiting too: past
    # the deadline, within KILLED_REAP_WAIT of its own.
    reap_until = (
        deadline if all(w.exited() for w in workers) else max(deadline, time.monotonic() + KILLED_REAP_WAIT)
    )
    for worker in workers:
        try:
            worker.process.join(timeout=max(0.0, reap_until - time.monotonic()))
        except (ValueError, AssertionError):
            pass
        worker.exitcode = worker.read_exitcode(wait=min(max(0.0, reap_until - time.monotonic()), 1.0))
        worker.finished = True
        _reaper_client.unwatch(worker.pid)
    # A worker that is reaped has handed its children over: those that died before it are
    # our zombies now (NOTE [shutdown order]); collect them before close() returns.
    _identity.reap_if_child(leftovers, wait=min(left(), _identity.ZOMBIE_WAIT))
    return outcome, swept


def _settle(outcome: dict[int, Outcome], workers: Sequence[WorkerRecord], name: Outcome) -> None:
    """Give ``name`` to every worker of ``workers`` that has no outcome yet and is gone now."""
    for worker in workers:
        if worker.index not in outcome and worker.gone():
            outcome[worker.index] = name


def _wait_exit(workers: list[WorkerRecord], until: float) -> None:
    pending = list(workers)
    sentinels: list[object] = []

    def all_gone() -> bool:
        pending[:] = [w for w in pending if not w.gone()]
        sentinels[:] = [w.sentinel for w in pending]
        return not pending

    # A sentinel wakes it: the slice only bounds the look for an exit no sentinel shows.
    wait_for(all_gone, until, "the workers did not exit", sleep=on(sentinels), first=0.1, slice=0.1)
