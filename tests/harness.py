"""Run a command under a child-subreaper and account for every process it leaves behind.

Usage: ``python tests/harness.py OUT.json LINGER -- CMD...``

The harness makes itself a child subreaper (Linux), runs CMD, and once CMD has exited keeps
watching every descendant that was re-parented to it: it records how long after CMD's death
each one disappeared, reaps them all (this process owns nothing else, so reaping any child is
safe here) and records their exit codes, and SIGKILLs whatever is still alive LINGER seconds
later, marking it leaked (as it does with a process it still cannot reap ``UNREAPED_WAIT``
seconds after that: one whose main thread has exited while other threads run on). The result
goes to OUT.json. Written for tests: it keeps fault scenarios from leaving zombies on a
machine whose PID 1 does not reap.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36
#: Seconds to wait, once nothing runs any more, for the threads of zombie processes to end.
UNREAPED_WAIT = 30.0


#: Exit code (negative: killed by that signal) of every process this harness reaped.
EXIT_CODES: dict[int, int] = {}


def _reap_all() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        EXIT_CODES[pid] = os.waitstatus_to_exitcode(status)


def _write_json(path: str, data: object) -> None:
    """Write ``data`` to ``path`` at once (a reader never sees a partial file)."""
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh)
    os.replace(path + ".tmp", path)


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return "?"


def main() -> int:
    out_path, linger = sys.argv[1], float(sys.argv[2])
    cmd = sys.argv[sys.argv.index("--") + 1 :]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    me = psutil.Process()
    child = subprocess.Popen(cmd)
    seen: dict[int, dict[str, object]] = {}
    while child.poll() is None:
        before = len(seen)
        for proc in me.children(recursive=True):
            if proc.pid not in seen:
                seen[proc.pid] = {"pid": proc.pid, "cmdline": _describe(proc)}
        if len(seen) > before:  # what a test waits for before it kills (Scenario.wait_seen)
            _write_json(out_path + ".seen", sorted(seen))
        time.sleep(0.02)
    died_at = time.monotonic()
    result: dict[str, object] = {"returncode": child.returncode}
    survivors: dict[int, dict[str, object]] = {}
    leaked = []
    while True:
        now = time.monotonic()
        alive = []
        for proc in me.children(recursive=True):
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            alive.append(proc)
            # A process that is exiting shows an empty command line: name it by what it was.
            described = _describe(proc) or str(seen.get(proc.pid, {}).get("cmdline", ""))
            info = survivors.setdefault(proc.pid, {"pid": proc.pid, "cmdline": described})
            info["last_seen_after"] = now - died_at
        _reap_all()
        if not alive:
            break
        if now - died_at > linger:
            for proc in alive:
                leaked.append({"pid": proc.pid, "cmdline": _describe(proc)})
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
            _reap_all()
            break
        time.sleep(0.01)
    # A process whose main thread has exited shows as a zombie while its other threads still
    # run, and cannot be reaped until they have ended: wait for those too, and report (and
    # kill) whatever still runs at the deadline instead of leaving it behind unmentioned.
    deadline = time.monotonic() + UNREAPED_WAIT
    while me.children() and time.monotonic() < deadline:
        _reap_all()
        time.sleep(0.01)
    unreaped = me.children()
    for proc in unreaped:
        leaked.append({"pid": proc.pid, "cmdline": _describe(proc), "unreaped": True})
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(unreaped, timeout=5)
    _reap_all()
    result["survivors"] = list(survivors.values())
    result["leaked"] = leaked
    result["seen_before_death"] = list(seen.values())
    result["exit_codes"] = {str(pid): code for pid, code in EXIT_CODES.items()}
    _write_json(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
