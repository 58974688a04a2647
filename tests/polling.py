"""The test suite's one polling helper: wait for a condition, and fail loudly at the deadline.

Every loop in ``tests/`` that waits for something to happen goes through :func:`wait_until`;
none gives up silently, and none sleeps a fixed time instead of waiting for a condition.
(``tests/harness.py`` runs as a standalone script and keeps its own reaping loops.) It imports
nothing heavy, so the scenarios run in child interpreters can use it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WaitTimeout", "wait_until"]

T = TypeVar("T")

#: Seconds between two evaluations of the predicate.
INTERVAL = 0.05


class WaitTimeout(AssertionError):
    """A condition was not reached in time (an ``AssertionError``, so the test fails)."""


def wait_until(predicate: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Poll ``predicate`` until it returns a true value, and return that value.

    Raises :class:`WaitTimeout` naming ``what`` once ``timeout`` seconds have passed (the
    predicate gets one last evaluation at the deadline). An exception the predicate raises
    propagates at once: a predicate that can tell the condition will never hold (the process
    it waits for has died) should raise.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = predicate()
            if value:
                return value
            raise WaitTimeout(f"{what}: not reached in {timeout:g} s")
        time.sleep(INTERVAL)
