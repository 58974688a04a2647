"""Collector scenarios and helpers: TorchRL collectors whose env is a ManagedParallelEnv.

Run as ``python -m tests.collector_scenarios NAME --ready FILE ...`` under ``tests/harness.py``
(see ``tests/test_collectors.py``). Each scenario starts a collector whose worker processes
each build a ManagedParallelEnv (``daemon_workers=False``) whose env workers each hold a
``DataLoader(num_workers=2)``, collects a few batches, writes ``--ready`` (JSON with its pid
and the collector workers' pids), then collects forever until it is killed.

The helpers (:func:`make_managed_env`, :func:`make_policy`, :func:`check_toy_batch`,
:func:`read_restart_logs`) are shared with ``tests/test_collectors.py``, ``tests/test_ray.py``
and ``tests/test_restarts.py``; they are importable by reference, so they work under spawn and
inside Ray workers.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.envs import OBS, make_env
from torchrl_ext import ManagedParallelEnv

EPISODE_LEN = 5  # ToyEnv is done after 5 steps
NUM_EPISODES = 8  # ToyEnv's dataset has 8 episodes, then wraps


def collector_classes() -> dict[str, Any]:
    """TorchRL's collectors under their 0.14 names, falling back to the 0.10 ones."""
    from torchrl import collectors

    def pick(*names: str) -> Any:
        for name in names:
            if hasattr(collectors, name):
                return getattr(collectors, name)
        raise ImportError(f"none of {names} in torchrl.collectors")

    return {
        "single": pick("Collector", "SyncDataCollector"),
        "multisync": pick("MultiSyncCollector", "MultiSyncDataCollector"),
        "multiasync": pick("MultiAsyncCollector", "MultiaSyncDataCollector"),
    }


