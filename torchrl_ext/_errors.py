"""Exceptions raised by torchrl-ext. Each subclasses what TorchRL users already catch.

See ``docs/troubleshooting.md`` for every error's cause and fix.
"""

from __future__ import annotations

import pickle
import re
import signal
from dataclasses import dataclass
from typing import Any

from ._platform import signal_name

__all__ = [
    "DaemonicParentError",
    "DaemonicWorkerError",
    "OomKill",
    "PreloadError",
    "RemoteTraceback",
    "UnsupportedTorchRLError",
    "WorkerDiedError",
    "WorkerEnvError",
    "WorkerHungError",
    "WorkerStartTimeoutError",
    "format_exitcode",
    "hint_for_exitcode",
    "named_as_upstream",
    "unpicklable_note",
]

_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: "SIGKILL: likely out of memory (the kernel's OOM killer; check `dmesg` or the "
    "container's memory limit) unless someone ran `kill -9`; lower `num_workers`, the DataLoader's "
    "`num_workers`/`prefetch_factor`, or the size of what each episode keeps in memory.",
    signal.SIGBUS: "SIGBUS: shared memory too small, usually: /dev/shm is too small "
    "(Docker: `--shm-size=8g`); or use fewer workers.",
    signal.SIGSEGV: "SIGSEGV: native crash in the env or a library it calls; "
    "run the env in the main process (`SerialEnv`) with `python -X faulthandler` to see where.",
    signal.SIGABRT: "SIGABRT means native code in the environment aborted (failed assertion or "
    "C++ exception); its stderr above usually says why.",
    signal.SIGTERM: "SIGTERM came from outside this library (a scheduler, `kill`, a container "
    "stop); nothing to fix in the environment.",
}


def format_exitcode(exitcode: int | None) -> str:
    """Render an exit code the way users read it: ``-9`` -> ``"SIGKILL(-9)"``, ``3`` -> ``"3"``.

    >>> format_exitcode(-9)
    'SIGKILL(-9)'
    """
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        return f"{signal_name(-exitcode)}({exitcode})"
    return str(exitcode)


def hint_for_exitcode(exitcode: int | None) -> str:
    """A one-line hint about what an exit code usually means."""
    if exitcode is not None and exitcode < 0:
        hint = _SIGNAL_HINTS.get(-exitcode)
        if hint:
            return hint
        return f"the worker was ended by {signal_name(-exitcode)}."
    if exitcode == 0:
        return "the worker exited by itself without being asked to (an `os._exit`/`sys.exit` in the env?)."
    return (
        "the worker exited with an error; its stderr above shows the traceback. A worker that "
        "ends without a traceback may have called `os._exit`."
    )


#: Our class, and the TorchRL class a user's code names where it swapped the import.
_OURS, _THEIRS = "ManagedParallelEnv", "ParallelEnv"
_OURS_WORD = re.compile(rf"\b{_OURS}\b(?!\[)")  # not our own label, "ManagedParallelEnv[env id]"


def named_as_upstream(err: BaseException, env: Any) -> None:
    """An error TorchRL's own code raised about a ``ManagedParallelEnv`` names the class as
    upstream's names it (``ParallelEnv``), as the user's code that swapped the import expects.

    TorchRL builds some messages from ``type(self).__name__`` ("The environment passed to
    ParallelEnv has empty specs ..."). The exception is changed in place (same object, type,
    traceback and chain); one raised elsewhere (ours, the env's in a worker), or about a
    subclass of ours (upstream would name that subclass too), is left as it is.

    Example:
        >>> class ManagedParallelEnv: ...
        >>> err = RuntimeError("ManagedParallelEnv worker 0 died")  # not raised by TorchRL
        >>> named_as_upstream(err, ManagedParallelEnv()); str(err)
        'ManagedParallelEnv worker 0 died'
    """
    cls = type(env)
    if cls.__name__ != _OURS or not cls.__module__.startswith("torchrl_ext"):
        return
    tb = err.__traceback__
    if tb is None:
        return
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    if not (module == "torchrl" or module.startswith("torchrl.")):
        return
    err.args = tuple(_OURS_WORD.sub(_THEIRS, a) if isinstance(a, str) else a for a in err.args)


