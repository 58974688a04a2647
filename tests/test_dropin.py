"""Drop-in details that have no upstream twin to compare with: patches of TorchRL's functions
made by the user survive, and the spec-reading process shows the factory what upstream's main
process would (the contract suite in ``tests/contract/`` compares everything else with upstream).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrl.envs import batched_envs

from tests.conftest import START_METHODS, WORKER_STARTS, start_kwargs
from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv

# TorchRL's own functions, as this module found them at import (in the test process and in
# every spawned or forkserver child).
_TORCHRL_ENTRY = batched_envs._run_worker_pipe_shared_mem
_TORCHRL_METADATA = batched_envs.get_env_metadata


def recording_entry(**kwargs: Any) -> None:
    """A user's patch of TorchRL's worker function: leaves a file, then runs TorchRL's."""
    record = kwargs["env_fun_kwargs"].get("record_dir")
    if record:
        Path(record, f"entry-{os.getpid()}").touch()
    _TORCHRL_ENTRY(**kwargs)


def recording_metadata(fn: Any, kwargs: Any = None, **extra: Any) -> Any:
    """A user's patch of TorchRL's spec reader: leaves a file, then runs TorchRL's."""
    record = (kwargs or {}).get("record_dir")
    if record:
        Path(record, f"metadata-{os.getpid()}").touch()
    return _TORCHRL_METADATA(fn, kwargs, **extra)


def env_with_record_dir(record_dir: str = "", **kwargs: Any) -> Any:
    return make_env(**kwargs)


def threads_env(record_dir: str, **kwargs: Any) -> Any:
    """Records the thread count and pid the factory sees, per process."""
    Path(record_dir, f"threads-{os.getpid()}").write_text(str(torch.get_num_threads()))
    return make_env(**kwargs)


@pytest.mark.compat
@pytest.mark.parametrize("method", START_METHODS)
def test_users_patches_of_torchrl_are_used_and_kept(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch of ``get_env_metadata`` or a worker function made before the env starts is
    called (in the spec-reading process and in every worker) and is still in place after."""
    monkeypatch.setattr(batched_envs, "_run_worker_pipe_shared_mem", recording_entry)
    monkeypatch.setattr(batched_envs, "get_env_metadata", recording_metadata)
    env = ManagedParallelEnv(
        2,
        env_with_record_dir,
        create_env_kwargs={"record_dir": str(tmp_path)},
        daemon_workers=False,
        mp_start_method=method,
    )
    assert batched_envs.get_env_metadata is recording_metadata, "construction erased the patch"
    try:
        env.reset()
        assert batched_envs._run_worker_pipe_shared_mem is recording_entry, "start erased the patch"
        entries = {p.name for p in tmp_path.glob("entry-*")}
        assert entries == {f"entry-{pid}" for pid in env.worker_pids}
    finally:
        env.close()
    assert len(list(tmp_path.glob("metadata-*"))) == 1


@pytest.mark.compat
@pytest.mark.parametrize("method", WORKER_STARTS)
def test_spec_reading_process_runs_the_workers_thread_count(method: str, tmp_path: Path) -> None:
    """Upstream builds the spec-reading env in the main process; ours builds it in a helper
    that, having another pid, must look like a worker by upstream's rules: it runs
    ``num_sub_threads`` torch threads, as TorchRL sets them in each worker (and the same as the
    workers, which record theirs too)."""
    sub_threads = torch.get_num_threads() + 1  # never what the main process runs
    env = ManagedParallelEnv(
        2,
        functools.partial(threads_env, str(tmp_path)),
        daemon_workers=False,
        num_sub_threads=sub_threads,
        **start_kwargs(method),
    )
    try:
        env.reset()
    finally:
        env.close()
    seen = [int(p.read_text()) for p in tmp_path.glob("threads-*")]
    assert len(seen) == 3, seen  # the spec-reading process and the 2 workers
    assert seen == [sub_threads] * 3
