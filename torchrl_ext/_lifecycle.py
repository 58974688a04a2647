"""Process-wide lifecycle: the registry of open managed envs, the atexit hook, signal handlers.

The order in which a program's end closes the envs, and the escalation inside each close, is
NOTE [shutdown order] in ``_shutdown``.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.util  # its atexit hook must be registered before ours
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from . import _closers, _forkserver, _platform, _reaper_client
from ._wait import wait_for

__all__ = ["close_all", "live_envs", "multiprocessing_parent", "register", "unregister"]

log = logging.getLogger("torchrl_ext")

HANDLED_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)


class _Closable(Protocol):
    def _close_for(self, reason: str) -> None: ...


#: Seconds between the SIGTERM sent on parent death and the SIGKILL that follows if ignored.
PARENT_EXIT_GRACE = 30.0

_lock = threading.RLock()
_live: dict[int, tuple[weakref.ref[Any], bool, bool]] = {}
_exit_with_parent: set[int] = set()
_parent_watch: threading.Thread | None = None
_subreaper_ours = False
_atexit_installed = False
_previous_handlers: dict[int, Any] = {}
_in_handler = False


def register(
    env: _Closable, handle_signals: bool, reap_orphans: bool = False, exit_with_parent: bool = False
) -> None:
    """Track an env that just started its workers."""
    global _subreaper_ours
    with _lock:
        _live[id(env)] = (weakref.ref(env), handle_signals, reap_orphans)
        if exit_with_parent:
            _exit_with_parent.add(id(env))
            _start_parent_watch()
        install_exit_hook()
        if handle_signals:
            _install_signal_handlers()
        if reap_orphans and not _subreaper_ours and not _platform.is_child_subreaper():
            # Orphans of a worker that died come to us (and are reaped by the supervisor)
            # instead of to PID 1, which in many containers never reaps them.
            _subreaper_ours = _platform.set_child_subreaper(True)


def install_exit_hook() -> None:
    """Register the exit hook (once): close every open env, then stop the fork server."""
    global _atexit_installed
    with _lock:
        if not _atexit_installed:
            atexit.register(_at_exit)
            _atexit_installed = True


def unregister(env: _Closable) -> None:
    """Forget an env that closed; the last one restores the handlers and the subreaper flag."""
    global _subreaper_ours
    with _lock:
        _live.pop(id(env), None)
        _exit_with_parent.discard(id(env))
        if not any(handles for _ref, handles, _reap in _live.values()):
            _restore_signal_handlers()
        if _subreaper_ours and not any(reap for _ref, _handles, reap in _live.values()):
            # While set, orphans of unrelated grandchildren come to us too; keep that window
            # to the time managed envs are open.
            _platform.set_child_subreaper(False)
            _subreaper_ours = False


def live_envs() -> list[_Closable]:
    """Open envs, most recently started last."""
    with _lock:
        envs = [entry[0]() for entry in _live.values()]
    return [env for env in envs if env is not None]


def close_all(reason: str) -> None:
    """Close every open managed env, newest first, then what they used (``_closers``: an
    ``EpisodeLedger``'s processes). Never raises (logs instead)."""
    for env in reversed(live_envs()):
        try:
            env._close_for(reason)
        except Exception:
            log.exception("closing %r on %s failed", env, reason)
    _closers.close_all(reason)


def _at_exit() -> None:
    close_all("interpreter exit")
    # Once every env is closed: its workers are gone.
    _forkserver.stop()
    _reaper_client.stop_now()


# --------------------------------------------------------------------------- signals
def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        log.debug("not installing signal handlers: envs started outside the main thread")
        return
    for sig in HANDLED_SIGNALS:
        if sig in _previous_handlers:
            continue
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue  # ignored before us (nohup, background job): keep ignoring
        signal.signal(sig, _handle_signal)
        _previous_handlers[sig] = previous


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # retried by the next unregister from the main thread
    for sig, previous in list(_previous_handlers.items()):
        if signal.getsignal(sig) is _handle_signal:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        del _previous_handlers[sig]


def _handle_signal(signum: int, frame: FrameType | None) -> None:
    global _in_handler
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if not _in_handler:
        _in_handler = True
        try:
            name = signal.Signals(signum).name
            log.info("%s received: closing %d managed env(s)", name, len(live_envs()))
            close_all(name)
        finally:
            _in_handler = False
    with _lock:
        _restore_signal_handlers()
    _chain(previous, signum, frame)


def _chain(previous: Any, signum: int, frame: FrameType | None) -> None:
    if callable(previous):
        handler: Callable[[int, FrameType | None], Any] = previous
        handler(signum, frame)
        return
    if previous is signal.SIG_IGN:
        return
    # SIG_DFL (or a handler installed outside Python): let the default action happen.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# --------------------------------------------------------------------------- parent death
def multiprocessing_parent() -> int | None:
    """Pid of the process that started this one through ``multiprocessing``, if any."""
    parent = multiprocessing.parent_process()
    return None if parent is None else parent.pid


def _start_parent_watch() -> None:
    global _parent_watch
    parent = multiprocessing_parent()
    if parent is None or (_parent_watch is not None and _parent_watch.is_alive()):
        return
    _parent_watch = threading.Thread(
        target=_watch_parent, args=(parent,), name="torchrl_ext-parent-watch", daemon=True
    )
    _parent_watch.start()


def _watch_parent(parent: int) -> None:
    pidfd = _platform.open_pidfd(parent) if os.getppid() == parent else None
    if pidfd is not None:
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
    else:  # no pidfds: the parent is gone once we have been re-parented
        # A watch for the whole life of the process: a look every 0.2 s costs nothing.
        wait_for(lambda: os.getppid() != parent, math.inf, "no deadline", slice=0.2)
    with _lock:
        if not any(ref() is not None for key, (ref, _h, _r) in _live.items() if key in _exit_with_parent):
            return
    me = os.getpid()
    log.warning(
        "the parent process (pid %d) of this process (pid %d) died: closing %d managed env(s) and "
        "ending this process with SIGTERM (exit_with_parent=True)",
        parent,
        me,
        len(live_envs()),
    )
    os.kill(me, signal.SIGTERM)
    time.sleep(PARENT_EXIT_GRACE)  # a grace period, not synchronisation: we are still alive
    log.warning("process %d ignored SIGTERM after its parent died; sending SIGKILL", me)
    os.kill(me, signal.SIGKILL)


def _forget_in_child() -> None:
    """A forked child (a worker, a DataLoader worker) does not own the parent's envs."""
    global _subreaper_ours, _parent_watch
    _subreaper_ours = False  # PR_SET_CHILD_SUBREAPER is not inherited
    _parent_watch = None  # threads are not inherited either
    _exit_with_parent.clear()
    _live.clear()
    for sig, previous in list(_previous_handlers.items()):
        try:
            if signal.getsignal(sig) is _handle_signal:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        except ValueError:  # not the main thread of the child
            pass
    _previous_handlers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
