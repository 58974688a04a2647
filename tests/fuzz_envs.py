"""The env of the stateful fuzz (tests/test_fuzz.py).

Module level, so importable by reference under every start method. Its observation is a
plain record of everything a batched env is supposed to forward, so that a divergence shows
in the data: ``[worker, seed tag, episode, t, accumulated scaled actions]``.

* ``worker`` is a constructor kwarg (one per slot): a slot mix-up is visible;
* the seed tag is ``-1`` until ``set_seed``, then the seed modulo 2**16;
* ``episode`` counts resets from 0 (a fresh env's first reset is episode 0), ``t`` counts steps;
* ``scale`` is a buffer, so ``state_dict()`` / ``load_state_dict()`` change the data;
* the episode is done after ``max_steps`` steps (per slot: resets interleave).

``kill_file``: when that file exists at the start of a ``reset`` or ``step``, the worker removes
it and SIGKILLs itself, so that the loss is seen while that call is in flight (its replacement,
built with the same kwargs, finds no file and lives).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

#: Length of the observation.
OBS = 5
#: The seed tag of an env that was never seeded.
UNSEEDED = -1.0


def fresh_reset_observation(worker: int, seed: int | None = None) -> torch.Tensor:
    """The observation of the first reset of a fresh env of slot ``worker``, unseeded or seeded
    with ``seed`` (a replacement of a seeded env is: see docs/restarts.md, "Seeds")."""
    tag = UNSEEDED if seed is None else float(int(seed) % 65536)
    return torch.tensor([float(worker), tag, 0.0, 0.0, 0.0])


class FuzzEnv(EnvBase):
    def __init__(
        self, worker: int = 0, max_steps: int = 3, kill_file: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.worker = int(worker)
        self.max_steps = int(max_steps)
        self.kill_file = kill_file
        self.register_buffer("scale", torch.ones(()))
        self._seed_tag = UNSEEDED
        self._episode = -1
        self._t = 0
        self._acc = 0.0
        self.observation_spec = Composite(observation=Unbounded(shape=(OBS,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _maybe_die(self) -> None:
        if self.kill_file is not None and os.path.exists(self.kill_file):
            os.unlink(self.kill_file)
            os.kill(os.getpid(), signal.SIGKILL)

    def _observation(self) -> torch.Tensor:
        return torch.tensor(
            [float(self.worker), self._seed_tag, float(self._episode), float(self._t), self._acc]
        )

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        self._maybe_die()
        self._episode += 1
        self._t = 0
        self._acc = 0.0
        return TensorDict(
            {
                "observation": self._observation(),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._maybe_die()
        action = float(tensordict.get("action").reshape(-1)[0])
        self._t += 1
        self._acc += float(self.scale) * action
        done = torch.tensor([self._t >= self.max_steps])
        return TensorDict(
            {
                "observation": self._observation(),
                "reward": torch.tensor([self._acc + 10.0 * self.worker]),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        self._seed_tag = UNSEEDED if seed is None else float(int(seed) % 65536)


def make_fuzz_env(**kwargs: Any) -> FuzzEnv:
    return FuzzEnv(**kwargs)
