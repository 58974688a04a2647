"""A misspelt keyword argument gets TorchRL's own ``TypeError``, word for word upstream's
(docs/troubleshooting.md, "ValueError at construction")."""

from __future__ import annotations

import pytest
from torchrl.envs import ParallelEnv

from tests.conftest import WORKER_STARTS, start_kwargs
from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv


@pytest.mark.compat
@pytest.mark.parametrize("method", WORKER_STARTS)
@pytest.mark.parametrize("keyword", ["shutdown_timout", "max_restart"])  # upstream's, ours
def test_misspelt_keyword_raises_torchrl_type_error(keyword: str, method: str) -> None:
    kwargs = {keyword: 1, **start_kwargs(method)}
    with pytest.raises(TypeError) as upstream:
        ParallelEnv(2, make_env, **kwargs)
    with pytest.raises(TypeError) as managed:
        ManagedParallelEnv(2, make_env, daemon_workers=False, **kwargs)
    assert f"got an unexpected keyword argument '{keyword}'" in str(managed.value)
    assert str(managed.value) == str(upstream.value)
