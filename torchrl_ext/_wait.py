"""The one bounded wait: look until something is ready, or give up at a deadline, by name.

Standard library only, and no imports from the package: the standalone reaper script and the
test suite's ``tests/polling.py`` load this file by path (see ``_reaper.py``); the package
imports it as ``torchrl_ext._wait``.

:func:`wait_for` looks (calls ``ready``) and returns the first true value it gets. Between two
looks it pauses: :data:`FIRST` seconds at first, each next pause twice the last, up to
:data:`SLICE` (a short wait costs little latency, a long one few looks). It never pauses past
the deadline, and gives ``ready`` one last look at the deadline; then it returns :class:`Late`,
a false value that names the limit it reached. The pause is ``sleep``: ``time.sleep``, or a wait
that ends early when what it waits for happens (``Event.wait``, ``conn.poll``, :func:`on`).

>>> answers = iter([None, None, "ready"])
>>> wait_for(lambda: next(answers), time.monotonic() + 5, "no answer within 5 s")
'ready'
>>> late = wait_for(lambda: None, time.monotonic() + 0.01, "no answer within 0.01 s")
>>> late.reason, bool(late)
('no answer within 0.01 s', False)
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = ["FIRST", "SLICE", "Late", "on", "wait_for"]

T = TypeVar("T")

#: Seconds of the longest pause between two looks.
SLICE = 0.02
#: Seconds of the first pause; each next one doubles, up to the slice.
FIRST = 1e-4


@dataclass(frozen=True)
class Late:
    """What a wait that reached its deadline returns: false, with the limit it reached."""

    #: The limit, named as a message would name it ("... did not exit within 2 s").
    reason: str
    #: Seconds the wait lasted.
    waited: float

    def __bool__(self) -> Literal[False]:
        return False


def wait_for(
    ready: Callable[[], T],
    deadline: float,
    reason: str,
    *,
    sleep: Callable[[float], object] = time.sleep,
    first: float = FIRST,
    slice: float = SLICE,
    clock: Callable[[], float] = time.monotonic,
) -> T | Late:
    """The first true value ``ready()`` returns, or :class:`Late` (``reason``) once ``deadline``
    (``clock``'s, ``time.monotonic()``; ``math.inf``: no limit) has passed and one last look at
    or after it found nothing. ``sleep(seconds)`` pauses between two looks and may return early.
    An exception ``ready`` raises propagates at once."""
    start = clock()
    pause = min(first, slice)
    while True:
        now = clock()  # read before the look: a look that starts at the deadline is the last
        value = ready()
        if value:
            return value
        if now >= deadline:
            return Late(reason, clock() - start)
        left = deadline - clock()
        if left > 0:
            sleep(min(pause, left))
            pause = min(2 * pause, slice)


def on(waitables: Iterable[Any]) -> Callable[[float], object]:
    """A ``sleep`` for :func:`wait_for` that ends early once one of ``waitables`` (fds,
    sentinels, connections) is ready; read at each pause, so a list the ``ready`` check updates
    in place is followed."""

    def sleep(seconds: float) -> object:
        return multiprocessing.connection.wait(list(waitables), seconds)

    return sleep
