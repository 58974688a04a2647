"""What differs between the TorchRL releases we support (0.10 and >= 0.11).

Feature detection, not version strings: torchrl 0.10.1 wheels report ``0.0.0+unknown``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchrl.envs import ParallelEnv, batched_envs

__all__ = [
    "HAS_DAEMON_KWARG",
    "HAS_SHUTDOWN_TIMEOUT_KWARG",
    "SupervisedWorkers",
    "managed_worker_targets",
    "original_worker_entry",
]

_init_params = inspect.signature(ParallelEnv.__init__).parameters
#: TorchRL >= 0.11: workers' daemon flag is configurable (``daemon=``).
HAS_DAEMON_KWARG = "daemon" in _init_params
#: TorchRL >= 0.13: ``shutdown_timeout=`` exists upstream.
HAS_SHUTDOWN_TIMEOUT_KWARG = "shutdown_timeout" in _init_params

_ENTRY_NAMES = ("_run_worker_pipe_shared_mem", "_run_worker_pipe_direct")
# Captured at import, before any swap: a forked child sees these, never our replacements.
_ORIGINAL_ENTRIES: dict[str, Callable[..., Any]] = {
    name: getattr(batched_envs, name) for name in _ENTRY_NAMES
}
_swap_lock = threading.RLock()
_swap_depth = 0


def original_worker_entry(name: str) -> Callable[..., Any]:
    """TorchRL's own worker function ``name``."""
    return _ORIGINAL_ENTRIES[name]


@contextlib.contextmanager
def managed_worker_targets() -> Iterator[None]:
    """While active, ParallelEnv starts workers through our bootstrap entry points.

    Our entries fall through to TorchRL's for envs that are not managed, so an upstream
    ParallelEnv started concurrently from another thread is unaffected.
    """
    global _swap_depth
    from . import _worker

    replacements = {
        "_run_worker_pipe_shared_mem": _worker.managed_worker_shared_mem,
        "_run_worker_pipe_direct": _worker.managed_worker_direct,
    }
    with _swap_lock:
        if _swap_depth == 0:
            for name, fn in replacements.items():
                setattr(batched_envs, name, fn)
        _swap_depth += 1
    try:
        yield
    finally:
        with _swap_lock:
            _swap_depth -= 1
            if _swap_depth == 0:
                for name, fn in _ORIGINAL_ENTRIES.items():
                    setattr(batched_envs, name, fn)


class SupervisedWorkers(list[Any]):
    """The env's ``_workers`` list, carrying the supervisor's fault check.

    TorchRL's ``_check_start`` calls ``_check_for_faulty_process(self._workers)`` before most
    methods; for our workers that check is the supervisor's (which keeps the survivors alive
    and raises our error) instead of TorchRL's (which terminates them and closes the
    ``Process`` objects).
    """

    def __init__(self, processes: list[Any], check_faults: Callable[[], None]) -> None:
        super().__init__(processes)
        self.check_faults = check_faults


_original_check_for_faulty_process = batched_envs._check_for_faulty_process


def _check_for_faulty_process(processes: Any) -> Any:
    check = getattr(processes, "check_faults", None)
    if check is not None:
        check()
        return None
    return _original_check_for_faulty_process(processes)


# Delegates to TorchRL's own check for every list that is not ours.
batched_envs._check_for_faulty_process = _check_for_faulty_process