def _pickling_error(obj: Any, pickler: Any) -> str | None:
    """Why ``pickler.dumps(obj)`` fails (``None``: it pickles)."""
    try:
        pickler.dumps(obj)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def unpicklable_note(factory: Any, kwargs: Any, *, name: str, start: str, destination: str) -> str | None:
    """The note for an error raised while a factory and its kwargs were pickled for a new process:
    which of the two does not pickle, why a pickle was needed, and the fixes; ``None`` when both
    pickle (the error is about something else).

    ``factory`` is probed as TorchRL sends it (``CloudpickleWrapper``: cloudpickle, so lambdas and
    closures pickle), ``kwargs`` as ``multiprocessing`` does (plain pickle); ``name`` is the
    factory as the user knows it, ``start`` the start path, ``destination`` the process it was
    for (``"worker 1"``).

    Example:
        >>> import threading
        >>> lock = threading.Lock()
        >>> note = unpicklable_note(lambda: lock, {}, name="make", start="mp_start_method='spawn'",
        ...                         destination="worker 0")
        >>> note.splitlines()[0]
        "torchrl_ext: the env factory make of worker 0 cannot be pickled (TypeError: cannot pickle ..."
    """
    import cloudpickle  # only once a start failed

    why = _pickling_error(factory, cloudpickle)
    if why is not None:
        what = f"the env factory {name} of {destination}"
        fix = (
            "Fix: have the factory create what does not pickle (a lock, an open file, a "
            "connection, a client) itself instead of capturing it or taking it as an argument: a "
            "module-level function, or a functools.partial of one whose arguments pickle"
        )
    else:
        why = _pickling_error(dict(kwargs or {}), pickle)
        if why is None:
            return None
        what = f"the create_env_kwargs of {destination}"
        fix = (
            "Fix: pass only values that pickle in create_env_kwargs and create the others inside the factory"
        )
    return (
        f"torchrl_ext: {what} cannot be pickled ({why}),\n"
        f"and starting it with {start} sends it there pickled. {fix}; or pass "
        "mp_start_method='fork', which pickles nothing. (TorchRL's EnvCreator does not help: it "
        "pickles the factory it wraps.)"
    )


