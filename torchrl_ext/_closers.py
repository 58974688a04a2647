"""What a close of the whole process ends once its envs are closed: the package's process-wide
resources that are not envs (an ``EpisodeLedger``'s processes, which the envs' workers use).

``_lifecycle.close_all`` (the close a handled SIGTERM, SIGINT or SIGHUP drives, and the exit
hook) runs :func:`close_all` after the envs, so that a signal-driven close ends these processes
as its own, like the envs' workers, and the reaper finds nothing left to report. A resource
adds its close when it starts and needs no removal: a close is held weakly, and one already
run (a ``finalize`` object) does nothing when called again.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["add", "close_all"]

log = logging.getLogger("torchrl_ext")

_lock = threading.Lock()
#: Registration number -> the close, held weakly (its owner keeps it); add writes, close_all
#: empties, a fork's child clears (the parent's resources are not the child's to close).
_closes: dict[int, weakref.ref[Callable[[], object]]] = {}
_numbers = itertools.count()


def add(close: Callable[[], object]) -> None:
    """Run ``close()`` at the next :func:`close_all`, unless ``close`` is collected before.
    ``close`` must be idempotent (a ``finalize`` object is) and is held weakly: keep it.

    Example:
        >>> class Close:
        ...     def __call__(self):
        ...         print("closed")
        >>> close = Close()
        >>> add(close)
        >>> close_all("example")
        closed
    """
    with _lock:
        _closes[next(_numbers)] = weakref.ref(close)


def close_all(reason: str) -> None:
    """Run every close added and not collected, newest first; never raises (logs instead)."""
    with _lock:
        refs = list(reversed(_closes.values()))
        _closes.clear()
    for ref in refs:
        close = ref()
        if close is None:
            continue
        try:
            close()
        except Exception:
            log.exception("closing %r on %s failed", close, reason)


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    _closes.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
