"""Environments and factories for the contract suite.

Everything here is defined at module level, so it is importable by reference in spawn and
forkserver workers. The envs are deterministic functions of their kwargs, their seed, their
state dict and the actions they get: two batched envs that receive the same actions must
produce the same data, which is what the contract tests compare.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase, TransformedEnv

OBS = 3


def _exit_zero() -> None:
    """Target of the grandchild process started by :class:`ChildInResetEnv`."""
    os._exit(0)


class CountingEnv(EnvBase):
    """An env whose data depends on everything a batched env is supposed to forward.

    * ``observation`` starts at ``offset`` plus noise from the env's own generator (so
      ``set_seed`` shows in the data) and moves by ``scale * action`` plus noise at each step;
    * ``scale`` is a buffer, so ``state_dict()`` / ``load_state_dict()`` change the data;
    * ``step`` counts steps; the episode is done after ``max_steps`` steps;
    * ``offset`` is a constructor kwarg, so ``update_kwargs`` shows in the data;
    * ``noise=0``: every episode is the same (for collectors, whose batches arrive in any order).
    """

    def __init__(self, max_steps: int = 4, offset: float = 0.0, noise: float = 1.0, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.max_steps = int(max_steps)
        self.offset = float(offset)
        self.noise = float(noise)
        self.register_buffer("scale", torch.ones(()))
        self._gen = torch.Generator().manual_seed(0)
        self._t = 0
        self._obs = torch.zeros(OBS)
        self.observation_spec = Composite(
            observation=Unbounded(shape=(OBS,)),
            step=Unbounded(shape=(1,), dtype=torch.int64),
        )
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _noise(self) -> torch.Tensor:
        return self.noise * torch.rand(OBS, generator=self._gen)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        self._obs = self.offset + self._noise()
        return TensorDict(
            {
                "observation": self._obs.clone(),
                "step": torch.zeros(1, dtype=torch.int64),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = tensordict.get("action")
        self._t += 1
        self._obs = self._obs + self.scale * action + 0.01 * self._noise()
        done = torch.tensor([self._t >= self.max_steps])
        return TensorDict(
            {
                "observation": self._obs.clone(),
                "step": torch.tensor([self._t], dtype=torch.int64),
                "reward": self._obs.sum().reshape(1),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        self._gen = torch.Generator().manual_seed(int(seed or 0))


def make_counting_env(**kwargs: Any) -> CountingEnv:
    return CountingEnv(**kwargs)


class NestedEnv(EnvBase):
    """An env with a nested observation ``("agent", "pos")`` / ``("agent", "vel")`` and a
    top-level observation whose key is chosen by ``extra_key`` (heterogeneous batches)."""

    def __init__(self, extra_key: str = "obs_a", extra_dim: int = 2, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.extra_key = extra_key
        self.extra_dim = int(extra_dim)
        self._t = 0
        self.observation_spec = Composite(
            agent=Composite(
                pos=Unbounded(shape=(2,)),
                vel=Unbounded(shape=(2,), dtype=torch.float64),
            ),
            **{extra_key: Unbounded(shape=(self.extra_dim,))},
        )
        self.action_spec = Bounded(-1.0, 1.0, shape=(2,))
        self.reward_spec = Unbounded(shape=(1,))

    def _obs(self, action: torch.Tensor) -> dict[str, Any]:
        t = float(self._t)
        return {
            "agent": {
                "pos": torch.full((2,), t) + action,
                "vel": action.to(torch.float64) * 2,
            },
            self.extra_key: torch.arange(self.extra_dim, dtype=torch.float32) + 10 * t,
        }

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        return TensorDict(
            {
                **self._obs(torch.zeros(2)),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._t += 1
        action = tensordict.get("action")
        done = torch.tensor([self._t >= 3])
        return TensorDict(
            {
                **self._obs(action),
                "reward": action.sum().reshape(1),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        pass


class SlowCloseEnv(CountingEnv):
    """A CountingEnv whose ``close()`` takes ``close_delay`` seconds (an env holding a renderer
    or a simulator that is slow to let go): a graceful close cannot finish in time."""

    def __init__(self, close_delay: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.close_delay = float(close_delay)

    def close(self, *, raise_if_closed: bool = True) -> None:
        threading.Event().wait(self.close_delay)  # a slow release, not a synchronization
        super().close(raise_if_closed=raise_if_closed)


def make_slow_close_env(**kwargs: Any) -> SlowCloseEnv:
    return SlowCloseEnv(**kwargs)


def make_nested_env(**kwargs: Any) -> NestedEnv:
    return NestedEnv(**kwargs)


class FactoryError(ValueError):
    """What :func:`make_failing_env` raises: a distinctive, picklable exception."""


def make_failing_env(**kwargs: Any) -> EnvBase:
    """A factory that fails while the env is being built."""
    raise FactoryError("contract: the env factory failed on purpose")


class ChildInResetEnv(CountingEnv):
    """A CountingEnv whose reset starts (and joins) a child process, as an env holding a
    DataLoader with workers or a simulator does. Its ``observation`` carries the child's
    exit code in the first entry (0 when it ran)."""

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        out = super()._reset(tensordict, **kwargs)
        proc = multiprocessing.get_context("fork").Process(target=_exit_zero)
        proc.start()
        proc.join()
        out["observation"][0] = float(proc.exitcode if proc.exitcode is not None else -1)
        return out


def make_child_in_reset_env(**kwargs: Any) -> ChildInResetEnv:
    return ChildInResetEnv(**kwargs)


def make_vecnorm_env(**kwargs: Any) -> EnvBase:
    """A CountingEnv whose observation goes through a ``VecNorm`` (running statistics).

    The first ``VecNorm`` API (``new_api=False``, still the default on 0.14): its statistics
    live in a TensorDict that ``EnvCreator`` puts in shared memory, so the workers update the
    statistics the main process holds. (``VecNormV2`` keeps them in a plain dict that
    ``EnvCreator`` does not share, on 0.14.1 as on 0.10.1.) ``decay=1.0``: the statistics are
    plain sums, independent (up to rounding) of the order of the two workers' updates.
    """
    from torchrl.envs import VecNorm

    return TransformedEnv(CountingEnv(**kwargs), VecNorm(in_keys=["observation"], decay=1.0, new_api=False))


def make_traj_counter_env(counter: Any = None, **kwargs: Any) -> EnvBase:
    """A CountingEnv with a TrajCounter; ``counter``: a TrajCounter to share (cloned)."""
    from torchrl.envs import TrajCounter

    transform = TrajCounter() if counter is None else counter.clone()
    env = TransformedEnv(CountingEnv(**kwargs), transform)
    return env


class ConstantPolicy(torch.nn.Module):
    """Maps an observation to a fixed action: a deterministic, picklable policy."""

    def __init__(self, value: float = 0.5, action_dim: int = 1) -> None:
        super().__init__()
        self.register_buffer("value", torch.full((action_dim,), float(value)))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.value.expand(*observation.shape[:-1], self.value.shape[-1]).clone()


def make_constant_policy(value: float = 0.5) -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(ConstantPolicy(value), in_keys=["observation"], out_keys=["action"])


def make_parallel_counting_env(env_class: Any, mp_start_method: str, **kwargs: Any) -> Any:
    """For collectors: a 2-worker batched env of ``env_class`` (upstream or managed) whose
    episodes are all alike (3 steps, no noise); ``kwargs`` go to ``env_class``."""
    import functools

    fn = functools.partial(make_counting_env, max_steps=3, noise=0.0)
    return env_class(2, fn, mp_start_method=mp_start_method, **kwargs)


def make_thread_checking_env(main_pid: int, num_sub_threads: int, **kwargs: Any) -> CountingEnv:
    """The factory of TorchRL's own ``TestLibThreading::test_num_threads``, in spirit: any process
    that is not the main one is taken for a worker, and a worker must run ``num_sub_threads``
    torch threads. Upstream builds its spec-reading env in the main process."""
    if os.getpid() != main_pid:
        assert torch.get_num_threads() == num_sub_threads, (
            f"pid {os.getpid()} is not the main process ({main_pid}) but runs "
            f"{torch.get_num_threads()} torch threads, not num_sub_threads={num_sub_threads}"
        )
    return CountingEnv(**kwargs)


class DtypesEnv(EnvBase):
    """An env whose outputs span dtypes and nesting, for the step path's copies: a float32
    observation, a uint8 frame, a nested float64 position and int32 counter, a bool flag, and
    one output no spec declares (so no shared buffer has it: a worker's copy into the buffers
    must drop it as TorchRL's ``update_`` does, not raise); driven by the action and its own
    seeded generator; episodes of ``max_steps``."""

    def __init__(self, max_steps: int = 3, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.max_steps = int(max_steps)
        self._gen = torch.Generator().manual_seed(0)
        self._t = 0
        self.observation_spec = Composite(
            observation=Unbounded(shape=(OBS,)),
            frame=Bounded(0, 255, shape=(2, 4, 4), dtype=torch.uint8),
            flag=Unbounded(shape=(1,), dtype=torch.bool),
            agent=Composite(
                pos=Unbounded(shape=(2,), dtype=torch.float64),
                count=Unbounded(shape=(1,), dtype=torch.int32),
            ),
        )
        self.action_spec = Bounded(-1.0, 1.0, shape=(2,))
        self.reward_spec = Unbounded(shape=(1,))

    def _obs(self, action: torch.Tensor) -> dict[str, Any]:
        noise = torch.rand(OBS, generator=self._gen)
        frame = torch.randint(0, 256, (2, 4, 4), generator=self._gen, dtype=torch.uint8)
        return {
            "observation": noise + action.sum(),
            "frame": frame,
            "flag": torch.tensor([self._t % 2 == 1]),
            "agent": {
                "pos": action.to(torch.float64) * self._t,
                "count": torch.tensor([self._t], dtype=torch.int32),
            },
            "undeclared": torch.tensor([self._t], dtype=torch.int64),
        }

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        done = torch.zeros(1, dtype=torch.bool)
        obs = self._obs(torch.zeros(2))
        return TensorDict({**obs, "done": done, "terminated": done.clone()}, batch_size=[])

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._t += 1
        action = tensordict.get("action")
        done = torch.tensor([self._t >= self.max_steps])
        reward = action.sum().reshape(1)
        return TensorDict(
            {**self._obs(action), "reward": reward, "done": done, "terminated": done.clone()}, batch_size=[]
        )

    def _set_seed(self, seed: int | None) -> None:
        self._gen.manual_seed(int(seed or 0))


def make_dtypes_env(**kwargs: Any) -> DtypesEnv:
    return DtypesEnv(**kwargs)


class HeteroAgentsEnv(EnvBase):
    """Two agents per env whose observations differ in size: the spec stacks two different
    ``Composite``s, so TorchRL's shared buffers hold a ``LazyStackedTensorDict`` (a structure
    the managed step path leaves to TorchRL's). Deterministic in its seed and actions."""

    SIZES = (1, 3)

    def __init__(self, max_steps: int = 3, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([len(self.SIZES)]), **kwargs)
        self.max_steps = int(max_steps)
        self._gen = torch.Generator().manual_seed(0)
        self._t = 0
        agents = torch.stack([Composite(obs=Unbounded(shape=(size,))) for size in self.SIZES], dim=0)
        self.observation_spec = Composite(agents=agents, shape=self.batch_size)
        self.action_spec = Bounded(-1.0, 1.0, shape=(*self.batch_size, 1))
        self.reward_spec = Unbounded(shape=(*self.batch_size, 1))

    def _agents(self, action: torch.Tensor) -> TensorDictBase:
        from tensordict import LazyStackedTensorDict

        rows = [
            TensorDict({"obs": torch.rand(size, generator=self._gen) + action[i].sum() + self._t}, [])
            for i, size in enumerate(self.SIZES)
        ]
        return LazyStackedTensorDict(*rows, stack_dim=0)

    def _done(self) -> torch.Tensor:
        return torch.full((*self.batch_size, 1), self._t >= self.max_steps, dtype=torch.bool)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        done = self._done()
        agents = self._agents(torch.zeros(*self.batch_size, 1))
        return TensorDict(
            {"agents": agents, "done": done, "terminated": done.clone()}, batch_size=self.batch_size
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._t += 1
        action = tensordict.get("action")
        done = self._done()
        out = {"agents": self._agents(action), "reward": action.clone(), "done": done}
        return TensorDict({**out, "terminated": done.clone()}, batch_size=self.batch_size)

    def _set_seed(self, seed: int | None) -> None:
        self._gen.manual_seed(int(seed or 0))


def make_hetero_agents_env(**kwargs: Any) -> HeteroAgentsEnv:
    return HeteroAgentsEnv(**kwargs)


class EmptySpecsEnv(EnvBase):
    """An env with empty ``Composite`` entries in its specs: a batched env of it fails TorchRL's
    empty-spec check (``RemoveEmptySpecs`` is the documented fix); the message names the class."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        self.observation_spec = Composite(observation=Unbounded(shape=(OBS,)), other=Composite())
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self.state_spec = Composite(state=Composite(sub=Composite()))

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        return self.observation_spec.zero().update(self.full_done_spec.zero())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = self.observation_spec.zero().update(self.full_done_spec.zero())
        return out.update(self.full_reward_spec.zero())

    def _set_seed(self, seed: int | None) -> None:
        pass


def make_empty_specs_env(**kwargs: Any) -> EmptySpecsEnv:
    return EmptySpecsEnv(**kwargs)
