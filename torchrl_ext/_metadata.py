"""Read the env's specs in a supervised one-shot process instead of the main process.

TorchRL builds one env in the main process to read its specs (``get_env_metadata``). An env
that starts children in ``__init__`` (a simulator, a DataLoader) would start them in the main
process, outside any supervision. While a :class:`ManagedParallelEnv` with
``daemon_workers=False`` is constructed, TorchRL's ``get_env_metadata`` (whichever is current)
is called in a child process instead (:func:`metadata_in_subprocess`). The child is prepared
like a worker (own process group, parent-death signal, tag), the metadata comes back over a
pipe, and the child's whole tree is killed and reaped before construction returns.

What the factory can tell: ``os.getpid()`` is not the main process's, so by upstream's rules
(upstream builds this env in the main process, and every other process is a worker) it is a
worker, and it looks like one: the workers' start method, their thread count
(``num_sub_threads``, as TorchRL sets it in each worker), their seeding.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
from torchrl.envs import EnvBase
from torchrl.envs.env_creator import EnvCreator

from . import _identity, _platform, _reaper_client
from ._compat import describe_factory
from ._errors import unpicklable_note
from ._intercept import get_env_metadata_patch
from ._tag import Tag, tagged_starts
from ._wire import exception_report, rebuild_exception
from ._worker import WorkerConfig, end_own_descendants, exit_now, prepare_process

__all__ = ["metadata_in_subprocess"]


def _metadata_main(
    conn: Any, payload: bytes | tuple[Any, ...], config: WorkerConfig, num_threads: int
) -> None:
    """Runs in the child: build the env, send its metadata, end everything it started."""
    prepare_process(config)
    torch.set_num_threads(num_threads)
    # Plain pickle, by value: torch's multiprocessing reducers would share tensors through a
    # server thread in this process, which exits right after sending.
    try:
        read, fn, kwargs, extra = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        answer = pickle.dumps(("ok", read(fn, kwargs, **extra)))
    except BaseException as exc:  # reported to the parent, which re-raises it
        answer = pickle.dumps(("error", exception_report(exc, None)))
    try:
        conn.send_bytes(answer)
    finally:
        conn.close()
        end_own_descendants()
        exit_now(0)


def _payload(
    read: Callable[..., Any], fn: Any, kwargs: Any, extra: dict[str, Any], start_method: str, preloaded: bool
) -> bytes | tuple[Any, ...]:
    """What the child gets to build the env: under fork the objects themselves (a forked child
    has them: nothing is pickled, as for upstream's forked workers), else cloudpickled, as TorchRL
    sends a factory to its workers; a factory that does not pickle gets a note naming it."""
    if start_method == "fork":
        return (read, fn, kwargs, extra)
    try:
        return cloudpickle.dumps((read, fn, kwargs, extra))
    except Exception as err:
        note = unpicklable_note(
            fn,
            kwargs,
            name=describe_factory(fn),
            start="the preloaded fork server (the default start)"
            if preloaded
            else f"mp_start_method={start_method!r}",
            destination="the process that builds the env to read its specs (metadata_in_subprocess)",
        )
        if note is not None:
            err.add_note(note)
        raise


#: What a managed env's construction passes down: start method name or context, tag, label,
#: the workers' default start method for their children, the workers' thread count.
_Context = tuple[Any, Tag, str, "str | None", int]


def _compute(read: Callable[..., Any], context: _Context, fn: Any, kwargs: Any = None, **extra: Any) -> Any:
    """``read(fn, kwargs, **extra)`` (TorchRL's ``get_env_metadata``) in a supervised child."""
    start, tag, label, child_start_method, num_threads = context
    if isinstance(fn, EnvBase | EnvCreator):  # nothing to build, or already built by EnvCreator
        return read(fn, kwargs, **extra)
    # A start method's name, or the preloaded server's context (see _forkserver).
    ctx: Any = multiprocessing.get_context(start) if isinstance(start, str) else start
    start_method = ctx.get_start_method()
    payload = _payload(read, fn, kwargs, extra, start_method, preloaded=not isinstance(start, str))
    owner_pid, owner_ctime = _identity.me()
    fifo = _reaper_client.acquire()
    config = WorkerConfig(
        index=-1,
        tag=str(tag),
        daemon_workers=False,
        arm_pdeathsig=_platform.parent_death_outlives_worker(start_method),
        owner_pid=owner_pid,
        owner_create_time=owner_ctime,
        report_path="",
        reaper_fifo=fifo,
        child_start_method=child_start_method,
    )
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_metadata_main,
        args=(send_conn, payload, config, num_threads),
        name=f"{label}-metadata",
        daemon=False,
    )
    try:
        with tagged_starts(tag, start_method, preloaded=not isinstance(start, str)):
            process.start()
        send_conn.close()
        try:
            kind, payload = pickle.loads(recv_conn.recv_bytes())
        except EOFError:
            process.join(timeout=5.0)
            raise RuntimeError(
                f"{label}: the process that builds the env to read its specs died with exit code "
                f"{process.exitcode} before answering; build the env once in a plain Python process "
                "to see the error."
            ) from None
    finally:
        recv_conn.close()
        _end_tree(process, tag)
        _reaper_client.release()
    if kind == "error":
        raise rebuild_exception(payload, -1, process.pid)
    return payload


def _end_tree(process: Any, tag: Tag) -> None:
    pid = process.pid
    if pid is None:
        return
    ctime = _identity.start_time_of(pid)
    workers = {} if ctime is None else {pid: (ctime, pid)}
    # It answered (or died) a moment ago: its process group cannot have been recycled yet.
    procs = _identity.tree(
        workers,
        owner=(tag.owner_pid, tag.owner_create_time),
        env_id=tag.env_id,
        recent_groups=[pid],
        include_workers=False,
        dying=True,  # its zombie children are ours once it is joined below
    )
    process.join(timeout=5.0)
    if process.exitcode is None:
        with contextlib.suppress(Exception):
            process.kill()
        process.join(timeout=5.0)
    _identity.kill_and_reap(procs, grace=1.0, what="spec-reading env child")
    _reaper_client.send({"op": "unwatch", "pid": pid})


_context = threading.local()


def _routed(previous: Callable[..., Any]) -> Callable[..., Any]:
    """The ``get_env_metadata`` installed while managed envs are constructed."""

    def get_env_metadata(fn: Any, kwargs: Any = None, **extra: Any) -> Any:
        stack = getattr(_context, "stack", None)
        if not stack:  # an env constructed by another thread meanwhile
            return previous(fn, kwargs, **extra)
        return _compute(previous, stack[-1], fn, kwargs, **extra)

    get_env_metadata.__wrapped__ = previous  # type: ignore[attr-defined]
    return get_env_metadata


_PATCH = get_env_metadata_patch(_routed)


@contextlib.contextmanager
def metadata_in_subprocess(
    start: Any, tag: Tag, label: str, child_start_method: str | None = None, num_threads: int = 1
) -> Iterator[None]:
    """While active, ``ParallelEnv`` constructed by this thread reads env specs through a
    supervised child (:func:`_compute`), with whatever ``get_env_metadata`` was current.
    ``start``: a start method's name or a context (the preloaded server's); ``num_threads``:
    the workers' thread count (TorchRL's ``num_sub_threads``), which the child gets too."""
    stack: list[_Context] = _context.__dict__.setdefault("stack", [])
    stack.append((start, tag, label, child_start_method, num_threads))
    try:
        with _PATCH.active():
            yield
    finally:
        stack.pop()
