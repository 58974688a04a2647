"""Run as a script: ``python argv_script.py upstream|managed OUT_DIR default|METHOD``.

It reads ``sys.argv`` at module level, above its ``__main__`` guard, as many training scripts
do: spawn sets ``sys.argv`` (and the working directory, ``sys.path``, ...) before it imports the
main module in a child, so this works with upstream's default. Each process other than the
main one that builds the env writes what it sees of its interpreter to ``OUT_DIR/<pid>.json``
(tests/contract/test_contract_process.py compares upstream's and ours).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

IMPL, OUT_DIR, START = sys.argv[1], sys.argv[2], sys.argv[3]  # at module level, on purpose


def probe() -> Any:
    from tests.contract.envs import make_counting_env

    if os.getpid() != int(os.environ["ARGV_SCRIPT_MAIN_PID"]):
        main = sys.modules["__main__"]
        seen = {
            "argv": sys.argv,
            "cwd": os.getcwd(),
            # Without repeats: a module may insert its own entry again when the worker imports it
            # (ray does), which says nothing about what the process was started with.
            "sys.path": list(dict.fromkeys(sys.path)),
            "__main__.__name__": main.__name__,
            "__main__.__file__": getattr(main, "__file__", None),
            "__main__.__spec__": repr(getattr(main, "__spec__", None)),
            "module-level IMPL": IMPL,
        }
        with open(os.path.join(OUT_DIR, f"{os.getpid()}.json"), "w") as fh:
            json.dump(seen, fh)
    return make_counting_env()


if __name__ == "__main__":
    from torchrl.envs import ParallelEnv

    from torchrl_ext import ManagedParallelEnv

    os.environ["ARGV_SCRIPT_MAIN_PID"] = str(os.getpid())
    cls = ParallelEnv if IMPL == "upstream" else ManagedParallelEnv
    # "default": the default path, no start method and no daemon flag.
    env = cls(2, probe) if START == "default" else cls(2, probe, mp_start_method=START)
    try:
        env.rollout(2)
        print(env.start_method if isinstance(env, ManagedParallelEnv) else "upstream")
    finally:
        env.close()
