"""Run as a script (``python tests/main_factory_script.py NAME --ready PATH``): env factories
defined in ``__main__``, a function and a lambda, on the default (preloaded) path, as they
work under spawn. Writes what each env did to PATH, then exits without closing the last env."""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv


def factory() -> Any:
    return make_env(loader="persistent")


if __name__ == "__main__":
    ready = sys.argv[sys.argv.index("--ready") + 1]
    out: dict[str, Any] = {}
    envs = []
    for name, fn in (("function", factory), ("lambda", lambda: make_env(loader="per_reset"))):
        env = ManagedParallelEnv(2, fn, daemon_workers=False)
        out[name] = {"start_method": env.start_method, "steps": int(env.rollout(3).shape[-1])}
        envs.append(env)
    envs[0].close()
    out["report"] = [w.outcome for w in envs[0].supervision_report.workers]
    with open(ready + ".tmp", "w") as fh:
        json.dump(out, fh)
    import os

    os.replace(ready + ".tmp", ready)
    # envs[1] stays open: the exit hook closes it, then stops the fork server.