class RestartLoggingEnv(ManagedParallelEnv):
    """A ManagedParallelEnv that keeps its own account of its restarts, in the process that
    owns it (a collector worker): a ``MultiAsyncCollector`` does not deliver every batch its
    workers collect, so the delivered batches cannot prove what a worker saw.

    It appends JSON lines to ``<restart_log>/<owner pid>.jsonl``: one when it is built, then one
    after each ``step_and_maybe_reset`` (what collectors call) that returned a marked transition
    or after which ``restarts`` grew. Each line holds the number of such calls so far
    (``step``), the slots marked in that call's ``("next", "worker_restarted")`` (``marked``)
    and every restart so far (``restarts``: ``[slot, old_pid, new_pid, cause, command]``).
    """

    def __init__(self, *args: Any, restart_log: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # __dict__ directly: ParallelEnv forwards attributes it lacks to the workers.
        self.__dict__["_restart_log"] = os.path.join(restart_log, f"{os.getpid()}.jsonl")
        self.__dict__["_logged_steps"] = 0
        self.__dict__["_logged_restarts"] = 0
        self._log_restarts([])

    def step_and_maybe_reset(self, tensordict: Any) -> Any:
        out, root = super().step_and_maybe_reset(tensordict)
        self.__dict__["_logged_steps"] += 1
        marks = out.get(("next", "worker_restarted"), None)
        marked = [] if marks is None else marks.reshape(-1).nonzero().flatten().tolist()
        if marked or len(self.restarts) != self.__dict__["_logged_restarts"]:
            self._log_restarts(marked)
        return out, root

    def _log_restarts(self, marked: list[int]) -> None:
        restarts = self.restarts
        self.__dict__["_logged_restarts"] = len(restarts)
        line = {
            "pid": os.getpid(),
            "step": self.__dict__["_logged_steps"],
            "marked": marked,
            "restarts": [[r.slot, r.old_pid, r.new_pid, r.cause, r.command] for r in restarts],
        }
        with open(self.__dict__["_restart_log"], "a") as fh:
            fh.write(json.dumps(line) + "\n")


def read_restart_logs(log_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """What each :class:`RestartLoggingEnv` logged in ``log_dir``: owner pid -> its lines."""
    logs = {}
    for path in Path(log_dir).glob("*.jsonl"):
        logs[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return logs


def make_managed_env(
    num_workers: int = 2,
    loader: str = "persistent",
    pid_dir: str | None = None,
    method: str = "fork",
    subprocess_kind: str | None = None,
    restart_log: str | None = None,
    **kwargs: Any,
) -> ManagedParallelEnv:
    """A ManagedParallelEnv of ToyEnvs, each with a DataLoader(num_workers=2) in reset().

    The DataLoader workers are forked (``dl_context="fork"``) whatever the process-wide
    default is: a collector worker started by spawn inherits spawn as its default.
    ``subprocess_kind`` ("plain" or "setsid") adds a simulator subprocess per env worker; it
    is exec'd, so its ``TORCHRL_EXT_OWNER`` tag is visible in ``/proc/PID/environ``.
    ``restart_log`` (a directory) makes it a :class:`RestartLoggingEnv` logging there.
    ``kwargs`` go to ``ManagedParallelEnv``.
    """
    fn = functools.partial(
        make_env, loader=loader, dl_context="fork", pid_dir=pid_dir, subprocess_kind=subprocess_kind
    )
    if restart_log is not None:
        return RestartLoggingEnv(
            num_workers,
            fn,
            daemon_workers=False,
            mp_start_method=method,
            restart_log=restart_log,
            **kwargs,
        )
    return ManagedParallelEnv(num_workers, fn, daemon_workers=False, mp_start_method=method, **kwargs)


def make_policy() -> Any:
    """A deterministic policy for the ToyEnv (its action does not change the observations)."""
    from tensordict.nn import TensorDictModule

    module = torch.nn.Linear(OBS, 1)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


def check_toy_batch(batch: Any, first: bool = False) -> int:
    """Check every observation of a collected batch; returns how many resets it holds.

    In the ToyEnv episode ``i`` (counted per env, from its first reset) observes
    ``arange(4) + 100 * (i % 8) + t`` at step ``t``; it is done after 5 steps. Along the
    last (time) dimension of ``batch`` each env's trajectory must follow that pattern:
    ``next.observation = observation + 1``, ``t`` runs 0..4 and the episode index goes up by
    one (mod 8) at each reset. ``first``: the batch is an env's first, so episode 0 at t=0.
    """
    obs = batch["observation"].reshape(-1, batch.shape[-1], OBS)
    nxt = batch["next", "observation"].reshape(-1, batch.shape[-1], OBS)
    done = batch["next", "done"].reshape(-1, batch.shape[-1])
    base = obs - torch.arange(OBS, dtype=obs.dtype)
    assert torch.equal(base, base[..., :1].expand_as(base)), "observation is not arange(4) + c"
    assert torch.equal(nxt, obs + 1), "next observation is not observation + 1"
    value = base[..., 0].long()
    episode, t = value // 100, value % 100
    assert bool((t < EPISODE_LEN).all()), f"step index out of range: {t}"
    assert torch.equal(done, t == EPISODE_LEN - 1), "done is not set at the 5th step"
    episodes = 0
    for row_ep, row_t in zip(episode.tolist(), t.tolist(), strict=True):
        if first:
            assert (row_ep[0], row_t[0]) == (0, 0), f"first batch starts at {(row_ep[0], row_t[0])}"
        for k in range(1, len(row_t)):
            if row_t[k - 1] == EPISODE_LEN - 1:  # a reset happened in between
                assert row_t[k] == 0, f"episode does not restart at t=0: {row_t}"
                assert row_ep[k] == (row_ep[k - 1] + 1) % NUM_EPISODES, f"episodes out of order: {row_ep}"
                episodes += 1
            else:
                assert (row_ep[k], row_t[k]) == (row_ep[k - 1], row_t[k - 1] + 1), (row_ep, row_t)
    return episodes


def _ready(path: str, **extra: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"pid": os.getpid(), **extra}, fh)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=["single", "multisync", "multiasync"])
    parser.add_argument("--ready", required=True)
    parser.add_argument("--collector-method", default="fork", help="start method of collector workers")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--loader", default="persistent")
    parser.add_argument("--pid-dir", default=None)
    args = parser.parse_args()

    # Multi-collectors start their workers with the process-wide default start method.
    multiprocessing.set_start_method(args.collector_method, force=True)
    env_fn = functools.partial(
        make_managed_env, num_workers=args.env_workers, loader=args.loader, pid_dir=args.pid_dir
    )
    cls = collector_classes()[args.name]
    frames = 2 * args.env_workers * EPISODE_LEN
    envs = env_fn() if args.name == "single" else [env_fn, env_fn]
    collector = cls(envs, make_policy(), frames_per_batch=frames, total_frames=-1)
    for batches, batch in enumerate(collector, start=1):
        check_toy_batch(batch)
        if batches == 2:
            workers = [p.pid for p in getattr(collector, "procs", [])]  # none for "single"
            _ready(args.ready, collector_workers=workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
