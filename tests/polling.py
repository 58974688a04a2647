"""The test suite's one polling helper: wait for a condition, and fail loudly at the deadline.

Every loop in ``tests/`` that waits for something to happen goes through :func:`wait_until`;
none gives up silently, and none sleeps a fixed time instead of waiting for a condition.
(``tests/harness.py`` runs as a standalone script and keeps its own reaping loops.) It imports
nothing heavy, so the scenarios run in child interpreters can use it too.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

__all__ = ["WaitTimeout", "wait_until"]

T = TypeVar("T")

#: Seconds between two evaluations of the predicate, at most (the first ones come sooner).
INTERVAL = 0.05


def _load_wait() -> ModuleType:
    """The package's ``_wait.py``, by path: importing the package would import torch."""
    path = Path(__file__).resolve().parent.parent / "torchrl_ext" / "_wait.py"
    spec = importlib.util.spec_from_file_location("torchrl_ext_polling_wait", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_wait = _load_wait()


class WaitTimeout(AssertionError):
    """A condition was not reached in time (an ``AssertionError``, so the test fails)."""


def wait_until(predicate: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Poll ``predicate`` until it returns a true value, and return that value.

    Raises :class:`WaitTimeout` naming ``what`` once ``timeout`` seconds have passed (the
    predicate gets one last evaluation at the deadline). An exception the predicate raises
    propagates at once: a predicate that can tell the condition will never hold (the process
    it waits for has died) should raise.
    """
    reason = f"{what}: not reached in {timeout:g} s"
    value = _wait.wait_for(predicate, time.monotonic() + timeout, reason, slice=INTERVAL)
    if isinstance(value, _wait.Late):
        raise WaitTimeout(value.reason)
    return value
