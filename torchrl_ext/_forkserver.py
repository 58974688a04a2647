"""The preloaded fork server: workers start as forks of a warm, supervised process.

NOTE [preloaded fork server]
----------------------------
Spawn re-imports torch and TorchRL in every worker (seconds each on a small machine) and ends
every worker with a full interpreter shutdown. Plain fork copies the owner, threads and all.
So, once per owner process and on first use, we start one server process that imports torch,
tensordict, TorchRL, the module defining the first env factory (and ``__main__``, as
``multiprocessing``'s own fork server does) plus any user-listed modules, and then runs its
fork-server loop (ours, speaking ``multiprocessing``'s protocol). Each worker is a fork of that
warm process:

* **Start** costs a fork, not an import. Workers end with ``os._exit`` (as every forked
  ``multiprocessing`` child does), so they close fast too.
* **Zygote**: where the owner is provably safe to fork when the server starts (one thread,
  CUDA not initialised: ``_platform.fork_unsafe_reason``), the server is a fork of the owner
  instead of a new interpreter, and its own start costs a fork too (NOTE [zygote]); otherwise
  one INFO line says why, and the server imports everything as above. So it does when the
  zygote dies before its preload report (a crash of its own; a module that fails to import is
  a :class:`PreloadError`, as for a new interpreter).
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
* **Frozen preload**: after the preload the server collects its garbage and freezes what is
  left (``gc.freeze``): a full collection in a worker then copies none of the pages it
  shares with the server (NOTE [frozen preload] at :func:`_freeze_preloaded`).
* **Children of workers**: a worker forked from the server inherits TorchRL's global start
  method (spawn); ``ManagedParallelEnv(child_start_method=...)`` sets the default inside each
  worker ("fork" on this path, see ``_env``).

``multiprocessing`` keeps one fork server per process for ``mp_start_method="forkserver"``;
this one is separate, so a user's own forkserver (and its preload list) is untouched.

The fork-server protocol is here too, whole: launching the server as spawn launches a child
(:func:`interpreter_flags`, :func:`executable`, :func:`preparation_data`, :func:`prepare`),
the server's loop on authenticated connections (:func:`serve_forkserver`, ``multiprocessing``'s
protocol, our loop),
asking it for a child (:func:`request_fork`) and the context whose processes it forks
(:func:`forkserver_context`). This module is the only user of the CPython internals that
``_cpython.INVENTORY`` lists with ``owner="_forkserver"`` (NOTE [CPython internals]).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import hmac
import importlib
import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.reduction
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psutil

from . import _cpython, _identity, _platform, _reaper_client
from ._errors import PreloadError, format_exitcode
from ._tag import Tag
from ._wait import on, wait_for

__all__ = [
    "BASE_PRELOAD",
    "context",
    "server_key",
    "server_kind",
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
#: Seconds a connection to the server may take to answer its challenge before it is refused.
AUTH_TIMEOUT = 10.0
_CHALLENGE = b"torchrl_ext fork server v1 "  # then a random nonce
_NONCE_BYTES = 32
_WELCOME = b"welcome"

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


# --------------------------------------------------------------------------- the fork-server protocol
def interpreter_flags() -> list[str]:
    """This interpreter's command-line flags, for a child interpreter."""
    return subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]


def executable() -> str:
    """The interpreter ``multiprocessing`` runs children with."""
    return os.fsdecode(multiprocessing.spawn.get_executable())  # bytes on 3.11


def preparation_data(name: str) -> dict[str, Any]:
    """What spawn sends a child named ``name`` to set itself up with."""
    return dict(multiprocessing.spawn.get_preparation_data(name))


def prepare(data: dict[str, Any]) -> None:
    """Set this process up from preparation data, as a spawned child does."""
    multiprocessing.spawn.prepare(data)


def import_main_as_spawn(data: dict[str, Any]) -> None:
    """Import the main module from ``data`` (its name or path) as spawn does, with starting a
    process at import refused as spawn refuses it."""
    current = multiprocessing.process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        multiprocessing.spawn.prepare(data)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


def ensure_resource_tracker() -> None:
    """Start ``multiprocessing``'s resource tracker if it is not running."""
    multiprocessing.resource_tracker.ensure_running()


