"""The CPython internals the package relies on: all declared here, with typed accessors for all
but the fork-server protocol's, which ``_forkserver`` holds whole.

NOTE [CPython internals]
------------------------
``multiprocessing`` documents processes, contexts and connections, not how a fork server is
launched and talked to, how a spawned child shows on its command line, or what a ``Process``
keeps in private attributes. We rely on all three. :data:`INVENTORY` declares each name, what it
is for, the shape we need and the one module that may use it (``owner``): this module, whose
accessors the others use, or ``_forkserver``, which holds the fork-server protocol whole
(``tests/test_cpython_compat.py`` scans the package). :func:`missing` checks them on the running
interpreter, and the test is generated from the inventory.

Example:
    >>> missing()
    []
    >>> spawned_kind(["-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"])
    'worker'
"""

from __future__ import annotations

import copy
import importlib
import inspect
import multiprocessing.popen_forkserver
import multiprocessing.process
import multiprocessing.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "INVENTORY",
    "MAIN_IMPORTED_AS",
    "ForkServerPopen",
    "Internal",
    "copy_unstarted_process",
    "daemon_in_config",
    "is_forkserver_child",
    "is_multiprocessing_helper",
    "missing",
    "process_kwargs",
    "process_start_method",
    "process_target",
    "release_exited_process",
    "run_exit_finalizers",
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
    naming it), ``"'text'"`` the string literal ``text``. ``owner`` is the one module of the
    package that may use it."""

    module: str
    name: str
    kind: Kind
    used_for: str
    params: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    owner: str = "_cpython"

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
    where: str,
    kind: Kind,
    used_for: str,
    params: str = "",
    markers: str = "",
    uses: str = "",
    owner: str = "_cpython",
) -> Internal:
    """``where`` is ``"module:name"``; ``params``, ``markers`` and ``uses`` are space-separated."""
    module, name = where.split(":")
    split = tuple(params.split()), tuple(markers.split()), tuple(uses.split())
    return Internal(module, name, kind, used_for, *split, owner)


_KINDS: tuple[Kind, Kind, Kind, Kind] = ("attribute", "callable", "instance", "source")
_A, _C, _I, _S = _KINDS

#: NOTE [CPython internals]: every CPython name the package relies on, what it is for.
# fmt: off
INVENTORY: tuple[Internal, ...] = (
    # ---- the preloaded fork server (_forkserver): CPython's protocol, our loop
    _entry("multiprocessing.forkserver:_serve_one", _C, "a forked child runs the process sent to it",
           "child_r fds unused_fds handlers", "_forkserver_alive_fd _inherited_fds spawn._main",
           owner="_forkserver"),
    _entry("multiprocessing.forkserver:read_signed", _C, "a forked child's pid and exit status", "fd",
           owner="_forkserver"),
    _entry("multiprocessing.forkserver:write_signed", _C, "the server sends a child's pid and exit status",
           "fd n", owner="_forkserver"),
    _entry("multiprocessing.reduction:recvfds", _C, "the server reads a fork request's fds", "sock size",
           owner="_forkserver"),
    _entry("multiprocessing.forkserver:MAXFDS_TO_SEND", _A, "how many fds one fork request may carry",
           owner="_forkserver"),
    _entry("multiprocessing.forkserver:ForkServer.ensure_running", _S, "CPython's server: argv marker "
           "(_tag, _sweep), launched by spawnv_passfds", "", "multiprocessing.forkserver spawnv_passfds",
           "'multiprocessing.forkserver' multiprocessing.forkserver.ForkServer"),
    _entry("multiprocessing.reduction:sendfds", _C, "sends a fork request's fds", "sock fds",
           owner="_forkserver"),
    _entry("multiprocessing.reduction:dump", _C, "pickles preparation data and the process", "obj file",
           owner="_forkserver"),
    _entry("multiprocessing.resource_tracker:getfd", _C, "the tracker fd each forked child gets",
           owner="_forkserver"),
    _entry("multiprocessing.resource_tracker:ensure_running", _C, "started before our server, untagged",
           owner="_forkserver"),
    _entry("multiprocessing.resource_tracker:ResourceTracker.ensure_running", _S, "argv marker (_sweep)",
           "", "multiprocessing.resource_tracker",
           "'resource_tracker' multiprocessing.resource_tracker.ResourceTracker"),
    _entry("multiprocessing.context:set_spawning_popen", _C, "set while a process is pickled", "popen",
           owner="_forkserver"),
    _entry("multiprocessing.context:ForkServerContext.Process", _A, "base of the preloaded context", "", "",
           "multiprocessing.context.ForkServerContext", owner="_forkserver"),
    _entry("multiprocessing.context:ForkServerProcess._Popen", _C, "overridden: fork from our server",
           "process_obj", "", "multiprocessing.context.ForkServerProcess", owner="_forkserver"),
    _entry("multiprocessing.context:ForkServerProcess._start_method", _A, "a process's start method",
           "", "", "._start_method"),
    _entry("multiprocessing.popen_forkserver:Popen._launch", _C, "our child Popen's base (its class tells "
           "a forkserver child; _forkserver extends it as ForkServerPopen); _launch is ours",
           "self process_obj", "", "multiprocessing.popen_forkserver.Popen"),
    _entry("multiprocessing.popen_forkserver:Popen.__init__", _S, "the fds a fork request carries", "",
           "_fds", "._fds", owner="_forkserver"),
    _entry("multiprocessing.connection:arbitrary_address", _C, "our server's socket path", "family",
           owner="_forkserver"),
    _entry("multiprocessing.util:is_abstract_socket_namespace", _C, "whether it is a file", "address",
           owner="_forkserver"),
    _entry("multiprocessing.util:Finalize", _C, "finalize(): a child's fds close with its Popen "
           "(_forkserver); a ledger closes before multiprocessing joins its children (data/)",
           "obj callback args exitpriority"),
    _entry("multiprocessing.util:close_fds", _C, "that finalizer's callback", "fds", owner="_forkserver"),
    _entry("multiprocessing.spawn:get_preparation_data", _C, "what spawn sets up in a child", "name",
           owner="_forkserver"),
    _entry("multiprocessing.spawn:prepare", _C, "sets our server up as a spawned child", "data",
           owner="_forkserver"),
    _entry("multiprocessing.spawn:get_executable", _C, "the interpreter our server runs",
           owner="_forkserver"),
    _entry("multiprocessing.spawn:_check_not_importing_main", _S, "set while our server imports __main__",
           "", "_inheriting", "._inheriting", owner="_forkserver"),
    _entry("multiprocessing.spawn:_fixup_main_from_path", _S, "the name spawn imports __main__ as (_env)",
           "", "__mp_main__", "'__mp_main__'"),
    _entry("subprocess:_args_from_interpreter_flags", _C, "our server gets the owner's -X/-W flags",
           owner="_forkserver"),
    # ---- tagged at birth (_tag)
    _entry("multiprocessing.util:spawnv_passfds", _C, "scoped patch: spawned children carry the tag",
           "path args passfds"),
    _entry("multiprocessing.spawn:get_command_line", _S, "the argv marker of a spawned child", "",
           "--multiprocessing-fork", "'--multiprocessing-fork'"),
    _entry("multiprocessing.popen_spawn_posix:Popen._launch", _S, "spawns through spawnv_passfds", "",
           "spawnv_passfds", "multiprocessing.popen_spawn_posix.Popen"),
    # ---- process objects (_keeper, _env, _worker, _supervisor)
    _entry("multiprocessing.process:BaseProcess._config", _I, "copied per restart; daemon flag (_worker)"),
    _entry("multiprocessing.process:BaseProcess._popen", _I, "reset per restart; tells a forkserver child"),
    _entry("multiprocessing.process:BaseProcess._closed", _I, "reset per restart"),
    _entry("multiprocessing.process:BaseProcess._kwargs", _I, "a worker's kwargs, replaced per restart"),
    _entry("multiprocessing.process:BaseProcess._name", _I, "renamed per restart"),
    _entry("multiprocessing.process:BaseProcess._target", _I, "tells TorchRL's worker processes apart"),
    _entry("multiprocessing.process:BaseProcess._args", _I, "kept by a restart copy (start() drops it)"),
    _entry("multiprocessing.process:BaseProcess.start", _S, "what a hosted slot's process shares with "
           "its host's (share_popen)", "", "_sentinel", "._sentinel"),
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


def share_popen(member: Any, host: Any) -> None:
    """Make the unstarted ``member`` answer as the started ``host`` (``_hosts``): its pid,
    sentinel, ``is_alive()``, ``join()`` and ``exitcode`` are the host's; its target and kwargs
    are dropped as ``start()`` drops them. Only the host is in ``active_children()``: one
    process."""
    member._popen = host._popen
    member._sentinel = host._popen.sentinel
    del member._target, member._args, member._kwargs  # as start() drops them


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


#: The ``Popen`` class of a fork server's children: ``multiprocessing``'s, and ours extend it.
ForkServerPopen = multiprocessing.popen_forkserver.Popen


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


def finalize(
    obj: Any, callback: Callable[..., Any], args: tuple[Any, ...] = (), exitpriority: int | None = None
) -> multiprocessing.util.Finalize[Any]:
    """``callback(*args)`` once: when called, when ``obj`` is collected, or, with
    ``exitpriority``, at this process's clean exit, a ``multiprocessing`` child's included, and
    before ``multiprocessing`` joins its children there (``multiprocessing.util.Finalize``)."""
    return multiprocessing.util.Finalize(obj, callback, args, exitpriority=exitpriority)


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
