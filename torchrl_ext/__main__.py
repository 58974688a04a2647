"""Command line: ``python -m torchrl_ext doctor [--json]``,
``python -m torchrl_ext status [--json] [--watch SECONDS]`` and
``python -m torchrl_ext sweep [--kill] [--grace SECONDS]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (0: nothing is left)."""
    parser = argparse.ArgumentParser(prog="python -m torchrl_ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser(
        "sweep",
        help="list processes left by managed envs whose owner process is gone",
        description="List processes of managed envs whose owner is gone (pid dead or reused): "
        "those whose TORCHRL_EXT_OWNER tag names it, and those its reaper recorded in the owner's "
        "runtime directory. Exit code 0 when nothing is left, 1 otherwise.",
    )
    sweep.add_argument(
        "--kill",
        action="store_true",
        help="end them (SIGTERM, grace period, SIGKILL) and remove dead owners' runtime directories",
    )
    sweep.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    sweep.add_argument(
        "--runtime-dir",
        default=None,
        help="where the owners' torchrl_ext-* directories are (default: the temporary directory, $TMPDIR)",
    )
    sweep.add_argument(
        "--owner",
        type=int,
        action="append",
        metavar="PID",
        help="only processes and directories of this (dead) owner pid; may be repeated",
    )
    doctor = sub.add_parser(
        "doctor",
        help="report what this machine supports and what is lost where it does not",
        description="Check this machine: pidfd, PR_SET_PDEATHSIG, child subreaper, whether PID 1 "
        "reaps orphans, /dev/shm, ulimit -n, the start method, the TorchRL/torch versions and Ray's "
        "child-killing setting. One line per check: status, what it means, what to do. Exit code 0 "
        "when every guarantee holds, 1 otherwise.",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.add_argument(
        "--no-orphan-test",
        action="store_true",
        help="judge whether PID 1 reaps by its name instead of making one short-lived test orphan",
    )
    status = sub.add_parser(
        "status",
        help="list the managed envs running on this machine, one line per worker",
        description="Every open ManagedParallelEnv on this machine whose owner runs (from the "
        "status its supervisor publishes about once a second): owner, env, and per worker its "
        "pid, state, CPU %%, tree RSS (the worker and its descendants), children, restarts and "
        "the env's last step latency. Exit code 0.",
    )
    status.add_argument("--json", action="store_true", help="print the envs as JSON")
    status.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="repeat every SECONDS")
    status.add_argument("--runtime-dir", default=None, help="where the torchrl_ext-* directories are")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(json_output=args.json, orphan_test=not args.no_orphan_test)
    if args.command == "status":
        return _status(json_output=args.json, watch=args.watch, base=args.runtime_dir)

    from ._sweep import sweep_orphans

    found, alive, removed = sweep_orphans(
        kill=args.kill, grace=args.grace, base=args.runtime_dir, owners=args.owner
    )
    out = sys.stdout
    for path in removed:
        out.write(f"removed runtime directory {path}\n")
    if not found:
        out.write("no orphaned torchrl_ext processes\n")
        return 0
    for item in found:
        state = "still running" if item in alive else "ended"
        out.write(f"{item.describe()} [{state}]\n")
    if alive:
        hint = "" if args.kill else " (run with --kill to end them)"
        out.write(f"{len(alive)} orphaned process(es) left{hint}\n")
        return 1
    out.write(f"ended {len(found)} orphaned process(es)\n")
    return 0


def _status(*, json_output: bool, watch: float | None, base: str | None) -> int:
    import time

    from ._status import as_json, format_table, read_envs

    while True:
        envs = read_envs(base)
        text = as_json(envs) if json_output else format_table(envs)
        if watch is not None and not json_output:
            text = (
                "\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + f"every {watch:g}s (Ctrl-C to stop)\n" + text
            )
        sys.stdout.write(text)
        sys.stdout.flush()
        if watch is None:
            return 0
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return 0


def _doctor(*, json_output: bool, orphan_test: bool) -> int:
    from ._doctor import exit_code, format_json, format_text, run_checks

    checks = run_checks(orphan_test=orphan_test)
    sys.stdout.write(format_json(checks) if json_output else format_text(checks))
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
