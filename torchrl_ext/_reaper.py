"""The external reaper: a tiny process that outlives the main process by a few milliseconds.

Run as a *script* (``python _reaper.py OWNER_PID OWNER_CTIME FIFO [poll]``) so it never imports
torch or this package. The main process starts it in a session of its own while managed envs are
open. Workers and the main process tell it, through a FIFO, which worker processes exist; it
snapshots their process trees twice a second. When the owner process dies by any means
(SIGKILL and the OOM killer included) it SIGKILLs, within milliseconds:

* every worker it was told about (identity checked by pid and create time),
* every member of those workers' process groups born after the worker,
* every descendant it saw in a snapshot,
* every process whose environment carries the owner's ``TORCHRL_EXT_OWNER`` tag,

and repeats until a round finds nothing new. The owner's *helpers* (``{"op": "helper"}``: its
fork servers, which end by themselves once their owner is gone) are not among them: they get
``HELPER_GRACE`` seconds to end, and only then SIGKILL; the warning counts and names what it had
to kill, never a helper. It exits when the owner closes the last env (``{"op": "exit"}``) or
after the cleanup. See the NOTE in ``docs/design.md``.

What it knows (the workers, the descendants it saw) it also keeps in ``registry.json`` beside
the FIFO, rewritten whenever that changes. If the reaper dies together with its owner (a
node-wide kill, the OOM killer taking both), ``python -m torchrl_ext sweep`` reads the file
and finds what the tag cannot show: descendants that were forked without ``exec``.

The script forks once at start: the parent stays behind as a *shim* that only waits for the
reaper and exits with its status, so the reaper is not a direct child of the owner. Process
managers that SIGKILL the direct children of a process that exits (Ray's default
``kill_child_processes_on_worker_exit``) kill the shim; the reaper lives on to do its work.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import sys
import time
from types import ModuleType
from typing import NamedTuple

import psutil


def _load_identity() -> ModuleType:
    """``_identity.py`` from beside this file, without importing the package (or torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_identity.py")
    spec = importlib.util.spec_from_file_location("torchrl_ext_reaper_identity", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __package__:
    from . import _identity, _wait
else:  # run as a script: python -I _reaper.py ...
    _identity = _load_identity()
    _wait = _identity.load_sibling("_wait")  # the copy _identity loaded

SNAPSHOT_INTERVAL = 0.5
REGISTRY_NAME = "registry.json"
#: Seconds the owner's helpers get to end by themselves after the owner died (a fork server
#: exits when its "alive" pipe closes, or at once by its parent-death signal).
HELPER_GRACE = 1.0
#: How many of the processes it killed the warning names.
NAMED = 10

log = logging.getLogger("torchrl_ext.reaper")


class Reaper:
    def __init__(self, owner_pid: int, owner_ctime: float, fifo_path: str, poll: bool = False) -> None:
        self.fifo_path = fifo_path
        self.poll = poll  # no pidfd: poll the owner (macOS, old kernels, TORCHRL_EXT_PORTABLE)
        self.owner_pid = owner_pid
        self.owner_ctime = owner_ctime
        self.fifo_fd = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK)
        self.buffer = b""
        self.workers: dict[int, tuple[float, int]] = {}  # pid -> (create_time, pgid)
        #: The owner's helpers, pid -> create time ("helper" messages): they end by themselves.
        self.helpers: dict[int, float] = {}
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.stop = False
        self.registry_path = os.path.join(os.path.dirname(fifo_path), REGISTRY_NAME)
        self.registry_dirty = False
        #: Process groups of workers alive at the last snapshot or reported since.
        self.recent_groups: set[int] = set()

    # --- owner liveness -------------------------------------------------------------------
    def owner_alive(self) -> bool:
        return bool(_identity.running(self.owner_pid, self.owner_ctime))

    # --- messages -------------------------------------------------------------------------
    def read_messages(self) -> None:
        while True:
            try:
                chunk = os.read(self.fifo_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            op = msg.get("op")
            if op == "watch":
                self.workers[int(msg["pid"])] = (float(msg["ctime"]), int(msg["pgid"]))
                self.recent_groups.add(int(msg["pgid"]))
                self.registry_dirty = True
            elif op == "unwatch":
                pid = int(msg["pid"])
                self.workers.pop(pid, None)
                self.seen = {k: v for k, v in self.seen.items() if not _descends(v, pid)}
                self.registry_dirty = True
            elif op == "helper":
                self.helpers[int(msg["pid"])] = float(msg["ctime"])
            elif op == "exit":
                self.stop = True

    def snapshot(self) -> None:
        # Forget descendants that ended (a DataLoader per reset starts new ones every episode).
        ended = [key for key, proc in self.seen.items() if not _identity.alive(proc)]
        for key in ended:
            del self.seen[key]
        known = len(self.seen)
        self.recent_groups = set()
        for pid, (ctime, pgid) in list(self.workers.items()):
            worker = _identity.same_process(pid, ctime)
            if worker is None:
                continue
            self.recent_groups.add(pgid)
            for child in _identity.descendants(pid):
                child_key = _identity.key_of(child)
                if child_key is not None:
                    self.seen[child_key] = child
        if ended or len(self.seen) != known:
            self.registry_dirty = True

    def write_registry(self) -> None:
        """Persist what we know for ``python -m torchrl_ext sweep`` (atomically; never raises)."""
        if not self.registry_dirty:
            return
        self.registry_dirty = False
        data = {
            "owner_pid": self.owner_pid,
            "owner_ctime": self.owner_ctime,
            "workers": [[pid, ctime, pgid] for pid, (ctime, pgid) in self.workers.items()],
            "seen": [[pid, ctime] for pid, ctime in self.seen],
        }
        tmp = self.registry_path + ".tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(data, fh)
            os.replace(tmp, self.registry_path)
        except OSError:
            pass

    # --- cleanup --------------------------------------------------------------------------
    def targets(self) -> list[psutil.Process]:
        return leftovers(
            self.owner_pid, self.owner_ctime, self.workers, self.seen, frozenset(self.recent_groups)
        )

    def is_helper(self, proc: psutil.Process) -> bool:
        ctime = self.helpers.get(proc.pid)
        key = _identity.key_of(proc)
        return ctime is not None and key is not None and bool(_identity.same_ctime(key[1], ctime))

    def cleanup(self) -> dict[int, str]:
        """Kill what the dead owner left: every target at once, its helpers once they had
        ``HELPER_GRACE`` seconds to end by themselves. Returns what it killed (pid -> name), the
        helpers left out: they were no env's to end."""
        killed = self._kill_targets()
        helpers = [proc for proc in self.targets() if self.is_helper(proc)]
        if helpers:

            def ended() -> bool:
                return not any(_identity.alive(proc) for proc in helpers)

            # Milliseconds count here (the owner is dead): look every 10 ms at most.
            reason = f"the helpers did not end within {HELPER_GRACE:g} s"
            _wait.wait_for(ended, time.monotonic() + HELPER_GRACE, reason, slice=0.01)
            _identity.kill_and_reap(helpers, grace=0.0, kill_wait=0.2)
            killed.update(self._kill_targets())  # what a helper started meanwhile
        return killed

    def _kill_targets(self) -> dict[int, str]:
        killed: dict[int, str] = {}
        for _ in range(20):
            procs = [proc for proc in self.targets() if not self.is_helper(proc)]
            if not procs:
                break
            names = {proc.pid: _name(proc) for proc in procs}
            _terminated, done = _identity.kill_and_reap(procs, grace=0.0, kill_wait=0.2)
            killed.update((proc.pid, names.get(proc.pid, "?")) for proc in done)
        return killed

    def remove_runtime_dir(self) -> None:
        """Remove the owner's runtime directory (this FIFO, the registry, the workers' error
        reports): on both ways the reaper ends, the owner's death and its "exit" (sent once no
        env of the owner is open, so nothing of it uses the directory any more)."""
        shutil.rmtree(os.path.dirname(self.fifo_path), ignore_errors=True)

    # --- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        pidfd = None
        if hasattr(os, "pidfd_open") and not self.poll:
            try:
                pidfd = os.pidfd_open(self.owner_pid)
            except OSError:
                pidfd = None
        poller = select.poll()
        poller.register(self.fifo_fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        # Without a pidfd (macOS, old kernels) fall back to polling the owner.
        interval = SNAPSHOT_INTERVAL if pidfd is not None else 0.05
        last_snapshot = 0.0
        while True:
            if not self.owner_alive():
                self.read_messages()
                killed = self.cleanup()
                if killed:
                    named = ", ".join(f"{pid} ({name})" for pid, name in sorted(killed.items())[:NAMED])
                    log.warning(
                        "torchrl_ext reaper: owner process %d died; killed %d leftover process(es): %s%s",
                        self.owner_pid,
                        len(killed),
                        named,
                        ", ..." if len(killed) > NAMED else "",
                    )
                self.remove_runtime_dir()
                return 0
            events = poller.poll(interval * 1000)
            for fd, _ev in events:
                if fd == self.fifo_fd:
                    self.read_messages()
            if self.stop:
                # The owner removes it too once we exited; if it dies first, nobody else would.
                self.remove_runtime_dir()
                return 0
            now = time.monotonic()
            if self.workers and now - last_snapshot >= SNAPSHOT_INTERVAL:
                self.snapshot()
                last_snapshot = now
            self.write_registry()


def leftovers(
    owner_pid: int,
    owner_ctime: float,
    workers: dict[int, tuple[float, int]],
    seen: dict[tuple[int, float], psutil.Process],
    recent_groups: frozenset[int] = frozenset(),
) -> list[psutil.Process]:
    """Live processes of an owner: its workers, the descendants ``seen`` that still run, the
    members of the workers' anchored process groups and every process carrying the owner's
    tag (``_identity.tree``). ``recent_groups``: groups of workers alive at the last snapshot.
    Also used by ``python -m torchrl_ext sweep``.
    """
    procs: list[psutil.Process] = _identity.tree(
        workers, seen.values(), owner=(owner_pid, owner_ctime), recent_groups=recent_groups
    )
    return procs


class Registry(NamedTuple):
    """What a reaper recorded (``registry.json``)."""

    owner_pid: int
    owner_ctime: float
    workers: dict[int, tuple[float, int]]  # pid -> (create time, process group)
    seen: list[tuple[int, float]]  # (pid, create time) of descendants

    def leftovers(self) -> list[psutil.Process]:
        """The owner's processes still alive (see :func:`leftovers`)."""
        seen = {(pid, ctime): _identity.same_process(pid, ctime) for pid, ctime in self.seen}
        live = {key: proc for key, proc in seen.items() if proc is not None}
        return leftovers(self.owner_pid, self.owner_ctime, self.workers, live)


def load_registry(path: str) -> Registry | None:
    """Parse a reaper's registry file; None when it is missing or unreadable."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        return Registry(
            int(data["owner_pid"]),
            float(data["owner_ctime"]),
            {int(pid): (float(ctime), int(pgid)) for pid, ctime, pgid in data["workers"]},
            [(int(pid), float(ctime)) for pid, ctime in data["seen"]],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _name(proc: psutil.Process) -> str:
    try:
        return str(proc.name())
    except psutil.Error:
        return "?"


def _descends(proc: psutil.Process, pid: int) -> bool:
    try:
        return any(parent.pid == pid for parent in proc.parents())
    except psutil.Error:
        return True


def _stay_behind_as_shim() -> int | None:
    """Fork; the parent waits for the child and returns its exit code, the child gets None."""
    pid = os.fork()
    if pid == 0:
        return None
    try:
        _pid, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 1
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # Terminal signals are for the owner; the reaper ends with it, not before it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    shim_code = _stay_behind_as_shim()
    if shim_code is not None:
        return shim_code
    owner_pid, owner_ctime, fifo_path = int(argv[1]), float(argv[2]), argv[3]
    poll = len(argv) > 4 and argv[4] == "poll"
    return Reaper(owner_pid, owner_ctime, fifo_path, poll).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