def new_unix_address() -> str:
    """A fresh address for a listening ``AF_UNIX`` socket."""
    return str(multiprocessing.connection.arbitrary_address("AF_UNIX"))  # type: ignore[attr-defined]


def is_abstract_address(address: Any) -> bool:
    """Whether a socket address is in Linux's abstract namespace (no file to chmod or unlink)."""
    return bool(multiprocessing.util.is_abstract_socket_namespace(address))


def request_fork(client: socket.socket, alive_fd: int, fds: Sequence[int]) -> tuple[int, int]:
    """Ask a fork server, over the connected ``client``, for a child inheriting ``fds``.

    Returns ``(status_r, data_w)``: the child's pid and then its exit status arrive on the
    first; the preparation data and the pickled process go to the second.
    """
    if len(fds) + 4 >= multiprocessing.forkserver.MAXFDS_TO_SEND:
        raise ValueError(f"too many fds for one fork request ({len(fds)})")
    status_r, child_w = os.pipe()
    child_r, data_w = os.pipe()
    try:
        tracker_fd: Any = multiprocessing.resource_tracker.getfd()  # running: an int
        multiprocessing.reduction.sendfds(client, [child_r, child_w, alive_fd, tracker_fd, *fds])
    except BaseException:
        os.close(status_r)
        os.close(data_w)
        raise
    finally:
        os.close(child_r)
        os.close(child_w)
    return status_r, data_w


def serve_forkserver(listener_fd: int, alive_r: int, admit: Callable[[socket.socket], bool]) -> None:
    """The server's loop, until ``alive_r`` reaches EOF (its owner let go). A connection that
    ``admit(conn)`` admits stays open (NOTE [one connection]): each fork request on it
    (``multiprocessing``'s message, one byte and the fds: :func:`request_fork`) gets a child
    that runs the process sent to it, and the client learns the child's pid on the request's
    status pipe and, once it exits, its exit status. A refused, broken or ended connection is
    closed and the loop goes on."""
    wake_r, wake_w = os.pipe()  # SIGCHLD writes here (signal.set_wakeup_fd)
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    handlers = {signal.SIGCHLD: signal.signal(signal.SIGCHLD, lambda *_: None)}
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the owner's
    signal.set_wakeup_fd(wake_w)
    status_of: dict[int, int] = {}  # child pid -> the status pipe its exit status goes to
    clients: list[socket.socket] = []  # admitted connections
    listener = socket.socket(socket.AF_UNIX, fileno=listener_fd)
    with listener, selectors.DefaultSelector() as selector:
        for source in (listener, alive_r, wake_r):
            selector.register(source, selectors.EVENT_READ)
        while True:
            ready = {key.fileobj for key, _ in selector.select()}
            if alive_r in ready:
                return
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 65536)
                _report_exits(status_of)
            if listener in ready:
                _accept(listener, selector, admit, clients)
            for client in [c for c in clients if c in ready]:
                # The child must not keep the server's own fds, nor the other clients' pipes.
                server_fds = [alive_r, wake_r, wake_w, *status_of.values()]
                if not _fork_one(client, [listener, *clients], selector, server_fds, handlers, status_of):
                    selector.unregister(client)
                    clients.remove(client)
                    client.close()


def _report_exits(status_of: dict[int, int]) -> None:
    """Send each child that exited its exit status, to its client. Collected by pid: another
    child of the server (a preloaded module's) is not the loop's to reap."""
    for pid in list(status_of):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # collected elsewhere: its status is lost, the client sees EOF
            os.close(status_of.pop(pid))
            continue
        if done == 0:
            continue
        status_w = status_of.pop(pid)
        with contextlib.suppress(BrokenPipeError):  # the client is gone
            multiprocessing.forkserver.write_signed(status_w, os.waitstatus_to_exitcode(status))
        os.close(status_w)


def _accept(
    listener: socket.socket,
    selector: selectors.BaseSelector,
    admit: Callable[[socket.socket], bool],
    clients: list[socket.socket],
) -> None:
    """Take one connection: kept (its requests served by :func:`_fork_one`) if admitted."""
    try:
        conn, _ = listener.accept()
    except OSError as exc:
        log.debug("fork server: accept failed (%s)", exc)
        return
    if not admit(conn):
        conn.close()
        return
    clients.append(conn)
    selector.register(conn, selectors.EVENT_READ)


