"""A pytest plugin that swaps the import in TorchRL's own test suite: ``torchrl.envs.ParallelEnv``
is ``ManagedParallelEnv`` before any test module imports it. Not part of ``make test`` (TorchRL's
tests come from its repository, not from a package registry); see docs/design.md, "TorchRL's
own tests, with the import swapped".

    cd <pytorch/rl checkout>/test
    PYTHONPATH=<this directory> python -m pytest -p swap_import envs/test_parallel.py
"""

import torchrl.envs
import torchrl.envs.batched_envs

from torchrl_ext import ManagedParallelEnv

torchrl.envs.ParallelEnv = ManagedParallelEnv  # type: ignore[misc]
torchrl.envs.batched_envs.ParallelEnv = ManagedParallelEnv  # type: ignore[misc]
