"""Every CPython internal the package relies on, in one place: typed accessors and the inventory.

NOTE [CPython internals]
------------------------
``multiprocessing`` documents processes, contexts and connections, not how a fork server is
launched and talked to, how a spawned child shows on its command line, or what a ``Process``
keeps in private attributes. We rely on all three; only this module touches those names
(``tests/test_cpython_compat.py`` scans the package), the others use its accessors.
:data:`INVENTORY` declares each name, what it is for and the shape we need; :func:`missing`
checks them on the running interpreter, and the test is generated from the inventory.

Example:
    >>> missing()
    []
    >>> spawned_kind(["-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"])
    'worker'
"""

from __future__ import annotations

import copy
import errno
import importlib
import inspect
import io
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.process
import multiprocessing.reduction
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "INVENTORY",
    "MAIN_IMPORTED_AS",
    "Internal",
    "copy_unstarted_process",
    "daemon_in_config",
    "ensure_resource_tracker",
    "executable",
    "forkserver_context",
    "import_main_as_spawn",
    "interpreter_flags",
    "is_abstract_address",
    "is_forkserver_child",
    "is_multiprocessing_helper",
    "missing",
    "new_unix_address",
    "preparation_data",
    "prepare",
    "process_kwargs",
    "process_start_method",
    "process_target",
    "release_exited_process",
    "request_fork",
    "run_exit_finalizers",
    "serve_forkserver",
    "set_daemon_in_config",
    "set_process_kwargs",
    "spawn_patch_target",
    "spawned_kind",
]

Kind = Literal["attribute", "callable", "instance", "source"]


@dataclass(frozen=True)
class Internal:
    """One CPython name we rely on. ``kind``: ``"attribute"`` (defined on its module or class
    itself), ``"callable"`` (accepting ``params``), ``"instance"`` (on every new instance of its
    class) or ``"source"`` (a function whose source shows ``markers``; callables may have them).
    ``uses`` (default: from the name) is what a use looks like to the scan in the test:
    ``"pkg.mod.name"`` a dotted reference, ``"._attr"`` an attribute (or a string or keyword
    naming it), ``"'text'"`` the string literal ``text``."""

    module: str
    name: str
    kind: Kind
    used_for: str
    params: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def needles(self) -> tuple[str, ...]:
        if self.uses:
            return self.uses
        if self.kind == "instance":
            return ("." + self.name.rsplit(".", 1)[1],)
        return (self.label,)


def _entry(
    where: str, kind: Kind, used_for: str, params: str = "", markers: str = "", uses: str = ""
) -> Internal:
    """``where`` is ``"module:name"``; ``params``, ``markers`` and ``uses`` are space-separated."""
    module, name = where.split(":")
    return Internal(
        module, name, kind, used_for, tuple(params.split()), tuple(markers.split()), tuple(uses.split())
    )


_KINDS: tuple[Kind, Kind, Kind, Kind] = ("attribute", "callable", "instance", "source")
_A, _C, _I, _S = _KINDS

