"""Keep every core busy: one spinning process per usable CPU (used by ``make test-stress``).

Usage: ``python tests/cpu_hog.py [N]`` (default ``N``: the CPUs this process may run on, as
``nproc`` counts them). Standard library only, so that no system package is needed.

The hog ends by itself as soon as the process that started it goes away (its parent pid
changes: the parent exited or was killed, even by SIGKILL), and on SIGTERM, SIGINT or SIGHUP;
either way it SIGKILLs and reaps its spinners first. A spinner whose hog is gone (SIGKILLed)
notices its own parent change within ``CHECK_EVERY`` seconds and exits too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: Seconds between two checks of the parent pid.
CHECK_EVERY = 0.2


def _spin(hog: int) -> None:
    """Burn a core until ``hog`` is no longer this process's parent."""
    x = 1
    next_check = time.monotonic() + CHECK_EVERY
    while True:
        for _ in range(20_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        now = time.monotonic()
        if now >= next_check:
            if os.getppid() != hog:
                os._exit(0)
            next_check = now + CHECK_EVERY


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    count = int(argv[1]) if len(argv) > 1 else len(os.sched_getaffinity(0))
    parent = os.getppid()
    hog = os.getpid()
    spinners: list[int] = []
    try:
        for _ in range(count):
            pid = os.fork()
            if pid == 0:  # default signal handlers: a SIGTERM or Ctrl-C ends a spinner at once
                try:
                    _spin(hog)
                finally:
                    os._exit(0)
            spinners.append(pid)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _stop)
        print(f"cpu_hog: pid {hog}, {count} spinner(s) {spinners}, watching parent {parent}", flush=True)
        while os.getppid() == parent:
            time.sleep(CHECK_EVERY)
        return 0
    finally:
        for pid in spinners:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in spinners:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv))
