"""The parent's end of a worker's command pipe, as the supervisor hands it to TorchRL.

It remembers the last command sent (every error names it), and turns a read that finds the
worker gone into the worker's own failure. With restarts on, a send to a lost worker does not
raise, the last message is kept for a replay, answers still owed are counted and can be
drained, and the slot keeper may handle a command itself instead of sending it (``hook``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._compat import COMMANDS, NO_PIPE_ANSWER
from ._hosts import HOST_STEP_WIRE, StepRole
from ._step_path import STEP_AND_MAYBE_RESET, STEP_WIRE
from ._wait import wait_for

__all__ = ["ParentChannel", "RestartableChannel", "command_name", "is_forwarded_call"]


class ParentChannel:
    """The parent's end of a worker pipe, remembering the last command sent.

    A read that finds the worker gone raises the worker's failure (``on_eof``, set by the
    supervisor) instead of a bare ``EOFError``: the exception its env raised, or
    :class:`WorkerDiedError`. That is how a call forwarded to the workers' envs
    (``env.some_method()``) that fails there raises the env's error itself: TorchRL's worker
    loop cannot survive it, and the pipe's EOF is all the caller would see.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.last_command: str | None = None
        self.on_eof: Callable[[], BaseException | None] | None = None
        #: How this slot's batched steps of our path are written (``_hosts.StepRole``); set by
        #: the supervisor at attach, cleared when the slot's host is broken up.
        self.step_role: StepRole = None
        # Bound once: polled after every step (no __getattr__ on the hot path).
        self.poll = conn.poll

    def send(self, obj: Any) -> None:
        self.last_command = command_name(obj) or self.last_command
        _send(self._conn, obj, self.step_role)

    def recv(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            failure = self.on_eof() if self.on_eof is not None else None
            if failure is not None:
                raise failure from None
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _send(conn: Any, obj: Any, role: StepRole = None) -> None:
    """``conn.send(obj)``; the step path's message, once per worker per step, is written as
    ``conn.send`` would write it but in one system call of bytes framed once
    (:data:`_step_path.STEP_WIRE`), or as its host's (``role``, ``_hosts``): the host's step
    on its first slot's pipe, nothing on the others'. ``fileno()`` is asked each time: it raises
    on a closed connection, whose descriptor number may belong to another file by then."""
    if obj is STEP_AND_MAYBE_RESET:
        if role is None:
            os.write(conn.fileno(), STEP_WIRE)
        elif role == "host":
            os.write(conn.fileno(), HOST_STEP_WIRE)
    else:
        conn.send(obj)


def command_name(message: Any) -> str | None:
    """The name every record and error gives the command of ``message``, a worker pipe's
    ``(command, data)``, on both ends: the command, or the ``repr`` of a chained attribute's path
    (``env.a.b()`` sends ``("a", "b")``); ``None`` for a message that carries no command."""
    if not isinstance(message, tuple) or not message or message[0] is None:
        return None
    command = message[0]
    return command if isinstance(command, str) else repr(command)


def is_forwarded_call(command: str | None) -> bool:
    """Whether ``command`` (a channel's last) was a call forwarded to the worker's env."""
    return command is not None and command not in COMMANDS


class RestartableChannel(ParentChannel):
    """A worker pipe of an env with restarts on.

    A send to a lost worker does not raise (the loss is handled where the env waits for the
    answer); the last message is kept (a reset in flight is replayed on the replacement);
    answers still owed on the pipe are counted, so that they can be drained before the next
    call (no later call may read an earlier call's answer); a read that finds the worker gone
    raises the worker's loss (``on_eof``); ``hook`` (the slot's policies: a replacement that
    owes its slot a marked transition, recycling) may handle a command instead of sending it.
    """

    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        self.last_message: Any = None
        #: The slot's send hook, set by the slot keeper while its policies may handle a
        #: command (recycling on, or a mark owed); cleared by it, or when the channel is
        #: replaced. Returns ``None`` (send as is) or ``(channel, message)``: ``message`` to send
        #: instead (``None``: nothing is sent) on ``channel`` (``None``: this one).
        self.hook: Callable[[Any], tuple[Any, Any] | None] | None = None
        self.owed = 0

    def send(self, obj: Any) -> None:
        command = obj[0] if isinstance(obj, tuple) and obj else None
        if command is not None:
            if self.hook is not None:
                routed = self.hook(obj)
                if routed is not None:
                    target, obj = routed
                    if obj is None:  # handled: nothing is sent
                        return
                    if target is not None:
                        target.send(obj)
                        return
                    command = obj[0]
            self.last_command = command_name(obj)
            self.last_message = obj
        try:
            _send(self._conn, obj, self.step_role)
        except (OSError, EOFError):
            return
        if command is not None and not (isinstance(command, str) and command in NO_PIPE_ANSWER):
            self.owed += 1

    def recv(self) -> Any:
        message = super().recv()
        if self.owed:
            self.owed -= 1
        return message

    def drain(self, until: float) -> None:
        """Read and drop the answers still owed, waiting until ``until`` (monotonic) at most."""

        def drained() -> bool:  # reads what has arrived; a closed pipe owes nothing more
            while self.owed and self._conn.poll():
                try:
                    self._conn.recv()
                except (EOFError, OSError):
                    self.owed = 0
                else:
                    self.owed -= 1
            return not self.owed

        wait_for(drained, until, "the answers owed did not arrive", sleep=self._conn.poll)
