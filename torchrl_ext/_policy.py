"""What the slot keeper decides by: the record of a restart, the budget, the backoff, which
env errors restart a slot, a replacement's seed, and the memory sizes ``recycle_memory`` takes.

Pure bookkeeping (no process is touched here); :mod:`._keeper` and :mod:`._recycle` act on it.
"""

from __future__ import annotations

import collections
import hashlib
import re
from dataclasses import dataclass
from typing import Literal

from ._errors import OomKill, WorkerDiedError, format_exitcode

__all__ = [
    "DEFAULT_RESTART_BACKOFF",
    "STABLE_AFTER",
    "Backoff",
    "RecycleCause",
    "RestartBudget",
    "RestartRecord",
    "parse_bytes",
    "replacement_seed",
    "restarts_on_error",
]

#: A replacement is recycled for one of these (``recycle_memory``, ``recycle_every``).
RecycleCause = Literal["memory", "episodes"]

#: ``restart_backoff``'s default: the second restart in a row of one slot waits 0.1 s, each
#: further one twice as long, at most 10 s.
DEFAULT_RESTART_BACKOFF: tuple[float, float] = (0.1, 10.0)
#: A slot whose worker ran this long (seconds) before it was lost starts a new row: its next
#: restart is immediate again.
STABLE_AFTER = 60.0


@dataclass(frozen=True)
class RestartRecord:
    """One restart of a worker slot (``env.restarts`` lists them, oldest first).

    ``cause`` is the dead worker's exit code (``-9`` for SIGKILL), ``"hung"`` (no answer within
    ``step_timeout``), ``"start_timeout"`` (its env was not built within ``start_timeout``), the
    name of the exception its env raised (``restart_on_error``, or a call forwarded to the env,
    ``env.some_method()``, that failed there), or, for a worker recycled at an episode boundary
    (nothing lost), ``"memory"`` (``recycle_memory``) or ``"episodes"`` (``recycle_every``).

    Example:
        >>> r = RestartRecord(slot=1, old_pid=41, new_pid=42, cause=-9, command="step",
        ...                   time=0.0, ready_after=0.05)
        >>> print(r)
        slot 1: pid 41 -> 42 after SIGKILL(-9) during 'step'; ready in 0.050s
    """

    slot: int
    old_pid: int | None
    new_pid: int
    cause: int | str | None
    command: str | None
    #: Wall-clock time (``time.time()``) the loss was noticed (a recycle: decided).
    time: float
    #: Seconds from the loss being noticed to the new worker having built its env (the backoff
    #: included); a recycled worker was started ahead: the seconds its reset took.
    ready_after: float
    #: A hung worker's stacks, every thread, when it was killed (see ``WorkerHungError.stacks``).
    stacks: str | None = None
    #: Set when the kernel's OOM killer killed the old worker (see ``WorkerDiedError.oom``).
    oom: OomKill | None = None
    #: Seconds waited before the replacement was started (``restart_backoff``).
    backoff: float = 0.0
    #: The seed the replacement was given before its first reset (``None``: the env was never
    #: seeded; see :func:`replacement_seed`).
    seed: int | None = None

    @property
    def recycled(self) -> bool:
        """Whether the old worker was recycled (closed at an episode boundary), not lost."""
        return self.cause in ("memory", "episodes")

    def __str__(self) -> str:
        cause = self.cause if isinstance(self.cause, str) else format_exitcode(self.cause)
        if self.recycled:
            return (
                f"slot {self.slot}: pid {self.old_pid} -> {self.new_pid}, recycled ({cause}) at "
                f"{self.command or 'no command'!r}; reset in {self.ready_after:.3f}s"
            )
        return (
            f"slot {self.slot}: pid {self.old_pid} -> {self.new_pid} after {cause} during "
            f"{self.command or 'no command'!r}; ready in {self.ready_after:.3f}s"
        )


class RestartBudget:
    """At most ``max_restarts`` losses within any ``window`` seconds (``None``: the env's life)."""

    def __init__(self, max_restarts: int, window: float | None) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._times: collections.deque[float] = collections.deque()

    def allows(self, now: float) -> bool:
        """Whether one more loss at ``now`` (monotonic) may be restarted; records it if so."""
        if self.window is not None:
            while self._times and now - self._times[0] > self.window:
                self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        window = "the env's life" if self.window is None else f"{self.window:g}s"
        return f"max_restarts={self.max_restarts} within {window}"


class Backoff:
    """Per slot, how long its next replacement waits (``restart_backoff=(first, cap)``).

    A slot's restarts form a row while each lost worker ran less than :data:`STABLE_AFTER`
    seconds: the first restart of a row is immediate, the second waits ``first``, each further
    one twice the previous, at most ``cap``. Recycling is not a restart here.

    Example:
        >>> b = Backoff((0.1, 0.3))
        >>> [b.delay(0, lived=1.0) for _ in range(4)]
        [0.0, 0.1, 0.2, 0.3]
        >>> b.delay(0, lived=120.0)
        0.0
    """

    def __init__(self, setting: tuple[float, float] | None) -> None:
        self.first, self.cap = setting if setting is not None else (0.0, 0.0)
        self._row: dict[int, int] = {}

    def delay(self, slot: int, lived: float) -> float:
        """Seconds slot ``slot``'s replacement waits; its worker ran ``lived`` seconds."""
        row = 0 if lived >= STABLE_AFTER else self._row.get(slot, 0)
        self._row[slot] = row + 1
        if row == 0 or self.cap <= 0:
            return 0.0
        return float(min(self.cap, self.first * 2 ** (row - 1)))


def restarts_on_error(setting: bool | tuple[type[BaseException], ...], failure: BaseException | None) -> bool:
    """Whether ``restart_on_error`` restarts a slot whose env raised ``failure``."""
    if isinstance(failure, WorkerDiedError):
        return True  # not an env error
    if isinstance(setting, bool):
        return setting
    return failure is not None and isinstance(failure, setting)


def replacement_seed(seed: int, slot: int, incarnation: int) -> int:
    """The seed of slot ``slot``'s ``incarnation``-th replacement (1 for the first), from the
    seed that slot was given by ``set_seed``: the same for the same three, whatever the run,
    and unrelated to every other slot's and incarnation's (a hash, not a sum).

    Example:
        >>> replacement_seed(7, 1, 1) == replacement_seed(7, 1, 1) != replacement_seed(7, 1, 2)
        True
    """
    digest = hashlib.blake2b(f"torchrl_ext:{seed}:{slot}:{incarnation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative, fits a signed 64-bit seed


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_bytes(value: int | str, name: str) -> int:
    """A size in bytes: an int, or a string such as ``"4GiB"``, ``"512 MiB"`` or ``"2GB"``.

    Example:
        >>> parse_bytes("4GiB", "recycle_memory"), parse_bytes(1024, "recycle_memory")
        (4294967296, 1024)
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be a number of bytes or a string such as '4GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; write bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as '4GiB'"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size
