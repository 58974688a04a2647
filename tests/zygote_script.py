"""Run as a script by tests/test_zygote.py: ``python tests/zygote_script.py MODE OUT_DIR``.

Sets up the main process as ``MODE`` says (a second thread, a started OpenMP pool, initialised
CUDA, a pipe and handlers of its own, a zygote that crashes before its report), starts a managed
env on the default path, and writes ``OUT_DIR/result.json``: the server's kind and fallback
reason, ``stats()["server_zygote"]``, the log records, and what each worker saw
(``OUT_DIR/worker-<pid>.json``, by :func:`make`)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import sys
import threading
from typing import Any


def make(out_dir: str) -> Any:
    """The env factory: records in the worker what it inherited, then builds a ToyEnv."""
    import numpy
    import torch

    from tests.envs import make_env

    seen = {
        "pid": os.getpid(),
        "sigusr1": repr(signal.getsignal(signal.SIGUSR1)),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "torch": float(torch.rand(1)),
        "numpy": float(numpy.random.rand()),
        "main": getattr(sys.modules["__main__"], "__file__", None),
    }
    with open(os.path.join(out_dir, f"worker-{os.getpid()}.json"), "w") as fh:
        json.dump(seen, fh)
    return make_env()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    mode, out_dir = sys.argv[1], sys.argv[2]
    import functools

    import torch

    import torchrl_ext
    from torchrl_ext import ManagedParallelEnv, _forkserver

    records = _Records()
    logging.getLogger("torchrl_ext").addHandler(records)
    logging.getLogger("torchrl_ext").setLevel(logging.INFO)
    stop = threading.Event()
    thread = None
    pipe_r, pipe_w = os.pipe()
    if mode == "thread":
        thread = threading.Thread(target=stop.wait, name="user-thread")
        thread.start()
    elif mode == "openmp":
        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)
    elif mode == "cuda":
        torch.zeros(1, device="cuda")
    elif mode == "zygote_crash":
        # The zygote is a fork of this process: it runs this patch instead of becoming a server.
        def crash(*args: Any) -> None:
            raise RuntimeError("injected: the zygote fails before its report")

        _forkserver._become_zygote = crash  # type: ignore[assignment]
    elif mode == "handlers":
        signal.signal(signal.SIGUSR1, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        atexit.register(lambda: open(os.path.join(out_dir, f"atexit-{os.getpid()}"), "w").close())
    print("printed once by the main process")  # buffered: stdout is a pipe
    early = torchrl_ext.start_fork_server() if mode == "early" else None
    env = ManagedParallelEnv(3, functools.partial(make, out_dir))
    env.reset()
    env.rollout(3)
    stats = env.stats()
    kind, fallback = _forkserver.server_kind()
    # This process lets go of its pipe: no fork of it may hold the write end open.
    os.close(pipe_w)
    pipe_eof = bool(select.select([pipe_r], [], [], 10)[0]) and os.read(pipe_r, 1) == b""
    result = {
        "start_method": env.start_method,
        "kind": kind,
        "fallback": fallback,
        "early": early,
        "server_zygote": stats.get("server_zygote"),
        "log": records.lines,
        "pipe_eof": pipe_eof,
        "workers": env.worker_pids,
        "server_pid": (_forkserver.server_key() or (None,))[0],
    }
    env.close()
    stop.set()
    if thread is not None:
        thread.join()
    with open(os.path.join(out_dir, "result.json"), "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
