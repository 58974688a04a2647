"""The env the overhead benchmarks step: next to no work per step, so what is measured is the
batched env around it. Imported by module name (``trivial_env``), never run as ``__main__``, so
that every start method's workers find it by reference."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase


class Items(Dataset[torch.Tensor]):
    """A tiny dataset for the workers' persistent DataLoader."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


class TrivialEnv(EnvBase):
    """Next to no work per step; with ``loader=True`` reset draws from a persistent DataLoader.

    The loader is left to the garbage collector on close, as typical user code does.
    """

    def __init__(self, loader: bool = False, episode_len: int = 50, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.use_loader = loader
        self.episode_len = episode_len
        self._iter: Any = None
        self._t = 0
        self._obs = torch.zeros(4)
        self.observation_spec = Composite(observation=Unbounded(shape=(4,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _next_item(self) -> torch.Tensor:
        if not self.use_loader:
            return torch.zeros(4)
        if self._iter is None:
            loader = DataLoader(
                Items(),
                batch_size=None,
                shuffle=False,
                num_workers=2,
                persistent_workers=True,
                multiprocessing_context="fork",
            )
            self._loader = loader
            self._iter = iter(loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self._loader)
            return next(self._iter)

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        self._obs = self._next_item().clone()
        self._t = 0
        return TensorDict(
            {
                "observation": self._obs.clone(),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self._t += 1
        done = torch.tensor([self._t >= self.episode_len])
        return TensorDict(
            {
                "observation": self._obs + self._t,
                "reward": tensordict["action"].clone(),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        pass


def make_trivial_env(loader: bool = False) -> TrivialEnv:
    return TrivialEnv(loader=loader)