@dataclass(frozen=True)
class OomKill:
    """The kernel's OOM killer killed a worker: its memory cgroup counted the kill.

    Example:
        >>> str(OomKill("/sys/fs/cgroup/job", limit=2 << 30, tree_rss=None))
        "the kernel's OOM killer (memory cgroup /sys/fs/cgroup/job, limit 2048 MiB)"
    """

    #: The cgroup directory whose ``oom_kill`` count grew at the worker's death.
    cgroup: str
    #: Its memory limit in bytes (``None``: none set there; a parent cgroup's may have applied).
    limit: int | None
    #: The worker's tree (it and its descendants) at the last sample, bytes (``None``: not sampled).
    tree_rss: int | None

    def __str__(self) -> str:
        limit = "no limit of its own" if self.limit is None else f"limit {self.limit >> 20} MiB"
        rss = (
            ""
            if self.tree_rss is None
            else f"; the worker's tree had {self.tree_rss >> 20} MiB resident at the last sample"
        )
        return f"the kernel's OOM killer (memory cgroup {self.cgroup}, {limit}{rss})"


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised inside a worker process.

    Attached as ``__cause__`` of the exception re-raised in the main process: the one copy of
    the worker's traceback, under the worker's ``multiprocessing`` process name as upstream's
    workers print it (``Process ForkProcess-1:``), when the worker reported it.

    Example:
        >>> str(RemoteTraceback("Traceback ...", "SpawnProcess-1")).splitlines()[2:4]
        ['Process SpawnProcess-1:', 'Traceback ...']
    """

    def __init__(self, tb: str, process_name: str | None = None) -> None:
        super().__init__(tb)
        self.tb = tb
        #: The worker's ``multiprocessing`` process name (``None``: not reported).
        self.process_name = process_name

    def __str__(self) -> str:
        head = f"Process {self.process_name}:\n" if self.process_name else ""
        return f'\n"""\n{head}{self.tb}"""'

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tb, self.process_name))


class WorkerDiedError(RuntimeError):
    """A worker process of a :class:`~torchrl_ext.ManagedParallelEnv` died.

    Raised by the pending or next ``step``/``reset``/``rollout`` after a worker was killed
    (SIGKILL, segfault, ``os._exit``, out of memory). The dead worker's whole process tree has
    already been killed and reaped; the surviving workers are still there, so call
    ``env.close()`` and build a new env.

    Example:
        >>> err = WorkerDiedError(worker_index=1, pid=4242, exitcode=-9, last_command="step")
        >>> "SIGKILL(-9)" in str(err)
        True
    """

    def __init__(
        self,
        worker_index: int,
        pid: int | None,
        exitcode: int | None,
        last_command: str | None = None,
        detail: str | None = None,
        oom: OomKill | None = None,
    ) -> None:
        self.worker_index = worker_index
        self.pid = pid
        self.exitcode = exitcode
        self.last_command = last_command
        self.detail = detail
        #: Set when the worker's memory cgroup counted an OOM kill at its death (see OomKill).
        self.oom = oom
        self.hint = self._hint()
        message = self._message()
        if detail:
            message += f" ({detail})"
        super().__init__(message)

    def _hint(self) -> str:
        if self.oom is not None:
            return (
                f"SIGKILL by {self.oom}. Give the job more memory, or lower `num_workers`, the "
                "DataLoader's `num_workers`/`prefetch_factor`, or what each episode keeps in memory."
            )
        return hint_for_exitcode(self.exitcode)

    def _message(self) -> str:
        return (
            f"ManagedParallelEnv worker {self.worker_index} (pid {self.pid}) died with exit code "
            f"{format_exitcode(self.exitcode)} while handling {self.last_command or 'no command'!r}. "
            f"Hint: {self.hint} Its process tree was killed and reaped; call env.close() and "
            "create a new environment."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.worker_index, self.pid, self.exitcode, self.last_command, self.detail, self.oom),
        )


class WorkerHungError(WorkerDiedError):
    """A worker did not answer a command within ``step_timeout`` seconds and was killed.

    Raised like :class:`WorkerDiedError` (which it subclasses) when the env has no restart
    left (``max_restarts``); with restarts left, the slot is restarted instead.

    ``stacks`` is what every thread of the worker was doing when it was killed (Python's
    ``faulthandler`` dump, asked for at most 0.5 s before the kill), ``None`` if it said nothing
    in time; it is also a note of the exception, so a traceback shows it.

    Example:
        >>> err = WorkerHungError(worker_index=0, pid=4242, last_command="step", timeout=5.0)
        >>> isinstance(err, WorkerDiedError), err.timeout, err.stacks
        (True, 5.0, None)
    """

    def __init__(
        self,
        worker_index: int,
        pid: int | None,
        last_command: str | None,
        timeout: float,
        detail: str | None = None,
        stacks: str | None = None,
    ) -> None:
        self.timeout = timeout
        self.stacks = stacks
        super().__init__(worker_index, pid, -signal.SIGKILL, last_command, detail)
        if stacks:
            self.add_note(f"Where worker {worker_index} (pid {pid}) hung, every thread:\n{stacks}")

    def _hint(self) -> str:
        return (
            f"the worker did not answer {self.last_command or 'its command'!r} within step_timeout="
            f"{self.timeout:g}s (a hung simulator, a deadlock, a stuck read?); it and its process tree "
            "were killed. Raise `step_timeout` if such a step can legitimately take longer, or set "
            "`max_restarts` to replace hung workers and keep going."
        )

    def _message(self) -> str:
        return (
            f"ManagedParallelEnv worker {self.worker_index} (pid {self.pid}) hung: no answer to "
            f"{self.last_command or 'no command'!r} within {self.timeout:g}s. Hint: {self.hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.worker_index, self.pid, self.last_command, self.timeout, self.detail, self.stacks),
        )


class WorkerStartTimeoutError(WorkerHungError):
    """A worker did not build its env within ``start_timeout`` seconds and was killed with its
    tree (raised once no restart is left for it; with restarts left, it is started again).

    Example:
        >>> err = WorkerStartTimeoutError(1, 4242, timeout=30.0, factory="make_sim")
        >>> isinstance(err, WorkerHungError), err.factory
        (True, 'make_sim')
    """

    def __init__(
        self,
        worker_index: int,
        pid: int | None,
        timeout: float,
        factory: str,
        detail: str | None = None,
        stacks: str | None = None,
    ) -> None:
        self.factory = factory
        super().__init__(worker_index, pid, "start-up", timeout, detail, stacks)

    def _hint(self) -> str:
        return (
            f"its factory {self.factory} had not returned; it and its process tree were killed. "
            f"Raise `start_timeout` if building this env can take longer (a spawned worker imports "
            "torch first), or find what the factory waits for in the stacks below."
        )

    def _message(self) -> str:
        return (
            f"ManagedParallelEnv worker {self.worker_index} (pid {self.pid}) did not build its env "
            f"within start_timeout={self.timeout:g}s. Hint: {self.hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.worker_index, self.pid, self.timeout, self.factory, self.detail, self.stacks),
        )


class WorkerEnvError(RuntimeError):
    """An exception raised by the env in a worker whose type could not be rebuilt here.

    Exceptions that pickle are re-raised with their own type instead; this class carries the
    original type name and the worker's traceback when that is impossible.
    """

    def __init__(self, worker_index: int, pid: int | None, type_name: str, message: str) -> None:
        self.worker_index = worker_index
        self.pid = pid
        self.type_name = type_name
        super().__init__(f"worker {worker_index} (pid {pid}) raised {type_name}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        message = str(self).split(": ", 1)[-1]
        return (type(self), (self.worker_index, self.pid, self.type_name, message))


class DaemonicWorkerError(AssertionError):
    """A daemonic env worker tried to start a child process.

    Subclasses ``AssertionError``, the error Python raises for the same thing, so existing
    ``except`` clauses keep working.
    """

    def __init__(self, what: str = "a child process") -> None:
        super().__init__(
            f"this ParallelEnv worker is daemonic and tried to start {what} (for example a "
            "DataLoader with num_workers > 0); daemonic processes are not allowed to have "
            "children. Fix: create the env with "
            "`torchrl_ext.ManagedParallelEnv(..., daemon_workers=False)`, which supervises the "
            "workers' children, or use num_workers=0 / torchrl_ext.data.ThreadPrefetcher."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), ())


class DaemonicParentError(RuntimeError):
    """A ManagedParallelEnv was started from inside a daemonic process.

    Such a process cannot have children at all, so no worker could start. This happens when a
    TorchRL component that uses daemonic processes builds the env (for example the env workers
    of an async batched collector, or an upstream ParallelEnv with ``daemon=True``).
    """

    def __init__(self, process_name: str) -> None:
        super().__init__(
            f"cannot start ManagedParallelEnv workers from the daemonic process {process_name!r}: "
            "daemonic processes are not allowed to have children. Build the env in the main "
            "process or in a non-daemonic one: MultiSyncCollector/MultiAsyncCollector workers are "
            "non-daemonic, and an outer torchrl_ext.ManagedParallelEnv needs daemon_workers=False."
        )
        self.process_name = process_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.process_name,))


class PreloadError(ImportError):
    """The preloaded fork server could not import a module it was asked to preload (or did
    not finish within ``_forkserver.PRELOAD_TIMEOUT``); ``name`` is the module when known.

    Example:
        >>> err = PreloadError("the preloaded fork server could not import 'mymod'", name="mymod")
        >>> isinstance(err, ImportError), err.name
        (True, 'mymod')
    """


class UnsupportedTorchRLError(RuntimeError):
    """The installed TorchRL lacks internals ``ManagedParallelEnv`` relies on (a release it was
    not tested on renamed or dropped them): raised at construction, naming each one."""

    def __init__(self, version: str, lacking: list[str], tested: str) -> None:
        names = "; ".join(lacking)
        super().__init__(
            f"torchrl_ext cannot supervise workers on TorchRL {version}: it lacks {names}. "
            f"torchrl_ext is tested on TorchRL {tested}. Install one of those, or use "
            "torchrl.envs.ParallelEnv (no supervision), and please report this."
        )
        self.version, self.lacking, self.tested = version, lacking, tested

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.version, self.lacking, self.tested))
