"""The worker processes TorchRL builds, recorded unstarted, and fresh copies of them.

TorchRL builds its worker processes in several ways across releases; a copy of what it built is
the one way to build the same again. :func:`recording_starts` keeps a copy of every process the
calling thread starts (before ``start()`` drops its target and kwargs), and
:func:`copy_unstarted` makes a new, unstarted process like one of them with new kwargs.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import multiprocessing.process
import threading
from collections.abc import Iterator
from typing import Any

from . import _cpython
from ._patch import ScopedPatch

__all__ = ["copy_unstarted", "recording_starts"]


_recording = threading.local()


def _recording_start(previous: Any) -> Any:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        recorded = getattr(_recording, "into", None)
        if recorded is not None:
            recorded.append(copy.copy(self))  # before start(), which drops target and kwargs
        previous(self)

    start.__wrapped__ = previous  # type: ignore[attr-defined]
    return start


_START_PATCH = ScopedPatch(multiprocessing.process.BaseProcess, "start", _recording_start)


@contextlib.contextmanager
def recording_starts() -> Iterator[list[Any]]:
    """While active, every process this thread starts is recorded, unstarted, in the list
    yielded (TorchRL builds its worker processes in several ways across releases; a copy of
    what it built is the one way to build the same again)."""
    into: list[Any] = []
    _recording.into = into
    try:
        with _START_PATCH.active():
            yield into
    finally:
        _recording.into = None


_counter = itertools.count(1)


def copy_unstarted(template: Any, kwargs: dict[str, Any]) -> Any:
    """A new, unstarted process like ``template`` (recorded by :func:`recording_starts`) with
    ``kwargs`` as its target's keyword arguments."""
    name = str(template.name)
    base = name.rsplit("-", 1)[0] if "-" in name else name
    return _cpython.copy_unstarted_process(template, kwargs, f"{base}-restart{next(_counter)}")
