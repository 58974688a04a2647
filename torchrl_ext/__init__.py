"""torchrl-ext: supervised, leak-free multi-process TorchRL environments.

``ManagedParallelEnv`` is a drop-in ``torchrl.envs.ParallelEnv`` whose workers may have
children (``daemon_workers=False``) and whose whole process tree is supervised.

Example:
    >>> from torchrl_ext import ManagedParallelEnv as ParallelEnv  # the only change
    >>> ParallelEnv.__mro__[1].__name__
    'ParallelEnv'
"""

from __future__ import annotations

import os

if os.name != "posix":  # before anything imports POSIX-only names (signal.SIGKILL, fcntl...)
    raise ImportError(
        f"torchrl_ext needs a POSIX system (this one is os.name={os.name!r}): Linux is fully "
        "supported, macOS with a reduced guarantee (no prctl, no pidfd; see docs/faq.md), "
        "Windows is not supported. On Windows, run it in WSL 2 or a Linux container."
    )

import logging

# First: it records the global start method before TorchRL's import sets one.
from . import _forkserver  # noqa: F401  # isort: skip
from ._env import ManagedParallelEnv
from ._errors import (
    DaemonicParentError,
    DaemonicWorkerError,
    PreloadError,
    RemoteTraceback,
    UnsupportedTorchRLError,
    WorkerDiedError,
    WorkerEnvError,
    WorkerHungError,
    WorkerStartTimeoutError,
    format_exitcode,
)
from ._plan import start_fork_server
from ._policy import RestartRecord
from ._report import SupervisionReport, WorkerOutcome

__all__ = [
    "DaemonicParentError",
    "DaemonicWorkerError",
    "ManagedParallelEnv",
    "PreloadError",
    "RemoteTraceback",
    "RestartRecord",
    "SupervisionReport",
    "UnsupportedTorchRLError",
    "WorkerDiedError",
    "WorkerEnvError",
    "WorkerHungError",
    "WorkerOutcome",
    "WorkerStartTimeoutError",
    "__version__",
    "format_exitcode",
    "start_fork_server",
]

__version__ = "0.1.0"

logging.getLogger("torchrl_ext").addHandler(logging.NullHandler())
