"""Fault scenarios run in a child interpreter (``python -m tests.scenarios NAME ...``).

Each one builds a ManagedParallelEnv whose workers hold DataLoader workers and/or plain
subprocesses, writes ``--ready`` (JSON with its pid) once the interesting state is reached,
then does what its name says. Run under ``tests/harness.py`` by the ``scenario`` fixture.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
from typing import Any

from tests.envs import make_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv

ENV: Any = None  # a global env, as users keep them


def _ready(path: str, **extra: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"pid": os.getpid(), **extra}, fh)
    os.replace(tmp, path)


def _build(args: argparse.Namespace) -> ManagedParallelEnv:
    fn = functools.partial(
        make_env,
        loader=args.loader,
        subprocess_kind=args.subprocess,
        step_sleep=args.step_sleep,
        pid_dir=args.pid_dir,
        hold_gil=args.hold_gil,
        hang_loader_start=args.hang_loader_start,
    )
    return ManagedParallelEnv(
        args.workers,
        fn,
        daemon_workers=False,
        mp_start_method=None if args.method in ("preloaded", "interpreter") else args.method,
        shutdown_timeout=args.shutdown_timeout,
        max_restarts=args.max_restarts,
    )


def _env_in_child(exit_with_parent: bool, progress: str, stop: str) -> None:
    """Target of a multiprocessing child: step a managed env until ``stop`` exists."""
    import logging

    logging.basicConfig(level=logging.WARNING)  # as an application would: our warnings show
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent"),
        daemon_workers=False,
        mp_start_method="fork",
        exit_with_parent=exit_with_parent,
    )
    steps = 0
    while not os.path.exists(stop):
        env.rollout(5, break_when_any_done=False)
        steps += 5
        _ready(progress, workers=env.worker_pids, steps=steps, ppid=os.getppid())
    env.close()


def main() -> int:
    global ENV
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--method", default="fork")
    parser.add_argument("--loader", default="persistent")
    parser.add_argument("--subprocess", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    parser.add_argument("--pid-dir", default=None)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--hold-gil", action="store_true")
    parser.add_argument(
        "--hang-loader-start", action="store_true", help="DataLoader workers never finish starting"
    )
    parser.add_argument("--exit-with-parent", choices=("on", "off"), default="on")
    parser.add_argument("--preload", default=None, help="a module the preloaded fork server imports")
    args = parser.parse_args()
    if args.method == "interpreter":  # the preloaded server as a new interpreter, not a zygote
        os.environ["TORCHRL_EXT_ZYGOTE"] = "0"
    # As in a program started from a terminal, whatever started the test run (nohup, a shell's
    # background job ignores SIGINT): the signal scenarios send these.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

    if args.name == "user_handler":
        marker = args.ready + ".handler"

        def handler(signum: int, frame: Any) -> None:
            with open(marker, "w") as fh:
                fh.write(str(signum))
            sys.exit(7)

        signal.signal(signal.SIGTERM, handler)

    if args.name == "preload_error":
        from torchrl_ext import PreloadError

        try:
            start = {} if args.method == "preloaded" else {"mp_start_method": args.method}
            fn = functools.partial(make_env)
            ManagedParallelEnv(1, fn, daemon_workers=False, preload=[args.preload], **start)
        except PreloadError as err:
            _ready(args.ready, error=str(err), module=err.name)
            return 0
        return 1

    if args.name == "kill_during_start":
        _ready(args.ready, phase="starting")
        ENV = _build(args)
        ENV.reset()
        ENV.rollout(1000, break_when_any_done=False)
        return 0

    if args.name == "parent_of_env_owner":
        # This process only starts a multiprocessing child that owns an env, then dies without
        # any clean-up, as a SIGKILLed trainer would: what the child does is up to its
        # ``exit_with_parent``.
        import multiprocessing

        progress, stop = args.ready + ".progress", args.ready + ".stop"
        child = multiprocessing.get_context("fork").Process(
            target=_env_in_child, args=(args.exit_with_parent == "on", progress, stop)
        )
        child.start()

        def child_stepped() -> bool:
            if not child.is_alive() and not os.path.exists(progress):
                raise AssertionError(f"the env-owning child died first (exit code {child.exitcode})")
            return os.path.exists(progress)

        try:
            wait_until(child_stepped, "the env-owning child finished its first rollout", timeout=120)
        except BaseException:
            child.kill()  # not left stepping: this scenario then fails before ready
            child.join()
            raise
        _ready(args.ready, child=child.pid, progress=progress, stop=stop)
        os._exit(0)

    if args.name == "thread_start":
        # Workers started from a short-lived thread: PR_SET_PDEATHSIG must not kill them
        # when that thread ends.
        holder: dict[str, Any] = {}

        def start() -> None:
            holder["env"] = _build(args)
            holder["env"].reset()

        t = threading.Thread(target=start)
        t.start()
        t.join()
        ENV = holder["env"]
        out = ENV.rollout(3, break_when_any_done=False)
        _ready(args.ready, workers=ENV.worker_pids, steps=int(out.shape[-1]))
        ENV.rollout(1000, break_when_any_done=False)
        return 0

    ENV = _build(args)
    ENV.reset()
    if args.step_sleep < 1 and not args.hold_gil:
        ENV.rollout(3, break_when_any_done=False)
    if args.name == "exit_without_close":
        _ready(args.ready, workers=ENV.worker_pids)
        return 0
    if args.name == "exception_at_top_level":
        _ready(args.ready, workers=ENV.worker_pids)
        raise RuntimeError("user error at top level")
    if args.name == "sys_exit":
        _ready(args.ready, workers=ENV.worker_pids)
        sys.exit(3)
    if args.name == "kill_children_then_exit":
        # What Ray does to an actor by default (kill_child_processes_on_worker_exit): SIGKILL
        # every direct child, then leave without any cleanup.
        import psutil

        _ready(args.ready, workers=ENV.worker_pids)
        for child in psutil.Process().children():
            child.kill()
        os._exit(1)
    if args.name == "restart_then_rollout_forever":
        # A worker is lost and replaced first: the reaper and the sweep must know the new one.
        lost = ENV.worker_pids[1]
        os.kill(lost, signal.SIGKILL)
        ENV.rollout(3, break_when_any_done=False)
        _ready(args.ready, workers=ENV.worker_pids, lost=lost, restarts=len(ENV.restarts))
        while True:
            ENV.rollout(50, break_when_any_done=False)
    if args.name in ("rollout_forever", "user_handler"):
        from torchrl_ext import _forkserver

        server = _forkserver.server_key()  # the preloaded fork server, if this env uses one
        _ready(
            args.ready,
            workers=ENV.worker_pids,
            server=None if server is None else server[0],
            server_kind=_forkserver.server_kind()[0],
        )
        while True:
            ENV.rollout(50, break_when_any_done=False)
    raise SystemExit(f"unknown scenario {args.name}")


if __name__ == "__main__":
    sys.exit(main())
