"""Scale out with Ray: TorchRL's ``RayCollector`` whose remote collectors each own a ManagedParallelEnv.

Nesting, on every node::

    Ray actor (a remote torchrl Collector)             one per --collectors
     └─ ManagedParallelEnv(daemon_workers=False)      the actor owns it
         └─ env worker                                  --envs-per-collector of them
             └─ DataLoader worker                       --loader-workers of them, used in reset()

Run it:

    pip install "torchrl-ext[ray]"
    python examples/ray_scale_out.py --quick            # CI smoke test: local Ray, a few batches
    python examples/ray_scale_out.py                    # local Ray instance, all cores
    python examples/ray_scale_out.py --address auto     # an existing cluster (see below)

Ray's default settings are fine: when ``ray.kill()`` ends an actor, Ray kills the actor's
direct children (the env workers) and torchrl_ext's external reaper, which is not one of them,
ends everything they started (see docs/scale-out.md). The env code below lives in this
script; Ray ships it to the actors by value. With ``--start-method
forkserver`` or ``spawn`` the env workers' DataLoaders re-import it, so put the env in a
module installed on every node instead.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

from torchrl_ext import ManagedParallelEnv

OBS = 4
EPISODE_LEN = 5


class Episodes(Dataset):  # type: ignore[type-arg]
    """Episode ``i`` starts at ``arange(OBS) + 100 * i``: stands in for loading a log from disk."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(OBS, dtype=torch.float32) + 100.0 * i


class ReplayEnv(EnvBase):
    """Each reset takes the next episode from a DataLoader with worker processes."""

    def __init__(self, loader_workers: int = 2, start_method: str = "fork") -> None:
        super().__init__(batch_size=torch.Size([]))
        self.loader_workers = loader_workers
        self.start_method = start_method
        self.observation_spec = Composite(observation=Unbounded(shape=(OBS,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self._episodes: Any = None  # created on the first reset, in the env worker
        self._start = torch.zeros(OBS)
        self._t = 0

    def _next_episode(self) -> torch.Tensor:
        if self._episodes is None:
            loader = DataLoader(
                Episodes(),
                batch_size=None,
                num_workers=self.loader_workers,
                persistent_workers=self.loader_workers > 0,
                multiprocessing_context=self.start_method if self.loader_workers else None,
            )
            self._loader, self._episodes = loader, iter(loader)
        try:
            return next(self._episodes)
        except StopIteration:
            self._episodes = iter(self._loader)
            return next(self._episodes)

    def _reset(self, tensordict: Any = None, **kwargs: Any) -> TensorDict:
        self._start, self._t = self._next_episode().clone(), 0
        done = torch.zeros(1, dtype=torch.bool)
        return TensorDict({"observation": self._start.clone(), "done": done, "terminated": done.clone()}, [])

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self._t += 1
        done = torch.tensor([self._t >= EPISODE_LEN])
        return TensorDict(
            {
                "observation": self._start + self._t,
                "reward": torch.ones(1),
                "done": done,
                "terminated": done.clone(),
            },
            [],
        )

    def _set_seed(self, seed: int | None) -> None:
        pass

    def close(self, *args: Any, **kwargs: Any) -> None:
        self._episodes = self._loader = None
        super().close(*args, **kwargs)


def make_env(envs: int, loader_workers: int, start_method: str) -> ManagedParallelEnv:
    """Runs inside the Ray actor: the actor process owns the env and supervises its tree."""
    return ManagedParallelEnv(
        envs,
        functools.partial(ReplayEnv, loader_workers=loader_workers, start_method=start_method),
        daemon_workers=False,  # env workers may have children (the DataLoader workers)
        mp_start_method=start_method,
    )


def make_policy() -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(torch.nn.Linear(OBS, 1), in_keys=["observation"], out_keys=["action"])


def check(batch: TensorDict) -> None:
    """Every observation is ``arange(OBS) + 100 * episode + t``, with ``t < EPISODE_LEN``."""
    obs = batch["observation"]
    base = obs - torch.arange(OBS, dtype=obs.dtype)
    assert torch.equal(base, base[..., :1].expand_as(base)), "unexpected observation"
    assert bool(((base[..., 0] % 100) < EPISODE_LEN).all()), "unexpected step index"
    assert torch.equal(batch["next", "observation"], obs + 1), "unexpected next observation"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    parser.add_argument("--collectors", type=int, default=None, help="remote collectors (Ray actors)")
    parser.add_argument("--envs-per-collector", type=int, default=None)
    parser.add_argument("--loader-workers", type=int, default=2, help="DataLoader workers per env worker")
    parser.add_argument("--start-method", default="fork", choices=["fork", "forkserver", "spawn"])
    parser.add_argument("--frames-per-batch", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="small and short: for CI")
    args = parser.parse_args(argv)

    import ray
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    quick = args.quick
    collectors = args.collectors or 2
    envs = args.envs_per_collector or (2 if quick else max(1, (os.cpu_count() or 2) // collectors - 1))
    frames = args.frames_per_batch or envs * EPISODE_LEN * (2 if quick else 20)
    batches = args.batches or (3 if quick else 20)

    t0 = time.monotonic()
    if args.address is None:
        num_cpus = args.num_cpus or (collectors if quick else os.cpu_count())
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=not quick)
    else:
        ray.init(address=args.address, log_to_driver=True)
    print(f"ray up in {time.monotonic() - t0:.1f}s: {ray.cluster_resources().get('CPU', 0):.0f} CPUs")

    collector = RayCollector(
        [functools.partial(make_env, envs, args.loader_workers, args.start_method)] * collectors,
        policy_factory=make_policy,
        collector_class=Collector,
        frames_per_batch=frames,
        total_frames=frames * batches,
        # One CPU for the actor's own loop; its env workers and their DataLoader workers run
        # outside Ray's accounting, so leave cores free for them (see docs/scale-out.md).
        remote_configs={"num_cpus": 1, "num_gpus": 0, "memory": 1024**3},
        sync=False,
    )
    try:
        collected = 0
        for i, batch in enumerate(collector):
            check(batch)
            collected += batch.numel()
            print(f"batch {i}: shape {tuple(batch.shape)}, {collected} frames, {time.monotonic() - t0:.1f}s")
    finally:
        collector.shutdown()  # ray.kill() of each remote collector; its env tree goes with it
        ray.shutdown()
    print(f"done: {collected} frames in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
