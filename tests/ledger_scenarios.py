"""Exit scenarios of an ``EpisodeLedger`` (``python -m tests.ledger_scenarios NAME ...``).

The owner builds a ledger with 2 readers and a ``ManagedParallelEnv`` of 2 workers that replay
it, steps until every process exists, writes ``--ready`` (its pid, the ledger's processes),
then steps forever: the test ends it (SIGKILL, SIGTERM, SIGINT) or, for ``exit_without_close``,
it returns from ``main`` with nothing closed (and must then exit by itself).
"""

from __future__ import annotations

import tempfile

# A weakref.finalize registered before multiprocessing is imported, as many programs have one:
# interpreter exit then runs multiprocessing's join of the children before such finalizers.
_EARLY = tempfile.TemporaryDirectory()

import argparse  # noqa: E402
import signal  # noqa: E402

import psutil  # noqa: E402

from tests.ledger_envs import Episodes, make_ledger_env  # noqa: E402
from tests.scenarios import _ready  # noqa: E402
from torchrl_ext import ManagedParallelEnv  # noqa: E402
from torchrl_ext.data import EpisodeLedger  # noqa: E402

LEDGER = None  # kept globally, as users keep them
ENV = None


def main() -> int:
    global LEDGER, ENV
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--method", default="fork")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    LEDGER = EpisodeLedger(Episodes(16), num_readers=2, seed=0)
    start = {} if args.method == "preloaded" else {"mp_start_method": args.method}
    ENV = ManagedParallelEnv(2, make_ledger_env, create_env_kwargs={"episodes": LEDGER}, **start)
    ENV.rollout(8, break_when_any_done=False)
    tree = [p.pid for p in psutil.Process().children(recursive=True)]
    _ready(args.ready, workers=ENV.worker_pids, ledger=LEDGER.pids(), tree=tree)
    if args.name == "exit_without_close":
        return 0
    while True:
        ENV.rollout(8, break_when_any_done=False)


if __name__ == "__main__":
    raise SystemExit(main())