def _fork_one(
    client: socket.socket,
    sockets: list[socket.socket],
    selector: selectors.BaseSelector,
    server_fds: list[int],
    handlers: dict[Any, Any],
    status_of: dict[int, int],
) -> bool:
    """Serve one request of an admitted client: its fds read, one child forked for it, which
    closes the server's ``sockets`` (its listener and clients) and ``server_fds``. False when
    the connection ended or broke (the caller closes it)."""
    try:
        fds = multiprocessing.reduction.recvfds(client, multiprocessing.forkserver.MAXFDS_TO_SEND + 1)
    except EOFError:  # the client closed it
        return False
    except (OSError, RuntimeError) as exc:
        log.debug("fork server: a fork request carried no fds (%s)", exc)
        return False
    if not 4 <= len(fds) <= multiprocessing.forkserver.MAXFDS_TO_SEND:
        log.debug("fork server: refused a fork request of %d fds", len(fds))
        for fd in fds:
            os.close(fd)
        return False
    data_r, status_w, *inherited = fds  # inherited: the owner's alive fd, the tracker's, the process's
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in sockets:
                sock.close()
            selector.close()
            unused = [*server_fds, status_w]
            code = multiprocessing.forkserver._serve_one(  # type: ignore[attr-defined]
                data_r, inherited, unused, handlers
            )
        except Exception:
            sys.excepthook(*sys.exc_info())
            sys.stderr.flush()
        finally:
            os._exit(code)
    with contextlib.suppress(BrokenPipeError):  # the client is gone; the child's exit is still reaped
        multiprocessing.forkserver.write_signed(status_w, pid)
    status_of[pid] = status_w
    for fd in (data_r, *inherited):
        os.close(fd)
    return True


_connect: list[Callable[[Sequence[int]], tuple[int, int]]] = []


class _ServerChild(_cpython.ForkServerPopen):
    """A child forked by the server :func:`forkserver_context` was given. Its exit status is
    read under a lock: two threads reading it at once (a supervisor's and the main thread's)
    would make one of them see EOF and record 255 (``multiprocessing``'s own forkserver
    ``Popen`` has that race)."""

    def __init__(self, process_obj: Any) -> None:
        self._status_lock = threading.Lock()
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        data = io.BytesIO()
        prep = multiprocessing.spawn.get_preparation_data(process_obj.name)
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.reduction.dump(prep, data)
            multiprocessing.reduction.dump(process_obj, data)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, write_fd = _connect[0](self.__dict__["_fds"])
        # The child watches a duplicate of the data pipe's write end to see this process die.
        keep = os.dup(write_fd)
        close_fds = multiprocessing.util.close_fds  # type: ignore[attr-defined]
        self.finalizer = _cpython.finalize(self, close_fds, (keep, self.sentinel))
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


class ForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A process of the server :func:`forkserver_context` was given. Its class name is that of
    ``multiprocessing``'s own forkserver processes, because a process is named after its class
    (``ForkServerProcess-2``): a worker shows the name upstream's workers have under
    ``mp_start_method="forkserver"`` in its tracebacks and log records."""

    @staticmethod
    def _Popen(process_obj: Any) -> _ServerChild:
        return _ServerChild(process_obj)


class _ServerContext(multiprocessing.context.ForkServerContext):
    Process = ForkServerProcess


def forkserver_context(connect: Callable[[Sequence[int]], tuple[int, int]]) -> Any:
    """A forkserver context whose processes come from ``connect(fds) -> (status_r, data_w)``
    (see :func:`request_fork`); one per process (a later call replaces ``connect``)."""
    _connect[:] = [connect]
    return _ServerContext()


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
    """Set up the server as spawn sets up a spawned child before it runs the main module:
    ``sys.argv``, the working directory, ``sys.path``, the original directory, the log level
    and the start method (NOTE [preloaded fork server])."""
    prepare({k: v for k, v in prep.items() if k not in _NOT_SERVER_PREP})


def _import_main(prep: dict[str, Any]) -> None:
    """Import the owner's main module as spawn would: by name for ``python -m``, else by path,
    as ``__mp_main__`` (``__name__ != "__main__"``, so the script's guard holds)."""
    main: dict[str, Any] = {k: prep[k] for k in ("init_main_from_name", "init_main_from_path") if k in prep}
    if main:
        import_main_as_spawn(main)


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


# --------------------------------------------------------------------------- NOTE [authenticated server]
# Anyone who can connect to a fork server's socket gets a process forked from it. The socket
# is private (a 0600 file or an abstract address), and on top of that, as CPython 3.14's own
# fork server does, every connection must answer a challenge before the server reads any fd
# or request from it: the server sends a random nonce, the client returns HMAC-SHA256 of it
# under the server's key, a random 32 bytes made per server and passed to it over its setup
# pipe (never on its command line or in its environment). A wrong or missing answer (or none
# within AUTH_TIMEOUT) closes the connection, logged at debug level, and the server goes on.
#
# NOTE [one connection]: an admitted connection stays open and carries any number of fork
# requests, one after another, until its client closes it. The owner opens one at its first
# request and keeps it as long as the server runs (``_Server._client``, under the server's
# lock), so it answers the challenge once per server, not once per worker: starting a worker
# costs one message to a server already listening on that connection, not a connect, an
# accept and three exchanges of the challenge (each a turn of the owner, then of the server)
# before each fork. A forked copy of the owner closes its copy of the connection
# (``_Server.in_child``). A request that the kept connection cannot carry (the server closed
# it) is sent once more over a new one, challenged again; one that a new connection cannot
# carry fails the start, and a server that died is replaced at the next start.
def _digest(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, _CHALLENGE + nonce, "sha256").digest()


def _receive(conn: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes; fewer only at EOF."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _admit(conn: socket.socket, key: bytes) -> bool:
    """Server side of NOTE [authenticated server]: whether ``conn`` knows ``key``."""
    nonce = os.urandom(_NONCE_BYTES)
    conn.settimeout(AUTH_TIMEOUT)
    try:
        conn.sendall(_CHALLENGE + nonce)
        answer = _receive(conn, len(_digest(key, nonce)))
        admitted = hmac.compare_digest(answer, _digest(key, nonce))
        if admitted:
            conn.sendall(_WELCOME)
    except OSError as exc:
        log.debug("fork server: refused a connection that failed to authenticate (%s)", exc)
        return False
    finally:
        with contextlib.suppress(OSError):
            conn.settimeout(None)
    if not admitted:
        log.debug("fork server: refused a connection that failed to authenticate (wrong answer)")
    return admitted


def _authenticate(conn: socket.socket, key: bytes) -> None:
    """Client side of NOTE [authenticated server].

    Raises:
        multiprocessing.AuthenticationError: the server refused ``key`` or spoke no challenge.
    """
    conn.settimeout(AUTH_TIMEOUT)
    try:
        hello = _receive(conn, len(_CHALLENGE) + _NONCE_BYTES)
        if not hello.startswith(_CHALLENGE) or len(hello) != len(_CHALLENGE) + _NONCE_BYTES:
            raise multiprocessing.AuthenticationError("the fork server sent no challenge")
        conn.sendall(_digest(key, hello[len(_CHALLENGE) :]))
        if _receive(conn, len(_WELCOME)) != _WELCOME:
            raise multiprocessing.AuthenticationError("the fork server refused our key")
    finally:
        conn.settimeout(None)


def _freeze_preloaded(collect: bool = True) -> None:
    """NOTE [frozen preload]: move every object the preload left (torch's, TorchRL's, the
    user's modules') to the collector's permanent generation, after collecting the garbage.

    A worker shares these pages with the server until it writes to them. A full collection
    in the worker writes the GC header of every object it tracks, so without this one full
    collection copies the whole preloaded heap into the worker: measured on TorchRL 0.15 (whose
    steps promote enough objects to run one within ~80 steps of a toy env), a healthy worker's
    USS went from 12 to 93 MiB at once, its RSS unchanged, and ``recycle_memory`` recycled it.
    Frozen objects are never scanned in the server or in any worker (nor in their forks, which
    inherit the permanent generation); what a worker creates is collected as usual.

    A zygote (NOTE [zygote]) freezes without collecting: a full collection of the owner's heap
    takes 0.2 s with torch loaded, most of a zygote's start; what garbage it holds is frozen with
    the rest, shared and never scanned.
    """
    if collect:
        gc.collect()
    gc.freeze()


def serve(
    listener_fd: int, alive_r: int, status_w: int, setup_r: int, owner_pid: int, arm_pdeathsig: bool
) -> None:
    """Entry point of the server process (see NOTE [preloaded fork server]). ``setup_r``
    carries the modules to preload, the owner's spawn preparation data and the key
    connections must prove they know (NOTE [authenticated server]), pickled."""
    if arm_pdeathsig and _platform.set_parent_death_signal(signal.SIGKILL) and os.getppid() != owner_pid:
        os._exit(1)  # the owner died before the signal was armed
    with open(setup_r, "rb", closefd=True) as setup:
        modules, prep, key = pickle.load(setup)
    _serve_preloaded(listener_fd, alive_r, status_w, key, functools.partial(_preload, modules, prep), True)


def _serve_preloaded(
    listener_fd: int, alive_r: int, status_w: int, key: bytes, preload: Callable[[], None], collect: bool
) -> None:
    """The server from its preload on: report it, freeze it, serve until the owner lets go."""
    global _server_pid
    _server_pid = os.getpid()
    try:
        preload()
    except _PreloadFailed as failed:
        message = {"module": failed.module, "traceback": failed.text}
        os.write(status_w, json.dumps(message).encode())
        os._exit(3)
    _freeze_preloaded(collect)
    os.register_at_fork(after_in_child=_fresh_random_state)
    os.write(status_w, b'{"ok": true}')
    os.close(status_w)
    try:
        serve_forkserver(listener_fd, alive_r, functools.partial(_admit, key=key))
    finally:
        # Its owner let go (the "alive" pipe reached EOF): leave without the interpreter's
        # teardown, which takes seconds with torch loaded; nothing here needs finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------------------- NOTE [zygote]
# When the owner is provably safe to fork at its first start (``_platform.fork_unsafe_reason``),
# the server is a fork of the owner (a zygote) rather than a new interpreter: it has everything
# the owner imported, so its start costs a fork instead of an import of torch. From the fork on
# it is the same server (the loop, the key, the tag in its own environment, its own process
# group, the parent-death signal, the status report), after it dropped what it must not keep
# from the owner (:func:`_become_zygote`).
def _become_zygote(keep: Sequence[int], tag: Tag, owner_pid: int, arm_pdeathsig: bool) -> None:
    """In the owner's fork that becomes the server: drop what belongs to the owner.

    What a worker forked from it inherits, as from ``fork``: the owner's modules and memory as
    they were at this moment (its ``__main__`` included: a factory defined there is found
    without importing the script again; named ``__mp_main__`` as under spawn), its open files
    and terminals, its environment (plus the server's tag), its working directory, ignored
    signals and signal mask. What it does not inherit: the owner's exec-time
    ``/proc/<pid>/environ`` (the server's tag shows there, as an interpreter server's does:
    ``_platform.show_environment``), its Python signal handlers and wakeup fd (reset to the
    defaults of a new interpreter), its exit handlers (``atexit``), ``multiprocessing``
    finalizers and children, its threads (none ran: NOTE [fork-safe now]), every registry of
    ours (``_lifecycle``'s envs, the reaper client, this module's own server: their fork
    handlers clear them), its pipes, sockets and anonymous descriptors (pointed at
    ``/dev/null``: ``_platform.neutralise_descriptors``) and its stdin (``/dev/null``, as a new
    server has)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if arm_pdeathsig and _platform.set_parent_death_signal(signal.SIGKILL) and os.getppid() != owner_pid:
        os._exit(1)  # the owner died before the signal was armed
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            elif callable(handler):
                signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    atexit._clear()
    multiprocessing.util._finalizer_registry.clear()  # type: ignore[attr-defined]
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]
    tracker_fd = getattr(multiprocessing.resource_tracker._resource_tracker, "_fd", None)
    _platform.neutralise_descriptors([*keep, *([tracker_fd] if isinstance(tracker_fd, int) else [])])
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:  # 0 itself when the owner had closed its stdin
        os.dup2(null, 0)
        os.close(null)
    _name_main_as_spawn()
    os.environ[_identity.OWNER_VAR] = str(tag)
    os.environ[_identity.WORKER_VAR] = TAG_SUFFIX
    # Its tag where the tag scans read it, as an interpreter server carries it since its exec.
    _platform.show_environment([_identity.OWNER_VAR, _identity.WORKER_VAR])


def _name_main_as_spawn() -> None:
    """The owner's main module, kept, under the name spawn gives the one it imports again in a
    worker (``__mp_main__``, so ``__name__ != "__main__"`` there as under spawn), where spawn
    would import it (a script, or a module run with ``-m``; not a package's ``__main__``)."""
    prep = preparation_data("zygote")
    name = prep.get("init_main_from_name")
    if "init_main_from_path" not in prep and (
        name is None or name == "__main__" or name.endswith(".__main__")
    ):
        return
    main = sys.modules["__main__"]
    main.__name__ = _cpython.MAIN_IMPORTED_AS
    sys.modules[_cpython.MAIN_IMPORTED_AS] = main


def _import_all(modules: Sequence[str]) -> None:
    """The zygote's preload: the modules the owner has not imported yet (``__main__`` it has)."""
    for name in modules:
        if name == "__main__":
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:
            raise _PreloadFailed(name, exc) from exc


class _ForkedServer:
    """The owner's handle on a zygote, its child: what ``subprocess.Popen`` offers for the
    interpreter server (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # collected elsewhere
                self.returncode = 255
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (PRELOAD_TIMEOUT if timeout is None else timeout)
        while not wait_for(lambda: self.poll() is not None, deadline, "the server exited"):
            if timeout is not None:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            deadline = time.monotonic() + PRELOAD_TIMEOUT
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- in the owner
class _Server:
    """The owner's side of the server: launched our way (tag, group, preload report, the key
    its connections must prove they know), replaced when it died, stopped at exit."""

    def __init__(self) -> None:
        self._server_lock = threading.RLock()
        self._wanted: list[str] = list(BASE_PRELOAD)
        self._proc: subprocess.Popen[bytes] | _ForkedServer | None = None
        self.key: _identity.ProcessKey | None = None
        #: ``"zygote"`` (a fork of this process) or ``"interpreter"`` (a new one) while one
        #: runs; written by ``_start_server``, cleared with the server.
        self.kind: str | None = None
        #: Why the running server is not a zygote (``_platform.fork_unsafe_reason``), if so.
        self.fallback: str | None = None
        self.address: str | None = None
        #: This process's connection to the server, admitted (NOTE [authenticated server]);
        #: opened by the first fork request, closed with the server or in a forked copy.
        self._client: socket.socket | None = None
        self._alive_fd: int | None = None
        self._authkey: bytes | None = None

    def want(self, modules: Iterable[str]) -> None:
        """Add modules to preload at the next launch (a running server keeps its own)."""
        with self._server_lock:
            for name in modules:
                if name and name not in self._wanted:
                    self._wanted.append(name)

    def ensure_running(self) -> None:
        with self._server_lock:
            ensure_resource_tracker()
            if self._proc is not None:
                if self._proc.poll() is None:
                    return
                log.warning(
                    "the preloaded fork server (pid %d) exited with code %s; starting a new one",
                    self._proc.pid,
                    self._proc.returncode,
                )
                self._forget()
            self._start_server()

    def connect_to_new_process(self, fds: Sequence[int]) -> tuple[int, int]:
        """Ask the server (started if needed) for a child inheriting ``fds``; returns
        ``(status_r, data_w)`` (see :func:`request_fork`)."""
        with self._server_lock:
            self.ensure_running()
            address, alive_fd, key = self.address, self._alive_fd, self._authkey
            assert address is not None and alive_fd is not None and key is not None
            while True:
                fresh = self._client is None
                if fresh:  # NOTE [one connection]
                    client = socket.socket(socket.AF_UNIX)
                    try:
                        client.connect(address)
                        _authenticate(client, key)
                    except BaseException:
                        client.close()
                        raise
                    self._client = client
                assert self._client is not None
                try:
                    return request_fork(self._client, alive_fd, fds)
                except OSError:
                    self._client.close()
                    self._client = None
                    if fresh:  # the server is gone or refuses us: the next start replaces it
                        raise
                    # The server closed the connection kept from before: ask over a new one.

    def _start_server(self) -> None:
        modules = ["__main__", *self._wanted]
        # NOTE [zygote]: checked now, right before the fork it allows.
        unsafe = _platform.fork_unsafe_reason()
        hint = " Call torchrl_ext.start_fork_server() before the program starts threads to pay it early."
        if unsafe is None:
            try:
                self._start_kind(modules, zygote=True)
                return
            except _NoReport as err:  # a crash of the fork, not an import: a new interpreter may work
                unsafe, hint = f"the zygote failed before its preload report ({err.exitcode})", ""
        log.info(
            "the preloaded fork server starts as a new interpreter (seconds: it imports torch "
            "again), not as a fork of this process: %s.%s",
            unsafe,
            hint,
        )
        self._start_kind(modules, zygote=False, fallback=unsafe)

    def _start_kind(self, modules: list[str], zygote: bool, fallback: str | None = None) -> None:
        """Start the server as a fork of this process (``zygote``) or a new interpreter, and
        wait for its preload report."""
        owner_pid, owner_ctime = _identity.me()
        tag = Tag(owner_pid, owner_ctime, f"{owner_pid}.{TAG_SUFFIX}")
        arm = _platform.parent_death_outlives_worker(None)  # the server is this thread's child
        key = os.urandom(32)  # NOTE [authenticated server]: over the setup pipe only
        with socket.socket(socket.AF_UNIX) as listener:
            address = new_unix_address()
            listener.bind(address)
            if not is_abstract_address(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            status_r, status_w = os.pipe()
            fds = (listener.fileno(), alive_r, status_w)
            try:
                if zygote:
                    proc: subprocess.Popen[bytes] | _ForkedServer = self._fork(
                        fds, alive_w, status_r, tag, owner_pid, arm, modules, key
                    )
                else:
                    proc = self._launch(fds, tag, owner_pid, arm, modules, key)
            except BaseException:
                os.close(alive_w)
                os.close(status_r)
                raise
            finally:
                os.close(alive_r)
                os.close(status_w)
        try:
            self._await_preload(proc, status_r, modules)
        except BaseException:
            os.close(alive_w)
            if proc.poll() is None:  # a hung preload, or an error reported before exiting
                proc.kill()
            proc.wait()
            if not is_abstract_address(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            raise
        finally:
            os.close(status_r)
        self._proc = proc
        self.kind, self.fallback = ("zygote", None) if zygote else ("interpreter", fallback)
        self.key = (proc.pid, _identity.start_time(psutil.Process(proc.pid)))
        self.address, self._alive_fd, self._authkey = address, alive_w, key
        _reaper_client.add_helper(*self.key)  # it ends with this process: not a leftover then
        log.debug("preloaded fork server pid %d (%s) ready (%s)", proc.pid, self.kind, ", ".join(modules))

    @staticmethod
    def _fork(
        fds: tuple[int, int, int],
        alive_w: int,
        status_r: int,
        tag: Tag,
        owner_pid: int,
        arm: bool,
        modules: list[str],
        key: bytes,
    ) -> _ForkedServer:
        """NOTE [zygote]: the server as a fork of this process."""
        listener_fd, alive_r, status_w = fds
        # What this process has buffered but not written would be written again by its forks.
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(alive_w)
                os.close(status_r)
                _become_zygote(fds, tag, owner_pid, arm)
                _serve_preloaded(
                    listener_fd, alive_r, status_w, key, functools.partial(_import_all, modules), False
                )
            except BaseException:  # the owner reports a server that exited before its report
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)
        with contextlib.suppress(OSError):  # it leads its own group from here on, whoever runs first
            os.setpgid(pid, pid)
        return _ForkedServer(pid)

    @staticmethod
    def _launch(
        fds: tuple[int, int, int], tag: Tag, owner_pid: int, arm: bool, modules: list[str], key: bytes
    ) -> subprocess.Popen[bytes]:
        """The server as a new interpreter that imports ``modules``."""
        # What spawn would set up in a child before it runs the main module (argv, cwd, sys.path,
        # the main module by path or by name); the server does the same before its preload.
        prep = {k: v for k, v in preparation_data("ignore").items() if k not in ("name", "authkey")}
        env = dict(os.environ)
        env[_identity.OWNER_VAR] = str(tag)
        env[_identity.WORKER_VAR] = TAG_SUFFIX
        setup_r, setup_w = os.pipe()
        args = (*fds, setup_r, owner_pid, arm)
        code = f"from torchrl_ext._forkserver import serve; serve(*{args!r})"
        try:
            proc = subprocess.Popen(
                [executable(), *interpreter_flags(), "-c", code],
                pass_fds=(*fds, setup_r),
                stdin=subprocess.DEVNULL,
                env=env,
                process_group=0,
            )
        except BaseException:
            os.close(setup_w)
            raise
        finally:
            os.close(setup_r)
        # A server that dies before reading this is reported by _await_preload.
        with contextlib.suppress(OSError), open(setup_w, "wb", closefd=True) as setup:
            pickle.dump((modules, prep, key), setup)
        return proc

    @staticmethod
    def _await_preload(
        proc: subprocess.Popen[bytes] | _ForkedServer, status_r: int, modules: list[str]
    ) -> None:
        chunks: list[bytes] = []

        def reported() -> bool:
            if not select.select([status_r], [], [], 0)[0]:
                return False
            chunks.append(os.read(status_r, 65536))
            # A whole report ends it too: a process the preload started may hold the pipe open.
            return not chunks[-1] or _complete(b"".join(chunks))

        deadline, reason = time.monotonic() + PRELOAD_TIMEOUT, "no preload report in time"
        # The status pipe wakes it: the slice only bounds a look.
        if not wait_for(reported, deadline, reason, sleep=on([status_r]), slice=1.0):
            raise PreloadError(
                f"the preloaded fork server (pid {proc.pid}) did not finish importing "
                f"{modules} within {PRELOAD_TIMEOUT:.0f} s; one of them hangs at import. Pass "
                "mp_start_method='spawn' to start workers without it."
            )
        data = b"".join(chunks)
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
        raise _NoReport(
            f"the preloaded fork server (pid {proc.pid}) exited with code "
            f"{format_exitcode(code)} before importing {modules}; its error is above on stderr. "
            "Pass mp_start_method='spawn' to start workers without it.",
            exitcode=f"pid {proc.pid}, exit code {format_exitcode(code)}; its error is on stderr",
        )

    def _forget(self) -> None:
        if self._alive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._alive_fd)
        if self.address and not is_abstract_address(self.address):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
        self.in_child()

    def stop(self, wait: float = STOP_WAIT) -> None:
        with self._server_lock:
            proc = self._proc
            if proc is None:
                return
            self._forget()  # closes our end of the "alive" pipe: the server exits when idle
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:  # raised by both kinds of server
                log.warning("the preloaded fork server (pid %d) did not exit; killing it", proc.pid)
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()

    def in_child(self) -> None:
        """A forked copy of the owner does not own the server."""
        if self._client is not None:  # this process's copy only: the owner's stays open
            self._client.close()
        self._proc = None
        self.key = None
        self.kind = self.fallback = None
        self.address = self._alive_fd = self._authkey = self._client = None


class _NoReport(PreloadError):
    """The server exited before it reported its preload: no module named, a crash of its own
    (a zygote that fails so falls back to a new interpreter: :meth:`_Server._start_server`)."""

    def __init__(self, message: str, exitcode: str) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def _complete(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


_SERVER = _Server()
os.register_at_fork(after_in_child=_SERVER.in_child)


#: A forkserver context whose processes are forks of the preloaded server.
_CONTEXT: multiprocessing.context.BaseContext = forkserver_context(_SERVER.connect_to_new_process)


def context(modules: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
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


def server_kind() -> tuple[str | None, str | None]:
    """The running server's kind (``"zygote"``, ``"interpreter"``, or ``None`` when none runs)
    and, for an interpreter, why it is not a zygote (NOTE [zygote])."""
    return _SERVER.kind, _SERVER.fallback


def stop() -> None:
    """End this process's server (it exits once idle; SIGKILL after ``STOP_WAIT``)."""
    _SERVER.stop()
