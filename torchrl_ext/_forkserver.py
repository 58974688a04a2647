"""The preloaded fork server: workers start as forks of a warm, supervised process.

NOTE [preloaded fork server]
----------------------------
Spawn re-imports torch and TorchRL in every worker (seconds each on a small machine) and ends
every worker with a full interpreter shutdown. Plain fork copies the owner, threads and all.
So, once per owner process and on first use, we start one server process that imports torch,
tensordict, TorchRL, the module defining the first env factory (and ``__main__``, as
``multiprocessing``'s own fork server does) plus any user-listed modules, and then runs
``multiprocessing``'s fork-server loop. Each worker is a fork of that warm process:

* **Start** costs a fork, not an import. Workers end with ``os._exit`` (as every forked
  ``multiprocessing`` child does), so they close fast too.
* **Random state** is fresh in each direct child of the server, as a spawned process's would
  be: torch's default generator and numpy's legacy global state are reseeded from the OS at
  fork (``random`` reseeds itself). Forks made later *by* a worker keep fork semantics.
* **Preload errors** are reported over a status pipe before the server serves anything: a
  module that fails to import raises :class:`PreloadError` naming it, never a hang.
* **Supervision**: the server carries the owner's tag (``TORCHRL_EXT_OWNER``, env id
  ``<pid>.forkserver``), leads its own process group, is armed with the parent-death signal
  when started from the main thread, is reported to the reaper by every env that starts, and
  exits by itself when the owner dies (its "alive" pipe reaches EOF). A server that died is
  replaced at the next start. :func:`stop` ends it (the ``_lifecycle`` exit hook calls it
  after every env is closed).
* **Children of workers**: a worker forked from the server inherits TorchRL's global start
  method (spawn); ``ManagedParallelEnv(child_start_method=...)`` sets the default inside each
  worker ("fork" on this path, see ``_env``).

``multiprocessing`` keeps one fork server per process for ``mp_start_method="forkserver"``;
this one is separate, so a user's own forkserver (and its preload list) is untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import psutil

from . import _identity, _platform
from ._errors import PreloadError, format_exitcode
from ._tag import Tag

__all__ = [
    "BASE_PRELOAD",
    "context",
    "server_key",
    "start_method_chosen_by_user",
    "stop",
]

log = logging.getLogger("torchrl_ext")

#: NOTE [preloaded fork server]: what every server imports before it forks anything.
BASE_PRELOAD: tuple[str, ...] = ("torch", "tensordict", "torchrl", "torchrl.envs", "torchrl_ext")
#: Seconds the server may take to import its modules (torch on a loaded 2-core machine takes
#: tens of seconds at worst); past it the server is killed and start-up fails.
PRELOAD_TIMEOUT = 300.0
#: Seconds :func:`stop` waits for an idle server to exit before SIGKILL.
STOP_WAIT = 2.0
#: Env id suffix of the server's tag.
TAG_SUFFIX = "forkserver"

# TorchRL sets the global start method to spawn when it is imported and none was set. What was
# set before TorchRL's import tells a user's choice apart from TorchRL's (see
# start_method_chosen_by_user); unknown (None) when TorchRL was imported before us.
_BEFORE_TORCHRL: str | None = (
    None if "torchrl" in sys.modules else multiprocessing.get_start_method(allow_none=True)
)


def start_method_chosen_by_user() -> bool:
    """Whether the program chose a global start method (``mp.set_start_method``) itself.

    TorchRL's own ``set_start_method("spawn")`` at import does not count. A ``"spawn"`` set by
    the program before ``torchrl`` or ``torchrl_ext`` was first imported does; one set after
    TorchRL's import cannot be told apart (pass ``mp_start_method="spawn"`` to keep spawn).
    """
    current = multiprocessing.get_start_method(allow_none=True)
    if current is None:
        return False
    if current != "spawn":
        return True
    return _BEFORE_TORCHRL == "spawn"


# --------------------------------------------------------------------------- in the server
_server_pid: int | None = None


def _fresh_random_state() -> None:
    """At each fork of the server: the random state a spawned process would have."""
    if os.getppid() != _server_pid:  # a fork made by a worker keeps fork semantics
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


#: What spawn's preparation sets that the server must not take from the owner: its name
#: (each worker gets its own) and the authkey (never on a pipe or a command line; each worker
#: receives it in its own preparation data).
_NOT_SERVER_PREP = ("name", "authkey", "init_main_from_name", "init_main_from_path")


def _prepare_as_spawn(prep: dict[str, Any]) -> None:
    """Set up the server as ``multiprocessing.spawn.prepare`` sets up a spawned child before
    it runs the main module: ``sys.argv``, the working directory, ``sys.path``, the original
    directory, the log level and the start method (NOTE [preloaded fork server])."""
    multiprocessing.spawn.prepare({k: v for k, v in prep.items() if k not in _NOT_SERVER_PREP})


def _import_main(prep: dict[str, Any]) -> None:
    """Import the owner's main module as spawn would: by name for ``python -m``, else by path,
    as ``__mp_main__`` (``__name__ != "__main__"``, so the script's guard holds)."""
    main: dict[str, Any] = {k: prep[k] for k in ("init_main_from_name", "init_main_from_path") if k in prep}
    if not main:
        return
    current = multiprocessing.process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        multiprocessing.spawn.prepare(main)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


def _preload(modules: Sequence[str], prep: dict[str, Any]) -> None:
    try:
        _prepare_as_spawn(prep)
    except BaseException as exc:
        raise _PreloadFailed("__main__", exc) from exc
    for name in modules:
        try:
            if name == "__main__":
                _import_main(prep)
            else:
                importlib.import_module(name)
        except BaseException as exc:
            raise _PreloadFailed(name, exc) from exc


class _PreloadFailed(Exception):
    def __init__(self, module: str, exc: BaseException) -> None:
        super().__init__(module)
        self.module = module
        self.text = "".join(traceback.format_exception(exc))


def serve(
    listener_fd: int, alive_r: int, status_w: int, setup_r: int, owner_pid: int, arm_pdeathsig: bool
) -> None:
    """Entry point of the server process (see NOTE [preloaded fork server]). ``setup_r``
    carries the modules to preload and the owner's spawn preparation data (pickled)."""
    global _server_pid
    if arm_pdeathsig and _platform.set_parent_death_signal(signal.SIGKILL) and os.getppid() != owner_pid:
        os._exit(1)  # the owner died before the signal was armed
    _server_pid = os.getpid()
    with open(setup_r, "rb", closefd=True) as setup:
        modules, prep = pickle.load(setup)
    try:
        _preload(modules, prep)
    except _PreloadFailed as failed:
        message = {"module": failed.module, "traceback": failed.text}
        os.write(status_w, json.dumps(message).encode())
        os._exit(3)
    os.register_at_fork(after_in_child=_fresh_random_state)
    os.write(status_w, b'{"ok": true}')
    os.close(status_w)
    try:
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    finally:
        # Its owner let go (the "alive" pipe reached EOF): leave without the interpreter's
        # teardown, which takes seconds with torch loaded; nothing here needs finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------------------- in the owner
class _Server(multiprocessing.forkserver.ForkServer):
    """``multiprocessing``'s fork server, launched our way (tag, group, preload report)."""

    def __init__(self) -> None:
        super().__init__()
        self._server_lock = threading.RLock()
        self._preload_modules: list[str] = []
        self._wanted: list[str] = list(BASE_PRELOAD)
        self._proc: subprocess.Popen[bytes] | None = None
        self.key: _identity.ProcessKey | None = None

    def want(self, modules: Iterable[str]) -> None:
        """Add modules to preload at the next launch (a running server keeps its own)."""
        with self._server_lock:
            for name in modules:
                if name and name not in self._wanted:
                    self._wanted.append(name)

    def ensure_running(self) -> None:
        with self._server_lock:
            multiprocessing.resource_tracker.ensure_running()
            if self._proc is not None:
                if self._proc.poll() is None:
                    return
                log.warning(
                    "the preloaded fork server (pid %d) exited with code %s; starting a new one",
                    self._proc.pid,
                    self._proc.returncode,
                )
                self._forget()
            self._launch()

    def _launch(self) -> None:
        modules = ["__main__", *self._wanted]
        # What spawn would set up in a child before it runs the main module (argv, cwd, sys.path,
        # the main module by path or by name); the server does the same before its preload.
        prep = {
            k: v
            for k, v in multiprocessing.spawn.get_preparation_data("ignore").items()
            if k not in ("name", "authkey")
        }
        owner_pid, owner_ctime = _identity.me()
        tag = Tag(owner_pid, owner_ctime, f"{owner_pid}.{TAG_SUFFIX}")
        env = dict(os.environ)
        env[_identity.OWNER_VAR] = str(tag)
        env[_identity.WORKER_VAR] = TAG_SUFFIX
        arm = _platform.parent_death_outlives_worker(None)  # the server is this thread's child
        with socket.socket(socket.AF_UNIX) as listener:
            address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            if not multiprocessing.util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            status_r, status_w = os.pipe()
            setup_r, setup_w = os.pipe()
            args = (listener.fileno(), alive_r, status_w, setup_r, owner_pid, arm)
            code = f"from torchrl_ext._forkserver import serve; serve(*{args!r})"
            exe = multiprocessing.spawn.get_executable()
            try:
                proc = subprocess.Popen(
                    [exe, *subprocess._args_from_interpreter_flags(), "-c", code],  # type: ignore[attr-defined]
                    pass_fds=(listener.fileno(), alive_r, status_w, setup_r),
                    stdin=subprocess.DEVNULL,
                    env=env,
                    process_group=0,
                )
            except BaseException:
                os.close(alive_w)
                os.close(status_r)
                os.close(setup_w)
                raise
            finally:
                os.close(alive_r)
                os.close(status_w)
                os.close(setup_r)
            # A server that dies before reading this is reported by _await_preload.
            with contextlib.suppress(OSError), open(setup_w, "wb", closefd=True) as setup:
                pickle.dump((modules, prep), setup)
        try:
            self._await_preload(proc, status_r, modules)
        except BaseException:
            os.close(alive_w)
            if proc.poll() is None:  # a hung preload, or an error reported before exiting
                proc.kill()
            proc.wait()
            raise
        finally:
            os.close(status_r)
        self._proc = proc
        self.key = (proc.pid, psutil.Process(proc.pid).create_time())
        self._endpoint(address, alive_w, proc.pid)
        log.debug("preloaded fork server pid %d ready (%s)", proc.pid, ", ".join(modules))

    @staticmethod
    def _await_preload(proc: subprocess.Popen[bytes], status_r: int, modules: list[str]) -> None:
        deadline = time.monotonic() + PRELOAD_TIMEOUT
        data = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PreloadError(
                    f"the preloaded fork server (pid {proc.pid}) did not finish importing "
                    f"{modules} within {PRELOAD_TIMEOUT:.0f} s; one of them hangs at import. Pass "
                    "mp_start_method='spawn' to start workers without it."
                )
            ready, _, _ = select.select([status_r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(status_r, 65536)
            if not chunk:
                break
            data += chunk
            if _complete(data):  # a process the preload started may hold the pipe open
                break
        report = json.loads(data) if data else None
        if isinstance(report, dict) and report.get("ok"):
            return
        if isinstance(report, dict) and report.get("module") == "__main__":
            raise PreloadError(
                "the preloaded fork server could not import your script's __main__ module:\n"
                f"{report['traceback']}The server imports the script once, as spawn imports it in "
                "every worker: as `__mp_main__`, with the same sys.argv, working directory and "
                'sys.path. Code above `if __name__ == "__main__":` runs there; if it builds an env '
                "or starts processes, move it under that guard (spawn requires it too). Or pass "
                "mp_start_method='spawn' to start workers without the server.",
                name="__main__",
            )
        if isinstance(report, dict) and "module" in report:
            module = report["module"]
            raise PreloadError(
                f"the preloaded fork server could not import {module!r}:\n{report['traceback']}"
                f"Fix the import, leave {module!r} out of `preload`, or pass "
                "mp_start_method='spawn' to start workers without the server.",
                name=module,
            )
        code = proc.wait()
        raise PreloadError(
            f"the preloaded fork server (pid {proc.pid}) exited with code "
            f"{format_exitcode(code)} before importing {modules}; its error is above on stderr. "
            "Pass mp_start_method='spawn' to start workers without it."
        )

    def _forget(self) -> None:
        alive_fd = self.__dict__.get("_forkserver_alive_fd")
        if alive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(alive_fd)
        address = self.__dict__.get("_forkserver_address")
        if address and not multiprocessing.util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        self._endpoint(None, None, None)
        self._proc = None
        self.key = None

    def stop(self, wait: float = STOP_WAIT) -> None:
        with self._server_lock:
            proc = self._proc
            if proc is None:
                return
            self._forget()  # closes our end of the "alive" pipe: the server exits when idle
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                log.warning("the preloaded fork server (pid %d) did not exit; killing it", proc.pid)
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()

    def in_child(self) -> None:
        """A forked copy of the owner does not own the server."""
        self._proc = None
        self.key = None
        self._endpoint(None, None, None)

    def _endpoint(self, address: Any, alive_fd: int | None, pid: int | None) -> None:
        """What the base class's ``connect_to_new_process`` uses."""
        self.__dict__.update(_forkserver_address=address, _forkserver_alive_fd=alive_fd, _forkserver_pid=pid)


def _complete(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


_SERVER = _Server()
os.register_at_fork(after_in_child=_SERVER.in_child)


class _Popen(multiprocessing.popen_forkserver.Popen):
    """A child forked by our server. Its exit status is read under a lock: two threads reading
    it at once (the supervisor's and the main thread's) would make one of them see EOF and
    record 255 (``multiprocessing``'s own forkserver ``Popen`` has that race)."""

    def __init__(self, process_obj: Any) -> None:
        self._status_lock = threading.Lock()
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        data = io.BytesIO()
        prep = multiprocessing.spawn.get_preparation_data(process_obj._name)
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.context.reduction.dump(prep, data)  # type: ignore[attr-defined]
            multiprocessing.context.reduction.dump(process_obj, data)  # type: ignore[attr-defined]
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, write_fd = _SERVER.connect_to_new_process(self.__dict__["_fds"])
        # The child watches a duplicate of the data pipe's write end to see this process die.
        keep = os.dup(write_fd)
        close_fds = multiprocessing.util.close_fds  # type: ignore[attr-defined]
        self.finalizer = multiprocessing.util.Finalize(self, close_fds, (keep, self.sentinel))
        with open(write_fd, "wb", closefd=True) as pipe:
            pipe.write(data.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(self.sentinel)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not multiprocessing.connection.wait([self.sentinel], timeout):
                return None
            with self._status_lock:
                if self.returncode is None:
                    try:
                        self.returncode = multiprocessing.forkserver.read_signed(self.sentinel)
                    except (OSError, EOFError):
                        self.returncode = 255
        result: int | None = self.returncode
        return result


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


class PreloadedContext(multiprocessing.context.ForkServerContext):
    """A forkserver context whose processes fork from the preloaded server."""

    Process = _Process


_CONTEXT = PreloadedContext()


def context(modules: Iterable[str] = ()) -> PreloadedContext:
    """The preloaded context, its server running (started now if needed, with ``modules``
    added to the preload list of a server that is not running yet).

    Raises:
        PreloadError: the server could not import one of its modules.
    """
    _SERVER.want(modules)
    _SERVER.ensure_running()
    return _CONTEXT


def server_key() -> _identity.ProcessKey | None:
    """``(pid, create time)`` of this process's running server, if any."""
    key = _SERVER.key
    return key


def stop() -> None:
    """End this process's server (it exits once idle; SIGKILL after ``STOP_WAIT``)."""
    _SERVER.stop()
