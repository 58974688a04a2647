"""A log-replay env over an ``EpisodeLedger``, and a dataset whose episodes can fail.

Importable by reference, so they work under spawn and forkserver. Episode ``i`` lasts
``LENGTH`` steps; the env observes ``[index, epoch, t]`` (``index`` -1 once the ledger's
epochs are exhausted), so a test reads from the batch which episode each slot plays.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

from torchrl_ext.data import EpochsExhausted

LENGTH = 3


class Episodes:
    """``n`` episodes; episode ``i`` is ``full((LENGTH,), i)``. Loading an index in ``corrupt``
    raises; loading one in ``crash`` SIGKILLs the loading process (a parser that segfaults)."""

    def __init__(self, n: int, corrupt: tuple[int, ...] = (), crash: tuple[int, ...] = ()) -> None:
        self.n = n
        self.corrupt = corrupt
        self.crash = crash

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in self.crash:
            os.kill(os.getpid(), signal.SIGKILL)
        if index in self.corrupt:
            raise ValueError(f"truncated log in episode {index}")
        return torch.full((LENGTH,), float(index))

    def episode_path(self, index: int) -> str:
        return f"/logs/episode-{index:03d}.bin"


class LedgerEnv(EnvBase):
    """Replays the ledger's episodes: ``_reset`` asks ``episodes.next()``."""

    def __init__(self, episodes: Any, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.episodes = episodes
        self.observation_spec = Composite(observation=Unbounded(shape=(3,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self._obs = torch.tensor([-1.0, -1.0, 0.0])

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        try:
            index, episode = self.episodes.next()
            assert torch.equal(episode, torch.full((LENGTH,), float(index))), (index, episode)
            self._obs = torch.tensor([float(index), float(self.episodes.epoch), 0.0])
        except EpochsExhausted:
            self._obs = torch.tensor([-1.0, -1.0, 0.0])
        return TensorDict({"observation": self._obs.clone(), "done": torch.zeros(1, dtype=torch.bool)}, [])

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self._obs[2] += 1
        done = bool(self._obs[2] >= LENGTH or self._obs[0] < 0)
        return TensorDict(
            {
                "observation": self._obs.clone(),
                "reward": torch.ones(1),
                "done": torch.tensor([done]),
                "terminated": torch.tensor([done]),
            },
            [],
        )

    def _set_seed(self, seed: int | None) -> None:
        pass


def make_ledger_env(**kwargs: Any) -> LedgerEnv:
    return LedgerEnv(**kwargs)
