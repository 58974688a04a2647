"""Main-process side of the external reaper (see ``_reaper.py``).

One reaper runs per owner process while at least one managed env is open; it is started on
the first ``acquire()`` and asked to exit on the last ``release()``. ``proc`` is the reaper's
shim (its parent, our child; see ``_reaper.py``), which exits with the reaper's status.
Messages go through a FIFO that the main process also holds open, so a worker can report
itself before the reaper has finished starting and nothing blocks if the reaper is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import _identity, _platform

__all__ = ["acquire", "add_helper", "notify_watch", "release", "send"]

log = logging.getLogger("torchrl_ext")

_REAPER_SCRIPT = Path(__file__).with_name("_reaper.py")
#: Seconds the reaper outlives the last release: an env built right after another closed (or
#: the spec-reading process, then the workers, of one env) reuses it instead of starting a new
#: one (tens of milliseconds each).
LINGER = 2.0
_lock = threading.RLock()
#: This process's helpers, pid -> create time: processes that end by themselves when it dies
#: (the fork servers, ``add_helper``). Every reaper is told of each, so that at this process's
#: death it waits for them to end instead of counting them among what the envs left.
_helpers: dict[int, float] = {}


class _ReaperHandle:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"torchrl_ext-{os.getpid()}-")
        self.fifo = os.path.join(self.dir, "reaper.fifo")
        os.mkfifo(self.fifo, 0o600)
        # Held open by us too: writes never fail while we live, and the reaper may start late.
        self.fd = os.open(self.fifo, os.O_RDWR | os.O_NONBLOCK)
        owner_pid, owner_ctime = _identity.me()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRL_EXT_")}
        cmd = [sys.executable, "-I", str(_REAPER_SCRIPT), str(owner_pid), repr(owner_ctime), self.fifo]
        if not _platform.has_pidfd():
            cmd.append("poll")  # the reaper polls the owner instead of waiting on a pidfd
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
        self.pid = self.proc.pid
        for pid, ctime in _helpers.items():
            self.send(helper_message(pid, ctime))

    def send(self, message: dict[str, object]) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            os.write(self.fd, data)
        except OSError as err:  # full pipe: the reaper is gone or stuck
            log.debug("could not message the reaper: %s", err)

    def stop(self, timeout: float = 2.0) -> None:
        self.send({"op": "exit"})
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("torchrl_ext reaper (session %d) did not exit; killing it", self.proc.pid)
            # The shim and the reaper share the session's process group.
            _platform.kill_process_group(self.proc.pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.fd)
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


_handle: _ReaperHandle | None = None
_users = 0
_linger: threading.Timer | None = None


def _forget_in_child() -> None:
    """A forked child must not talk to, or stop, its parent's reaper."""
    global _handle, _users, _linger
    if _handle is not None:
        try:
            os.close(_handle.fd)
        except OSError:
            pass
    _handle = None
    _users = 0
    _linger = None
    _helpers.clear()  # the parent's, not this process's: they do not end with it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def acquire() -> str:
    """Start the reaper if needed; returns the FIFO path workers report to."""
    global _handle, _users, _linger
    with _lock:
        if _linger is not None:
            _linger.cancel()
            _linger = None
        if _handle is None or _handle.proc.poll() is not None:
            if _handle is not None:
                log.warning(
                    "torchrl_ext reaper exited unexpectedly (code %s); restarting it", _handle.proc.returncode
                )
                shutil.rmtree(_handle.dir, ignore_errors=True)
            _handle = _ReaperHandle()
        _users += 1
        return _handle.fifo


def release() -> None:
    """Drop one user; the reaper stops ``LINGER`` seconds after the last one, unless a new
    user came meanwhile."""
    global _users, _linger
    with _lock:
        if _handle is None:
            return
        _users -= 1
        if _users <= 0:
            _users = 0
            if _linger is not None:
                _linger.cancel()
                _linger = None
            if LINGER <= 0:
                _stop_if_unused()
                return
            _linger = threading.Timer(LINGER, _stop_if_unused)
            _linger.daemon = True
            _linger.name = "torchrl_ext-reaper-linger"
            _linger.start()


def _stop_if_unused() -> None:
    global _handle, _linger
    with _lock:
        if _users > 0 or _handle is None:
            return
        handle, _handle, _linger = _handle, None, None
        handle.stop()


def stop_now() -> None:
    """Stop an unused reaper at once (interpreter exit, after every env is closed)."""
    global _linger
    with _lock:
        if _linger is not None:
            _linger.cancel()
            _linger = None
    _stop_if_unused()


def send(message: dict[str, object]) -> None:
    with _lock:
        if _handle is not None:
            _handle.send(message)


def watch_message(pid: int, ctime: float, pgid: int) -> dict[str, object]:
    """The reaper's "watch" message: kill ``pid`` (and group ``pgid``) if the owner dies."""
    return {"op": "watch", "pid": pid, "ctime": ctime, "pgid": pgid}


def watch(pid: int, ctime: float, pgid: int) -> None:
    """Report a process of this env to this process's reaper (a no-op without one)."""
    send(watch_message(pid, ctime, pgid))


def unwatch(pid: int) -> None:
    """Tell this process's reaper that ``pid`` (reaped, or replaced) is no longer ours."""
    send({"op": "unwatch", "pid": pid})


def helper_message(pid: int, ctime: float) -> dict[str, object]:
    """The reaper's "helper" message: ``pid`` ends by itself when the owner dies."""
    return {"op": "helper", "pid": pid, "ctime": ctime}


def add_helper(pid: int, ctime: float) -> None:
    """Record a process that ends by itself when this one dies (a fork server that exits once
    its "alive" pipe closes): this process's reaper, and every later one, waits for it to end
    instead of reporting it as a leftover (see ``_reaper.HELPER_GRACE``)."""
    with _lock:
        _helpers[pid] = ctime
        if _handle is not None:
            _handle.send(helper_message(pid, ctime))


def notify_watch(fifo: str, pid: int, ctime: float, pgid: int) -> None:
    """Report a process to the reaper listening on ``fifo`` (from any process). Never raises."""
    data = (json.dumps(watch_message(pid, ctime, pgid)) + "\n").encode()
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)
