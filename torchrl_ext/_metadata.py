"""Read the env's specs in a supervised one-shot process instead of the main process.

TorchRL builds one env in the main process to read its specs (``get_env_metadata``). An env
that starts children in ``__init__`` (a simulator, a DataLoader) would start them in the main
process, outside any supervision. While a :class:`ManagedParallelEnv` with
``daemon_workers=False`` is constructed, ``get_env_metadata`` is swapped for
:func:`metadata_in_subprocess`: the env is built in a child process prepared like a worker
(own process group, parent-death signal, tag), the metadata comes back over a pipe, and the
child's whole tree is killed and reaped before construction returns.
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
import psutil
import torch
from torchrl.envs import EnvBase, batched_envs
from torchrl.envs.env_creator import EnvCreator

from . import _lifeline, _process_tree
from ._supervisor import rebuild_exception
from ._tag import Tag
from ._worker import WorkerConfig, end_own_descendants, exception_report, exit_now, prepare_process

__all__ = ["metadata_in_subprocess"]

_ORIGINAL_GET_ENV_METADATA = batched_envs.get_env_metadata
_swap_lock = threading.Lock()


def _metadata_main(conn: Any, payload: bytes, config: WorkerConfig) -> None:
    """Runs in the child: build the env, send its metadata, end everything it started."""
    prepare_process(config)
    # A forked child of a process that already ran multithreaded torch ops can deadlock in the
    # thread pool it inherited; one thread is plenty to build an env and read its specs.
    torch.set_num_threads(1)
    # Plain pickle, by value: torch's multiprocessing reducers would share tensors through a
    # server thread in this process, which exits right after sending.
    try:
        fn, kwargs, extra = cloudpickle.loads(payload)
        answer = pickle.dumps(("ok", _ORIGINAL_GET_ENV_METADATA(fn, kwargs, **extra)))
    except BaseException as exc:  # reported to the parent, which re-raises it
        answer = pickle.dumps(("error", exception_report(exc, None)))
    try:
        conn.send_bytes(answer)
    finally:
        conn.close()
        end_own_descendants()
        exit_now(0)


def _compute(start_method: str, tag: Tag, label: str, fn: Any, kwargs: Any = None, **extra: Any) -> Any:
    if isinstance(fn, EnvBase | EnvCreator):  # nothing to build, or already built by EnvCreator
        return _ORIGINAL_GET_ENV_METADATA(fn, kwargs, **extra)
    ctx: Any = multiprocessing.get_context(start_method)
    me = psutil.Process()
    fifo = _lifeline.acquire()
    config = WorkerConfig(
        index=-1,
        tag=str(tag),
        daemon_workers=False,
        arm_pdeathsig=start_method == "forkserver" or threading.current_thread() is threading.main_thread(),
        owner_pid=me.pid,
        owner_create_time=me.create_time(),
        report_path="",
        reaper_fifo=fifo,
    )
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_metadata_main,
        args=(send_conn, cloudpickle.dumps((fn, kwargs, extra)), config),
        name=f"{label}-metadata",
        daemon=False,
    )
    try:
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
        _lifeline.release()
    if kind == "error":
        raise rebuild_exception(payload, -1, process.pid)
    return payload


def _end_tree(process: Any, tag: Tag) -> None:
    pid = process.pid
    if pid is None:
        return
    procs = _process_tree.descendants(pid)
    procs += _process_tree.tagged_processes(tag, env_id=tag.env_id)
    try:
        ctime = psutil.Process(pid).create_time()
        procs += _process_tree.members_of_group(pid, ctime)
    except psutil.Error:
        pass
    process.join(timeout=5.0)
    if process.exitcode is None:
        with contextlib.suppress(Exception):
            process.kill()
        process.join(timeout=5.0)
    _process_tree.kill_and_reap([p for p in procs if p.pid != pid], grace=1.0, what="spec-reading env child")
    _lifeline.send({"op": "unwatch", "pid": pid})


@contextlib.contextmanager
def metadata_in_subprocess(start_method: str, tag: Tag, label: str) -> Iterator[None]:
    """While active, ``ParallelEnv`` reads env specs through :func:`_compute`."""

    def get_env_metadata(fn: Any, kwargs: Any = None, **extra: Any) -> Any:
        return _compute(start_method, tag, label, fn, kwargs, **extra)

    replacement: Callable[..., Any] = get_env_metadata
    with _swap_lock:
        batched_envs.get_env_metadata = replacement
        try:
            yield
        finally:
            batched_envs.get_env_metadata = _ORIGINAL_GET_ENV_METADATA
