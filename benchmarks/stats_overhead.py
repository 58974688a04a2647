"""What ``stats()`` costs: ManagedParallelEnv with statistics on against off, to the permille.

Each trial is one fresh interpreter that builds both envs (2 workers each, fork, the trivial env
of ``overhead.py``): ``collect_stats=True``, read with ``stats(workers="both")`` every 100 steps as
a ``LoggerMonitor`` would, and ``collect_stats=False``. After a warm-up it steps them in turn,
one step each (on, off, off, on, ...), and adds up the time of each side's steps, the
``stats()`` reads included; a trial's ratio is off's time over on's, that is on's steps/s over
off's. Interleaving single steps matters on a shared 2-core machine: there, blocks of 500 steps
of one env differ by about 11 % (the scheduler placing three busy processes on two cores), so
alternating blocks left trials 5 % apart; step by step, both sides see the same moment
(10,000-step trials agreed within 0.5 % in a quiet hour, 0.96x to 1.04x in a busy one: take
the median of many). The supervisor's tree sampling runs on its own
thread by the clock, not by the step, so interleaving charges it to both sides: it is reported
apart, as the CPU time of each env's supervisor thread per second of the trial. Output:
``benchmarks/results/stats_overhead.md`` (``_quick`` with ``--quick``).

    python benchmarks/stats_overhead.py            # about 2.5 minutes
    python benchmarks/stats_overhead.py --quick    # about 1 minute
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _machine import run_script_child, wait_for_quiet

RESULTS = Path(__file__).resolve().parent / "results"
#: Steps of each env before the timed ones.
WARMUP = 300
#: ``stats(workers="both")`` is read on the "on" side once every ``READ_EVERY`` steps.
READ_EVERY = 100


def _supervisor_thread(before: set[threading.Thread]) -> threading.Thread:
    """The supervisor thread an env built since ``before`` was taken started (by its name)."""
    new = [t for t in set(threading.enumerate()) - before if t.name.startswith("torchrl_ext-supervisor-")]
    if len(new) != 1:
        raise RuntimeError(f"expected one new supervisor thread, found {[t.name for t in new]}")
    return new[0]


def _thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used (Linux and macOS: its POSIX CPU-time clock)."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def trial(steps: int, first: str = "on") -> dict[str, Any]:
    """``steps`` timed steps of each env, interleaved; ``first``: the side built first."""
    import trivial_env

    from torchrl_ext import ManagedParallelEnv

    fn = functools.partial(trivial_env.make_trivial_env, loader=False)
    order = ("on", "off") if first == "on" else ("off", "on")
    envs: dict[str, Any] = {}
    supervisors: dict[str, threading.Thread] = {}
    tds: dict[str, Any] = {}
    try:
        for side in order:
            before = set(threading.enumerate())
            envs[side] = ManagedParallelEnv(2, fn, mp_start_method="fork", collect_stats=side == "on")
            tds[side] = envs[side].reset()  # starts the workers and the supervisor
            supervisors[side] = _supervisor_thread(before)
        spent = {"on": 0.0, "off": 0.0}
        clock = time.perf_counter
        cpu0: dict[str, float] = {}
        wall0 = 0.0
        for i in range(WARMUP + steps):
            if i == WARMUP:
                cpu0 = {side: _thread_cpu(t) for side, t in supervisors.items()}
                wall0 = clock()
            for side in ("on", "off") if i % 2 else ("off", "on"):
                env = envs[side]
                t = clock()
                tds[side].set("action", env.action_spec.rand())
                _, tds[side] = env.step_and_maybe_reset(tds[side])
                if side == "on" and i % READ_EVERY == 0:
                    env.stats(workers="both")
                if i >= WARMUP:
                    spent[side] += clock() - t
        wall = clock() - wall0
        cpu = {side: (_thread_cpu(t) - cpu0[side]) / wall for side, t in supervisors.items()}
    finally:
        for env in envs.values():
            env.close(raise_if_closed=False)
    return {
        "steps": steps,
        "first": first,
        "on_steps_per_s": steps / spent["on"],
        "off_steps_per_s": steps / spent["off"],
        "ratio": spent["off"] / spent["on"],
        "supervisor_cpu": cpu,
    }


def summary(done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over finished trials: steps/s per side, the ratio, supervisor CPU per side."""
    if not done:
        return {}
    med = statistics.median
    return {
        "on": med(r["on_steps_per_s"] for r in done),
        "off": med(r["off_steps_per_s"] for r in done),
        "ratio": med(r["ratio"] for r in done),
        "low": min(r["ratio"] for r in done),
        "high": max(r["ratio"] for r in done),
        "cpu_on": med(r["supervisor_cpu"]["on"] for r in done),
        "cpu_off": med(r["supervisor_cpu"]["off"] for r in done),
    }


