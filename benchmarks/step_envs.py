"""The envs ``step.py`` steps, each in a TorchRL and an equivalent ``gymnasium.Env`` spelling.

Imported by module name (``step_envs``), never run as ``__main__``, so that every start
method's workers find them by reference. ``gymnasium`` is imported only by the gymnasium
factories (a benchmark-only extra, never the library's dependency).

* ``trivial``: an observation of 4 floats, an action of 1, episodes of 50 steps;
* ``replay``: what a replayed log looks like to the batched env: 200 floats and one 3x84x84
  ``uint8`` frame per step, episodes of 50 steps, next to no work per step.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, Unbounded
from trivial_env import TrivialEnv

EPISODE_LEN = 50
FRAME = (3, 84, 84)
FEATURES = 200


class StepEnv(TrivialEnv):
    """``kind="trivial"`` (``trivial_env.TrivialEnv`` itself) or ``"replay"`` (see the module
    docstring)."""

    def __init__(self, kind: str = "trivial", **kwargs: Any) -> None:
        super().__init__(loader=False, episode_len=EPISODE_LEN, **kwargs)
        self.kind = kind
        self._base = torch.zeros(4)
        self._frame: torch.Tensor | None = None
        if kind == "replay":
            self._base = torch.arange(FEATURES, dtype=torch.float32)
            self._frame = torch.arange(int(torch.tensor(FRAME).prod())).reshape(FRAME).to(torch.uint8)
            self.observation_spec = Composite(
                observation=Unbounded(shape=(FEATURES,)),
                pixels=Bounded(0, 255, shape=FRAME, dtype=torch.uint8),
            )
        self._obs = self._base

    def _next_item(self) -> torch.Tensor:
        return self._base

    def _with_frame(self, td: TensorDict) -> TensorDict:
        if self._frame is not None:
            td.set("pixels", self._frame)
        return td

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        return self._with_frame(super()._reset(tensordict, **kwargs))

    def _step(self, tensordict: TensorDict) -> TensorDict:
        return self._with_frame(super()._step(tensordict))


def make_env(kind: str = "trivial") -> StepEnv:
    return StepEnv(kind)


def make_trivial() -> StepEnv:
    return StepEnv("trivial")


def make_replay() -> StepEnv:
    return StepEnv("replay")


def gym_env_class() -> Any:
    """The ``gymnasium.Env`` equivalent of :class:`StepEnv` (gymnasium imported here only)."""
    import gymnasium
    import numpy as np

    class GymStepEnv(gymnasium.Env):  # type: ignore[misc]
        def __init__(self, kind: str = "trivial") -> None:
            self.kind = kind
            self._t = 0
            self.action_space = gymnasium.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
            if kind == "replay":
                self._obs = np.arange(FEATURES, dtype=np.float32)
                self._frame = (np.arange(int(np.prod(FRAME))) % 256).astype(np.uint8).reshape(FRAME)
                self.observation_space = gymnasium.spaces.Dict(
                    {
                        "observation": gymnasium.spaces.Box(-np.inf, np.inf, (FEATURES,), np.float32),
                        "pixels": gymnasium.spaces.Box(0, 255, FRAME, np.uint8),
                    }
                )
            else:
                self._obs = np.zeros(4, dtype=np.float32)
                self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32)

        def _observe(self) -> Any:
            obs = self._obs + np.float32(self._t)
            if self.kind == "replay":
                return {"observation": obs, "pixels": self._frame}
            return obs

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self._t = 0
            return self._observe(), {}

        def step(self, action: Any) -> Any:
            self._t += 1
            done = self._t >= EPISODE_LEN
            return self._observe(), float(action[0]), done, False, {}

    return GymStepEnv


def make_gym(kind: str = "trivial") -> Any:
    return gym_env_class()(kind)