#: NOTE [CPython internals]: every CPython name the package relies on, what it is for.
# fmt: off
INVENTORY: tuple[Internal, ...] = (
    # ---- the preloaded fork server (_forkserver); a refused connection is skipped as ECONNABORTED
    _entry("multiprocessing.forkserver:main", _C, "our server's loop", "listener_fd alive_r preload",
           "ECONNABORTED .accept()"),
    _entry("multiprocessing.forkserver:socket", _A, "main()'s listener module: ours authenticates"),
    _entry("multiprocessing.forkserver:read_signed", _C, "a forked child's pid and exit status", "fd"),
    _entry("multiprocessing.forkserver:MAXFDS_TO_SEND", _A, "how many fds one fork request may carry"),
    _entry("multiprocessing.forkserver:ForkServer.ensure_running", _S, "CPython's server: argv marker "
           "(_tag, _sweep), launched by spawnv_passfds", "", "multiprocessing.forkserver spawnv_passfds",
           "'multiprocessing.forkserver' multiprocessing.forkserver.ForkServer"),
    _entry("multiprocessing.reduction:sendfds", _C, "sends a fork request's fds", "sock fds"),
    _entry("multiprocessing.reduction:dump", _C, "pickles preparation data and the process", "obj file"),
    _entry("multiprocessing.resource_tracker:getfd", _C, "the tracker fd each forked child gets"),
    _entry("multiprocessing.resource_tracker:ensure_running", _C, "started before our server, untagged"),
    _entry("multiprocessing.resource_tracker:ResourceTracker.ensure_running", _S, "argv marker (_sweep)",
           "", "multiprocessing.resource_tracker",
           "'resource_tracker' multiprocessing.resource_tracker.ResourceTracker"),
    _entry("multiprocessing.context:set_spawning_popen", _C, "set while a process is pickled", "popen"),
    _entry("multiprocessing.context:ForkServerContext.Process", _A, "base of the preloaded context", "", "",
           "multiprocessing.context.ForkServerContext"),
    _entry("multiprocessing.context:ForkServerProcess._Popen", _C, "overridden: fork from our server",
           "process_obj", "", "multiprocessing.context.ForkServerProcess"),
    _entry("multiprocessing.context:ForkServerProcess._start_method", _A, "a process's start method",
           "", "", "._start_method"),
    _entry("multiprocessing.popen_forkserver:Popen._launch", _C, "our child Popen's base (its class tells "
           "a forkserver child); _launch is ours", "self process_obj", "",
           "multiprocessing.popen_forkserver.Popen"),
    _entry("multiprocessing.popen_forkserver:Popen.__init__", _S, "the fds a fork request carries", "",
           "_fds", "._fds"),
    _entry("multiprocessing.connection:arbitrary_address", _C, "our server's socket path", "family"),
    _entry("multiprocessing.util:is_abstract_socket_namespace", _C, "whether it is a file", "address"),
    _entry("multiprocessing.util:Finalize", _C, "closes a child's fds with its Popen", "obj callback args"),
    _entry("multiprocessing.util:close_fds", _C, "that finalizer's callback", "fds"),
    _entry("multiprocessing.spawn:get_preparation_data", _C, "what spawn sets up in a child", "name"),
    _entry("multiprocessing.spawn:prepare", _C, "sets our server up as a spawned child", "data"),
    _entry("multiprocessing.spawn:get_executable", _C, "the interpreter our server runs"),
    _entry("multiprocessing.spawn:_check_not_importing_main", _S, "set while our server imports __main__",
           "", "_inheriting", "._inheriting"),
    _entry("multiprocessing.spawn:_fixup_main_from_path", _S, "the name spawn imports __main__ as (_env)",
           "", "__mp_main__", "'__mp_main__'"),
    _entry("subprocess:_args_from_interpreter_flags", _C, "our server gets the owner's -X/-W flags"),
    # ---- tagged at birth (_tag)
    _entry("multiprocessing.util:spawnv_passfds", _C, "scoped patch: spawned children carry the tag",
           "path args passfds"),
    _entry("multiprocessing.spawn:get_command_line", _S, "the argv marker of a spawned child", "",
           "--multiprocessing-fork", "'--multiprocessing-fork'"),
    _entry("multiprocessing.popen_spawn_posix:Popen._launch", _S, "spawns through spawnv_passfds", "",
           "spawnv_passfds", "multiprocessing.popen_spawn_posix.Popen"),
    # ---- process objects (_restart, _env, _worker, _supervisor)
    _entry("multiprocessing.process:BaseProcess._config", _I, "copied per restart; daemon flag (_worker)"),
    _entry("multiprocessing.process:BaseProcess._popen", _I, "reset per restart; tells a forkserver child"),
    _entry("multiprocessing.process:BaseProcess._closed", _I, "reset per restart"),
    _entry("multiprocessing.process:BaseProcess._kwargs", _I, "a worker's kwargs, replaced per restart"),
    _entry("multiprocessing.process:BaseProcess._name", _I, "preparation data name; renamed per restart"),
    _entry("multiprocessing.process:BaseProcess._target", _I, "tells TorchRL's worker processes apart"),
    _entry("multiprocessing.process:BaseProcess._args", _I, "kept by a restart copy (start() drops it)"),
    _entry("multiprocessing.popen_fork:Popen.close", _C, "releases an exited worker's fds; its Process "
           "keeps answering is_alive()", "self"),
    _entry("multiprocessing.util:_exit_function", _C, "multiprocessing's finalizers before os._exit"),
)
# fmt: on


