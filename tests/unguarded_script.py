"""Run as a script: builds an env at import, without the ``__main__`` guard that spawn (and the
preloaded fork server, which imports the script once) needs. Must fail with a PreloadError
that says so, not hang (tests/test_forkserver.py)."""

import functools

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv

env = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False)
env.close(raise_if_closed=False)
