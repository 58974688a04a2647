"""A misspelt keyword argument gets TorchRL's own ``TypeError``, word for word upstream's
(docs/troubleshooting.md, "ValueError at construction")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torchrl.envs import ParallelEnv

from tests.conftest import ROOT, WORKER_STARTS, child_env, start_kwargs
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


_BUILD_MISSPELT = """
import json, sys
import psutil
from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv

kwargs = json.loads(sys.argv[1])
try:
    ManagedParallelEnv(2, make_env, daemon_workers=False, **kwargs)
except TypeError as err:
    children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"error": str(err), "children": children}))
"""


@pytest.mark.compat
@pytest.mark.parametrize("method", WORKER_STARTS)
def test_a_misspelt_keyword_is_refused_before_anything_starts(method: str) -> None:
    """docs/troubleshooting.md: every option is checked before anything starts. A fresh
    interpreter builds an env with a misspelt keyword: TorchRL's ``TypeError``, and no process
    was started for it (before, the preloaded server was started first, then the error came)."""
    kwargs = {"shutdown_timout": 1, **start_kwargs(method)}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_MISSPELT, json.dumps(kwargs)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "got an unexpected keyword argument 'shutdown_timout'" in seen["error"]
    assert seen["children"] == [], seen["children"]