def charged(result: dict[str, Any]) -> float | None:
    """The on / off ratio with the on side's extra supervisor CPU charged to its steps.

    The sampling thread's extra CPU (a fraction of one core) is counted as if each of its
    seconds were lost by the main process: a bound from below, as on an idle core it costs
    the steps nothing."""
    if not result:
        return None
    return float(result["ratio"] * (1.0 - max(0.0, result["cpu_on"] - result["cpu_off"])))


def cpu_pair(result: dict[str, Any]) -> str:
    """A trial's supervisor-thread CPU, on / off, in % of one core."""
    cpu = result["supervisor_cpu"]
    return f"{100 * cpu['on']:.2f} % / {100 * cpu['off']:.2f} %"


def table(done: Sequence[dict[str, Any]]) -> list[str]:
    """The per-trial rows of the results table."""
    lines = [
        "| trial | built first | on steps/s | off steps/s | on / off | supervisor CPU, on / off |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(done):
        lines.append(
            f"| {i + 1} | {r['first']} | {r['on_steps_per_s']:.0f} | {r['off_steps_per_s']:.0f} | "
            f"{r['ratio']:.4f}x | {cpu_pair(r)} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps of each env per trial")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.child:
        spec = json.loads(args.child)
        Path(args.child_out).write_text(json.dumps(trial(spec["steps"], spec["first"])))
        return 0
    trials = args.trials or (3 if args.quick else 7)
    steps = args.steps or (4_000 if args.quick else 10_000)
    started = time.perf_counter()
    results = []
    for i in range(trials):
        load = wait_for_quiet(0.3, max_wait=20.0)
        with tempfile.TemporaryDirectory(prefix="torchrl_ext-bench-stats-") as tmp:
            spec = {"steps": steps, "first": ("on", "off")[i % 2]}
            result, error = run_script_child(str(Path(__file__).resolve()), spec, Path(tmp) / "r.json", 600.0)
        results.append({"load_before": load, **(result or {"failed": error})})
    done = [r for r in results if "failed" not in r]
    got = summary(done)
    bound = charged(got)
    name = "stats_overhead_quick" if args.quick else "stats_overhead"
    lines = [
        f"# Statistics on vs off{' (--quick)' if args.quick else ''}",
        "",
        f"Generated by `python benchmarks/stats_overhead.py{' --quick' if args.quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {torch.__version__.split('+')[0]}; {(time.perf_counter() - started) / 60:.1f} min. "
        f"{trials} trials, each one interpreter with both envs (2 workers, fork), {steps} timed steps "
        f"of each, interleaved step by step; `stats(workers='both')` read every {READ_EVERY} steps on. "
        "Supervisor CPU: each env's supervisor thread, in % of one core over the trial.",
        "",
        *table(done),
        "",
    ]
    if got:
        lines += [
            f"Median of the trials' ratios: **{got['ratio']:.4f}x** (trials {got['low']:.4f}x to "
            f"{got['high']:.4f}x); steps/s on {got['on']:.0f}, off {got['off']:.0f}. Supervisor thread: "
            f"{100 * got['cpu_on']:.2f} % of a core on, {100 * got['cpu_off']:.2f} % off; with the "
            f"difference charged to the on side's steps: **{bound:.4f}x**.",
        ]
    else:
        lines.append("No trial finished.")
    verdict = "met" if bound is not None and bound >= 0.99 else "NOT met"
    lines += [
        "",
        f"Failed trials: {[r['failed'] for r in results if 'failed' in r] or 'none'}.",
        "",
        f"* statistics on >= 0.99x off (supervisor CPU charged): "
        f"{'-' if bound is None else f'{bound:.4f}x'} -> {verdict}",
        "",
    ]
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
