"""TorchRL's ``DataLoadingPrimer`` inside ``ManagedParallelEnv`` (docs/faq.md, "DataLoadingPrimer
or ManagedParallelEnv?").

Each env worker builds its own primer, whose DataLoader (2 worker processes, fork context) hands
the next episode to every reset. The rollout must replay the loader's episodes in order in every
worker, each loaded by DataLoader workers that are children of that env worker; upstream
``ParallelEnv`` (non-daemonic by default on TorchRL >= 0.11) is run the same way where it can
start those children, and must give the same data.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase, ParallelEnv, TransformedEnv

from tests.conftest import NOT_SPAWNED, start_kwargs
from tests.contract.helpers import HAS_DAEMON
from torchrl_ext import ManagedParallelEnv

llm = pytest.importorskip("torchrl.envs.llm")

pytestmark = pytest.mark.timeout(240)

#: Rows per episode: an episode ends after ROWS - 1 steps.
ROWS = 5
#: Episodes in the dataset, and steps in the rollout (3 episodes of 4 steps).
EPISODES, STEPS = 6, 12


class Episodes(Dataset[dict[str, torch.Tensor]]):
    """Item i: episode i (row t is ``[t + 100 i, t + 100 i]``) and the parent pid of the
    process that loaded it (the env worker, when a DataLoader worker of that env loaded it)."""

    def __len__(self) -> int:
        return EPISODES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        episode = torch.arange(float(ROWS)).unsqueeze(1).expand(ROWS, 2) + 100.0 * i
        return {"episode": episode, "loader_parent": torch.tensor(os.getppid())}


class PrimedReplayEnv(EnvBase):
    """Replays the episode the primer put in the reset's tensordict; ``loaded_by`` says which
    process's DataLoader worker loaded it."""

    def __init__(self) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(
            observation=Unbounded(shape=(2,)), loaded_by=Unbounded(shape=(), dtype=torch.int64)
        )
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self.episode, self.loaded_by, self.t = torch.zeros(ROWS, 2), torch.tensor(0), 0

    def _observe(self, **extra: torch.Tensor) -> TensorDict:
        return TensorDict(observation=self.episode[self.t].clone(), loaded_by=self.loaded_by.clone(), **extra)

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        assert tensordict is not None, "the primer fills the reset's tensordict"
        self.episode, self.loaded_by, self.t = tensordict["episode"], tensordict["loader_parent"], 0
        return self._observe(done=torch.tensor([False]), terminated=torch.tensor([False]))

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self.t += 1
        done = torch.tensor([self.t == ROWS - 1])
        return self._observe(reward=torch.zeros(1), done=done, terminated=done.clone())

    def _set_seed(self, seed: int | None) -> None:
        pass


def make_primed_env() -> TransformedEnv:
    """The env with a ``DataLoadingPrimer`` reading a DataLoader of 2 worker processes."""
    loader = DataLoader(Episodes(), batch_size=1, num_workers=2, multiprocessing_context="fork")
    primer = llm.DataLoadingPrimer(
        loader,
        primers=Composite(
            episode=Unbounded(shape=(ROWS, 2)), loader_parent=Unbounded(shape=(), dtype=torch.int64)
        ),
        batch_size=0,  # one item per reset, as the env's own batch size
    )
    return TransformedEnv(PrimedReplayEnv(), primer)


def _expected_first_column() -> torch.Tensor:
    """What each worker observes, step by step: episodes 0, 1, 2 in the loader's order."""
    return torch.cat([torch.arange(float(ROWS - 1)) + 100.0 * i for i in range(STEPS // (ROWS - 1))])


def _rollout(env: Any) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """First observation column and ``loaded_by`` of each step, per worker, and the workers' pids."""
    try:
        rollout = env.rollout(STEPS, break_when_any_done=False)
        pids = [w.pid for w in env._workers]  # TorchRL's process list, kept by both classes
    finally:
        env.close()
    return rollout["observation"][..., 0], rollout["loaded_by"], pids


@pytest.mark.compat
@pytest.mark.parametrize("method", NOT_SPAWNED)
def test_data_loading_primer_feeds_every_managed_worker(method: str) -> None:
    observed, loaded_by, pids = _rollout(
        ManagedParallelEnv(2, make_primed_env, daemon_workers=False, **start_kwargs(method))
    )
    expected = _expected_first_column().expand(2, STEPS)
    # Every worker builds its own primer and loader: each replays the dataset from its start.
    assert torch.equal(observed, expected)
    for slot, pid in enumerate(pids):  # loaded by DataLoader workers that are that worker's children
        assert loaded_by[slot].tolist() == [pid] * STEPS
    if not HAS_DAEMON:  # TorchRL 0.10: upstream workers are daemonic, their loaders cannot start
        return
    up_observed, up_loaded_by, up_pids = _rollout(ParallelEnv(2, make_primed_env, mp_start_method="fork"))
    assert torch.equal(up_observed, observed)
    for slot, pid in enumerate(up_pids):
        assert up_loaded_by[slot].tolist() == [pid] * STEPS
