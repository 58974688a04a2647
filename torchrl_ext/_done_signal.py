"""Blocking wait for TorchRL's shared-memory "done" flags.

TorchRL >= 0.11 workers report a finished step or reset by writing 1 into a shared byte
array, and ``ParallelEnv._wait_for_workers`` spin-polls that array: the main process keeps
one core busy whenever a step is in flight. On a machine with fewer spare cores than busy
processes (env workers, their DataLoader workers, the main process), that spinning takes
CPU from the very processes it waits for.

A managed env hands each worker :class:`NotifyingFlags`, which sets the same flag and then,
if the main process says it is asleep (a byte in a small shared file), writes one byte into a
FIFO; the main process sleeps on the FIFO (:meth:`DoneSignal.wait_for`).
Waking a sleeping process costs tens of microseconds, which matters only when the workers
answer within a few hundred: the main process therefore spins first, up to ``spin`` seconds,
as long as spinning pays (most recent spins saw the result arrive), and otherwise only once
every ``_PROBE_EVERY`` waits (:class:`SpinRate`). Where a core is left over, long steps are
slept through until shortly before they usually end (a moving average of the waits) and spun
over the end. The supervisor writes into the same FIFO when a worker dies, so a sleeping main
process wakes to raise the error.

Every spin yields its core every few passes (``sched_yield``): with more busy processes than
cores (two workers and the main process on two cores), a spinning process would otherwise
hold a core the very worker it waits for is queued for, until the scheduler's next tick.
Where nobody waits for the core, the yield returns at once. The workers of the managed step
path spin the same way for their next command (``_step_path.WorkerPlan.await_command``),
under the same rate rule.

Ordering: the main process marks itself asleep, drains the FIFO, re-reads the flags, then
sleeps; a worker sets its flag, then reads the mark, then writes. A flag that the re-read
misses was set after the drain, so its byte is in the FIFO and the sleep returns at once,
unless the worker read the mark before the main process's store reached it (the two stores
and loads are not fenced). That window is a few instructions wide, and the first sleep of a
wait lasts at most ``_FIRST_SLEEP``, so a missed wake-up costs at most that.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ._wait import wait_for

__all__ = [
    "DEFAULT_SPIN",
    "Answers",
    "DoneSignal",
    "NotifyingFlags",
    "Outcome",
    "SpinRate",
    "has_spare_core",
    "timeout_error",
]

#: How a wait for answers ended: all answered; stopped by its check (a loss); past its limit.
Outcome = Literal["answered", "stopped", "late"]

#: Longest sleep between checks of the deadline and of worker health.
_SLICE = 0.5
_CLOSED_WHILE_WAITING = (
    "the env was closed (by a signal handler?) while its main thread waited for the workers' results"
)
#: First sleep of a wait; later ones double up to ``_SLICE`` (see the module docstring).
_FIRST_SLEEP = 2e-3
#: Default longest spin: a little more than a trivial env's round trip.
DEFAULT_SPIN = 2.5e-4
#: Weight of the newest sample in the moving averages.
_ALPHA = 0.1
#: While spinning does not pay, spin anyway once every this many waits, to notice a change.
_PROBE_EVERY = 32
#: Hit rate above which a spin that missed goes on, up to ``_LATE_FACTOR`` times ``spin``.
_STEADY = 0.8
_LATE_FACTOR = 3.0
#: How late a timed sleep may end (Linux's default timer slack).
_TIMER_SLACK = 5e-5
#: A spin on the flags yields its core once every this many passes (a power of two).
_YIELD_EVERY = 8


def timeout_error(timeout: float) -> RuntimeError:
    """The error TorchRL's own wait raises after ``timeout`` seconds (same text)."""
    return RuntimeError(
        f"Failed to run all workers within the {timeout} sec time limit. This "
        "threshold can be increased via the BATCHED_PIPE_TIMEOUT env variable."
    )