# --------------------------------------------------------------------------- the check
def _owner_and_last(entry: Internal) -> tuple[Any, str]:
    owner: Any = importlib.import_module(entry.module)
    *path, last = entry.name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, last


def _problem(entry: Internal) -> str | None:
    try:
        owner, last = _owner_and_last(entry)
    except (ImportError, AttributeError) as exc:
        return f"not found ({exc})"
    if entry.kind == "instance":
        try:
            instance = owner()
        except Exception as exc:
            return f"{owner!r}() failed ({exc})"
        return None if last in vars(instance) else f"new {owner.__name__} instances have no {last}"
    if last not in vars(owner):
        return "not defined there"
    value = getattr(owner, last)
    if entry.kind == "callable":
        if not callable(value):
            return "not callable"
        try:
            names = set(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            return "no signature"
        lacking = [p for p in entry.params if p not in names]
        if lacking:
            return f"takes no {lacking}"
    if entry.markers:
        try:
            text = inspect.getsource(value)
        except (OSError, TypeError):
            return "no source"
        lacking = [m for m in entry.markers if m not in text]
        if lacking:
            return f"its source shows no {lacking}"
    return None


def missing(entries: Sequence[Internal] = INVENTORY) -> list[str]:
    """Labels of the declared names this interpreter lacks or has in another shape, with why.

    Example:
        >>> missing([Internal("os", "no_such_name", "attribute", "nothing")])
        ['os.no_such_name: not defined there']
    """
    found = []
    for entry in entries:
        problem = _problem(entry)
        if problem is not None:
            found.append(f"{entry.label}: {problem}")
    return found


# --------------------------------------------------------------------------- process objects
#: The module name spawn (and our server) imports the main script as.
MAIN_IMPORTED_AS = "__mp_main__"


def process_target(process: Any) -> Any:
    """The target of an unstarted process (``None`` once started, or if it has none)."""
    return getattr(process, "_target", None)


def process_kwargs(process: Any) -> dict[str, Any]:
    """The keyword arguments an unstarted process will call its target with."""
    return process._kwargs


def set_process_kwargs(process: Any, kwargs: dict[str, Any]) -> None:
    """Replace the keyword arguments of an unstarted process."""
    process._kwargs = kwargs


def process_start_method(process: Any) -> str | None:
    """The start method of a process's class (``None`` for a bare ``BaseProcess``)."""
    method = getattr(process, "_start_method", None)
    return None if method is None else str(method)


def release_exited_process(process: Any) -> None:
    """Close the fds (sentinel pipes) a started ``process`` holds once its exit status is
    collected; the object keeps answering ``is_alive()`` and ``exitcode``, unlike after
    ``Process.close()``. Does nothing while its status is not collected."""
    popen = process.__dict__.get("_popen")
    if popen is not None and popen.returncode is not None:
        popen.close()  # its finalizer closes the fds; returncode stays


def copy_unstarted_process(template: Any, kwargs: dict[str, Any], name: str) -> Any:
    """A new, unstarted process like the unstarted ``template``, calling its target with
    ``kwargs``, named ``name``.

    Example:
        >>> import multiprocessing
        >>> p = multiprocessing.Process(target=print, kwargs={"end": ""}, name="w-1")
        >>> q = copy_unstarted_process(p, {"sep": ","}, "w-restart1")
        >>> q.name, process_kwargs(q), process_kwargs(p), process_target(q) is print
        ('w-restart1', {'sep': ','}, {'end': ''}, True)
    """
    process = copy.copy(template)
    process._config = dict(template._config)
    process._popen = None
    process._closed = False
    process._kwargs = kwargs
    process._name = name
    return process


def is_forkserver_child(process: Any) -> bool:
    """Whether ``process`` was started by a fork server (``multiprocessing``'s or ours): its
    exit status then comes from the server, not from ``waitpid``."""
    return isinstance(getattr(process, "_popen", None), multiprocessing.popen_forkserver.Popen)


def daemon_in_config(process: Any) -> bool:
    """The daemon flag in a process's config (what forbids a daemonic process children)."""
    return bool(process._config.get("daemon"))


def set_daemon_in_config(process: Any, daemon: bool) -> None:
    """Set that flag (on the current process: whether it may start children)."""
    process._config["daemon"] = daemon


def run_exit_finalizers() -> None:
    """Run ``multiprocessing``'s exit finalizers now (before an ``os._exit``); joins children."""
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- spawning
def spawned_kind(args: Sequence[str | bytes]) -> Literal["worker", "forkserver"] | None:
    """What ``multiprocessing`` is exec'ing, from its argv: ``"worker"`` (a spawned child),
    ``"forkserver"`` (CPython's fork server) or ``None`` (the resource tracker, ...)."""
    text = [os.fsdecode(arg) for arg in args]  # str or bytes, as multiprocessing builds them
    if "--multiprocessing-fork" in text:
        return "worker"
    if any("multiprocessing.forkserver" in arg for arg in text):
        return "forkserver"
    return None


def is_multiprocessing_helper(command_line: str) -> bool:
    """Whether a command line is CPython's fork server or resource tracker."""
    return "multiprocessing.forkserver" in command_line or "resource_tracker" in command_line


def spawn_patch_target() -> tuple[ModuleType, str]:
    """Where ``multiprocessing`` looks up the function that execs spawned children and its
    fork server (``_tag`` patches it, scoped)."""
    return multiprocessing.util, "spawnv_passfds"


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


# --------------------------------------------------------------------------- fork-server protocol
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


class _AdmittingSocketModule:
    """Stands in for the ``socket`` module in ``multiprocessing.forkserver`` inside our server:
    the same module, except that its listener accepts only what ``admit`` admits."""

    def __init__(self, admit: Callable[[socket.socket], bool]) -> None:
        class AdmittingListener(socket.socket):
            def accept(self) -> tuple[socket.socket, Any]:
                conn, address = super().accept()
                if admit(conn):
                    return conn, address
                conn.close()
                # main() skips an aborted connection and goes on serving.
                raise ConnectionAbortedError(errno.ECONNABORTED, "fork request refused")

        self.socket = AdmittingListener

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)


