"""What closing a managed env took: the public report (``env.supervision_report``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._errors import format_exitcode

__all__ = ["Outcome", "SupervisionReport", "WorkerOutcome"]

#: How a worker ended; see :class:`WorkerOutcome`.
Outcome = Literal["graceful", "terminated", "killed", "died"]


@dataclass(frozen=True)
class WorkerOutcome:
    """How one worker ended.

    ``outcome`` is ``"graceful"`` (exited after the close message), ``"terminated"`` (needed
    SIGTERM), ``"killed"`` (needed SIGKILL) or ``"died"`` (was already dead: see ``exitcode``).
    """

    index: int
    pid: int | None
    outcome: Outcome
    exitcode: int | None
    descendants_killed: int = 0


@dataclass(frozen=True)
class SupervisionReport:
    """What closing an env took. ``env.supervision_report`` holds the last one.

    Example:
        >>> report = SupervisionReport(reason="close", duration=0.2, workers=(), leftovers_killed=0)
        >>> report.clean
        True
    """

    reason: str
    duration: float
    workers: tuple[WorkerOutcome, ...]
    leftovers_killed: int = 0
    #: Workers replaced during the env's life (see ``env.restarts``).
    restarts: int = 0

    @property
    def clean(self) -> bool:
        """Every worker closed gracefully and nothing had to be swept."""
        return self.leftovers_killed == 0 and all(w.outcome == "graceful" for w in self.workers)

    def __str__(self) -> str:
        lines = [
            f"shutdown ({self.reason}) took {self.duration:.2f}s; leftovers killed: {self.leftovers_killed}"
            + (f"; workers restarted: {self.restarts}" if self.restarts else "")
        ]
        for w in self.workers:
            extra = f", {w.descendants_killed} descendant(s) killed" if w.descendants_killed else ""
            lines.append(
                f"  worker {w.index} (pid {w.pid}): {w.outcome}, "
                f"exit code {format_exitcode(w.exitcode)}{extra}"
            )
        return "\n".join(lines)