def has_spare_core(num_workers: int) -> bool:
    """Whether a core is left for the main process besides one per worker and one for the
    processes the workers start (loaders): only then may it spin through long steps."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus > num_workers + 1


class SpinRate:
    """Whether spinning pays for one kind of wait: a moving average of how often a spin saw
    what it waited for arrive within its limit.

    Spin while most recent spins did (a hit rate of at least one half), and otherwise once
    every ``_PROBE_EVERY`` waits, to notice when it pays again.

    Example:
        >>> rate = SpinRate()
        >>> for _ in range(40):
        ...     rate.record(False)
        >>> rate.worth_trying(), rate.steady()
        (False, False)
    """

    __slots__ = ("_waits_since_spin", "hits")

    def __init__(self) -> None:
        #: Moving average of spins that saw their answer (1: always); written by :meth:`record`.
        self.hits = 1.0
        #: Waits that did not spin since the last spin; written by :meth:`worth_trying`.
        self._waits_since_spin = 0

    def worth_trying(self) -> bool:
        """Whether this wait spins first (counted: call it once per wait)."""
        if self.hits >= 0.5 or self._waits_since_spin >= _PROBE_EVERY:
            self._waits_since_spin = 0
            return True
        self._waits_since_spin += 1
        return False

    def steady(self) -> bool:
        """Whether nearly every recent spin was a hit (a miss is then a scheduling hiccup)."""
        return self.hits >= _STEADY

    def record(self, hit: bool) -> None:
        """Count one spin: ``hit`` if what it waited for came within its limit."""
        self.hits += _ALPHA * (float(hit) - self.hits)


class DoneSignal:
    """The main process's end of the wake-up FIFO of one env start."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: Set by the env once it knows its number of workers (see :func:`has_spare_core`).
        self.spare_core = False
        os.mkfifo(path, 0o600)
        # Read-write, so that writers never see "no reader" and the FIFO never reports EOF.
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._asleep = _shared_byte(path + ".asleep", create=True)
        #: Moving average of recent waits, in seconds; written by :meth:`_record`.
        self.typical_wait = 0.0
        #: Whether spinning pays for these waits; written by :meth:`wait_for`.
        self.spin_rate = SpinRate()

    def notify(self) -> None:
        """Wake a sleeping :meth:`wait_for` (used by the supervisor on a worker death)."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.write(fd, b"!")
        except OSError:  # full: a wake-up is pending anyway
            pass

    def _drain(self, fd: int) -> None:
        try:
            while len(os.read(fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def wait_for(
        self,
        flags: Any,
        indices: Sequence[int],
        timeout: float,
        spin: float,
        check: Callable[[], object],
        late: Literal["raise", "return"] = "raise",
    ) -> Outcome:
        """Wait until ``flags[i]`` is set for every ``i`` in ``indices``, clear them, and return
        ``"answered"``.

        ``check`` runs before each sleep: it may raise (a dead worker's error), and a true
        result ends the wait (``"stopped"``; the flags are left as they are). Once ``timeout``
        seconds have passed, a ``RuntimeError`` like TorchRL's own loop's is raised, or with
        ``late="return"``, ``"late"`` is returned.
        """
        start = time.perf_counter()
        expected = self.typical_wait
        if spin > 0:
            if expected > spin and self.spare_core:
                # A long step and a core to spare: sleep through most of it, wake a little
                # before it usually ends (timer slack included), and spin over the end.
                fd = self._fd
                if fd is not None:
                    self._drain(fd)  # bytes of earlier steps
                    try:
                        select.select([fd], [], [], max(0.0, expected - spin / 2 - _TIMER_SLACK))
                    except OSError:  # closed meanwhile: reported by _sleep_until_done
                        pass
                if self._spin(flags, indices, time.perf_counter() + spin):
                    self._record(start)
                    return "answered"
            elif self.spin_rate.worth_trying():
                hit = self._spin(flags, indices, start + spin)
                # Where nearly every result comes within ``spin``, a late one is a scheduling
                # hiccup: spin a little longer rather than pay a wake-up (still a miss).
                overran = (
                    not hit
                    and self.spin_rate.steady()
                    and self._spin(flags, indices, start + _LATE_FACTOR * spin)
                )
                self.spin_rate.record(hit)
                if hit or overran:
                    self._record(start)
                    return "answered"
        outcome = self._sleep_until_done(flags, indices, timeout, check, late)
        if outcome == "answered":
            self._record(start)
        return outcome

    @staticmethod
    def _spin(flags: Any, indices: Sequence[int], until: float) -> bool:
        # The clock is read, and the core offered to whoever waits for it, every few passes.
        passes = 0
        while True:
            for i in indices:
                if not flags[i]:
                    break
            else:
                for i in indices:
                    flags[i] = 0
                return True
            passes += 1
            if not passes & (_YIELD_EVERY - 1):
                os.sched_yield()
                if time.perf_counter() >= until:
                    return False

    def _record(self, start: float) -> None:
        # Clipped, so that one slow reset does not turn the next fast steps into sleeps.
        sample = min(time.perf_counter() - start, 2.0 * self.typical_wait + 1e-3)
        self.typical_wait += _ALPHA * (sample - self.typical_wait)

    def _sleep_until_done(
        self,
        flags: Any,
        indices: Sequence[int],
        timeout: float,
        check: Callable[[], object],
        late: Literal["raise", "return"],
    ) -> Outcome:
        def look() -> Outcome | None:
            # Re-read each time: a signal handler running in this thread may close the env
            # (and this signal) while we sleep.
            fd = self._fd
            if fd is None:
                raise RuntimeError(_CLOSED_WHILE_WAITING)
            self._drain(fd)
            if all(flags[i] for i in indices):
                for i in indices:
                    flags[i] = 0
                return "answered"
            return "stopped" if check() else None

        def pause(seconds: float) -> None:
            fd = self._fd
            if fd is None:
                return  # the next look reports it
            try:
                select.select([fd], [], [], seconds)
            except OSError:
                if self._fd is None:
                    raise RuntimeError(_CLOSED_WHILE_WAITING) from None
                raise

        asleep = self._asleep
        if self._fd is not None:
            asleep[0] = 1
        try:
            reason = f"no answer within {timeout:g} s"
            outcome = wait_for(
                look, time.monotonic() + timeout, reason, sleep=pause, first=_FIRST_SLEEP, slice=_SLICE
            )
        finally:
            if not asleep.closed:
                asleep[0] = 0
        if outcome:
            return outcome
        if late == "return":
            return "late"
        raise timeout_error(timeout)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
            self._asleep.close()
        for path in (self.path, self.path + ".asleep"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _shared_byte(path: str, create: bool) -> mmap.mmap:
    """A one-byte flag shared by every process that maps ``path``."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, mmap.PAGESIZE)
        return mmap.mmap(fd, mmap.PAGESIZE)
    finally:
        os.close(fd)


class NotifyingFlags:
    """Worker side: TorchRL's shared flag array, plus a wake-up byte for the main process."""

    __slots__ = ("_asleep", "_fd", "_flags")

    def __init__(self, flags: Any, path: str) -> None:
        self._flags = flags
        self._fd: int | None
        self._asleep: Any
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            self._asleep = _shared_byte(path + ".asleep", create=False)
        except OSError:  # the main process is gone: nobody to wake
            self._fd = None
            self._asleep = b"\0"

    def __setitem__(self, index: int, value: int) -> None:
        self._flags[index] = value
        if value and self._asleep[0] and self._fd is not None:
            try:
                os.write(self._fd, b"d")
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self._fd = None

    def __getitem__(self, index: int) -> Any:
        return self._flags[index]

    def __len__(self) -> int:
        return len(self._flags)


class Answers:
    """ "Has slot i answered?": TorchRL >= 0.11's shared done flags, or 0.10's per-worker events.

    The one view every wait of a managed env reads (the done signal's, the slot keeper's,
    the hang check's). ``flags`` is the shared array (``None`` on TorchRL 0.10).

    Example:
        >>> answers = Answers([0, 0], None)
        >>> answers.set(1); answers.answered(1), answers.take(1), answers.answered(1)
        (True, True, False)
    """

    __slots__ = ("events", "flags")

    def __init__(self, flags: Any, events: Sequence[Any] | None) -> None:
        self.flags = flags
        self.events = events

    def answered(self, slot: int) -> bool:
        """Whether ``slot`` has answered (left as it is)."""
        if self.flags is not None:
            return bool(self.flags[slot])
        return self.events is not None and bool(self.events[slot].is_set())

    def take(self, slot: int) -> bool:
        """Whether ``slot`` has answered; if so, the answer is consumed (cleared)."""
        if not self.answered(slot):
            return False
        self.clear(slot)
        return True

    def set(self, slot: int) -> None:
        """Answer for ``slot`` (a restart's marked transition)."""
        if self.flags is not None:
            self.flags[slot] = 1
        elif self.events is not None:
            self.events[slot].set()

    def clear(self, slot: int) -> None:
        """Forget an answer (a lost worker may have answered before it died)."""
        if self.flags is not None:
            self.flags[slot] = 0
        elif self.events is not None:
            self.events[slot].clear()

    def wait_events(
        self,
        slots: Sequence[int],
        deadline: float,
        timeout: float,
        check: Callable[[], object],
        late: Literal["raise", "return"] = "raise",
    ) -> Outcome:
        """TorchRL < 0.11: wait until every slot's event is set, clear them, and return
        ``"answered"``. ``check`` runs between sleeps, as for :meth:`DoneSignal.wait_for`; past
        ``deadline`` (monotonic), TorchRL's own timeout error (``timeout`` seconds) is raised,
        or with ``late="return"``, ``"late"`` is returned."""
        assert self.events is not None
        events = self.events
        waiting = list(slots)  # the slots not answered yet, as of the last look

        def look() -> Outcome | None:
            waiting[:] = [slot for slot in slots if not events[slot].is_set()]
            if not waiting:
                for slot in slots:
                    events[slot].clear()
                return "answered"
            return "stopped" if check() else None

        def pause(seconds: float) -> None:
            events[waiting[0]].wait(seconds)

        outcome = wait_for(look, deadline, f"no answer within {timeout:g} s", sleep=pause)
        if outcome:
            return outcome
        if late == "return":
            return "late"
        raise timeout_error(timeout)