def serve_forkserver(listener_fd: int, alive_r: int, admit: Callable[[socket.socket], bool]) -> None:
    """Run CPython's fork-server loop on ``listener_fd`` until ``alive_r`` reaches EOF; every
    connection must pass ``admit(conn)`` before its fds or request are read. A refused
    connection is closed and the loop goes on. Forked children get the plain module back."""
    module = multiprocessing.forkserver

    def restore() -> None:
        setattr(module, "socket", socket)  # noqa: B010  (a module attribute typeshed lacks)

    setattr(module, "socket", _AdmittingSocketModule(admit))  # noqa: B010
    os.register_at_fork(after_in_child=restore)
    try:
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    finally:
        restore()


_connect: list[Callable[[Sequence[int]], tuple[int, int]]] = []


class _ServerChild(multiprocessing.popen_forkserver.Popen):
    """A child forked by the server :func:`forkserver_context` was given. Its exit status is
    read under a lock: two threads reading it at once (a supervisor's and the main thread's)
    would make one of them see EOF and record 255 (``multiprocessing``'s own forkserver
    ``Popen`` has that race)."""

    def __init__(self, process_obj: Any) -> None:
        self._status_lock = threading.Lock()
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        data = io.BytesIO()
        prep = multiprocessing.spawn.get_preparation_data(process_obj._name)
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
