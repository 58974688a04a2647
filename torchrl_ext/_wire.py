"""How an exception raised in a worker travels to the main process: the wire format.

A worker (or the spec-reading process) describes the exception with :func:`exception_report`:
its type, message, formatted traceback, process name and, when it pickles, the exception itself. The worker
writes that to a report file (:func:`write_report`) before it exits; the spec-reading process
sends it over its pipe. The main process turns it back into an exception with
:func:`rebuild_exception`: the same type when it unpickles (else a ``WorkerEnvError``), the
worker's traceback as ``__cause__`` and a note naming the worker.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from typing import Any

from ._errors import RemoteTraceback, WorkerEnvError

__all__ = ["exception_report", "read_report", "rebuild_exception", "write_report"]


def exception_report(exc: BaseException, last_command: str | None) -> dict[str, Any]:
    """A picklable description of ``exc`` for the parent (the exception itself if it pickles)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    payload: bytes | None
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = None
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": text,
        "exception": payload,
        "last_command": last_command,
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "time": time.time(),
    }


def write_report(path: str, exc: BaseException, last_command: str | None) -> bool:
    """Leave ``exc`` for the parent in ``path`` (atomically; never raises); whether it is there."""
    report = exception_report(exc, last_command)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pickle.dump(report, fh)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def read_report(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            report = pickle.load(fh)
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    return report if isinstance(report, dict) else None


def rebuild_exception(report: dict[str, Any], index: int, pid: int) -> BaseException:
    exc: BaseException | None = None
    if report.get("exception") is not None:
        try:
            exc = pickle.loads(report["exception"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerEnvError(index, pid, report.get("type", "Exception"), report.get("message", ""))
    exc.__cause__ = RemoteTraceback(report.get("traceback", ""), report.get("process"))
    last = report.get("last_command")
    where = f"while handling {last!r}" if last else "while building the env"
    if index < 0:
        note = f"Raised in the process (pid {pid}) that builds the env to read its specs."
    else:
        note = f"Raised in ManagedParallelEnv worker {index} (pid {pid}) {where}."
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    exc.worker_index = index  # type: ignore[attr-defined]
    return exc
