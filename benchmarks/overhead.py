"""What supervision costs: ManagedParallelEnv vs upstream torchrl.envs.ParallelEnv.

Four measurements, every trial in a fresh interpreter, the two classes interleaved:

* steps/s on a trivial env (2 workers, median of interleaved repeats, paired ratio), and
  ManagedParallelEnv with its statistics on (read with ``stats(workers="both")`` every 100 steps,
  as a ``LoggerMonitor`` would) against off (``collect_stats=False``), measured as
  ``stats_overhead.py`` does (both envs in one interpreter, stepped in turn, the supervisor's
  sampling CPU charged to the on side: a 1 % effect is below the noise of fresh-interpreter
  trials);
* ``close()`` time while every worker holds a persistent ``DataLoader(num_workers=2)``
  (upstream built with ``daemon=False`` so its workers may have children at all);
* worker-death detection: SIGKILL worker 0 mid-rollout, time until the rollout raises;
* cleanup after that death: time until the dead worker's DataLoader children are gone.

Upstream leaves a dead worker's children behind (they exit only when their own watchdog
notices, if ever); this script waits up to ``--cleanup-cap`` seconds, then kills whatever
is left with psutil, so nothing it started survives it. Output:
``benchmarks/results/overhead.md`` (``overhead_quick.md`` with ``--quick``).

    python benchmarks/overhead.py            # about 2.5 minutes
    python benchmarks/overhead.py --quick    # about 2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import stats_overhead
import torch
from _machine import is_helper, run_script_child, system_busy, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CLASSES = ("upstream", "managed")


# ============================================================================ child trials


def _alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def _build(kind: str, loader: bool, workers: int) -> Any:
    import functools

    from torchrl.envs import ParallelEnv

    from torchrl_ext import ManagedParallelEnv

    fn = functools.partial(make_trivial_env_ref(), loader=loader)
    if kind == "managed":
        return ManagedParallelEnv(workers, fn, daemon_workers=False, mp_start_method="fork")
    return ParallelEnv(workers, fn, mp_start_method="fork", daemon=not loader)


def make_trivial_env_ref() -> Any:
    """``make_trivial_env`` imported by module name, so that workers can find it by reference."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trivial_env

    return trivial_env.make_trivial_env


def _rollout(env: Any, steps: int, read_stats: bool = False) -> None:
    td = env.reset()
    for i in range(steps):
        td.set("action", env.action_spec.rand())
        _, td = env.step_and_maybe_reset(td)
        if read_stats and i % 100 == 0:
            env.stats(workers="both")


def _tree_cpu() -> float:
    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def trial_throughput(kind: str, steps: int, workers: int) -> dict[str, Any]:
    env = _build(kind, loader=False, workers=workers)
    try:
        _rollout(env, 300)  # warm-up
        busy, mine = system_busy(), _tree_cpu()
        t = time.perf_counter()
        _rollout(env, steps, read_stats=kind == "managed")
        elapsed = time.perf_counter() - t
        external = (system_busy() - busy - (_tree_cpu() - mine)) / elapsed
    finally:
        env.close()
    return {"steps_per_s": steps / elapsed, "external_cores": max(0.0, external)}


def _loader_children(env: Any) -> list[psutil.Process]:
    procs = []
    for proc in _worker_processes(env):
        with contextlib.suppress(psutil.Error):
            procs.extend(proc.children(recursive=True))
    return procs


def _worker_processes(env: Any) -> list[psutil.Process]:
    pids = [p.pid for p in env._workers]
    return [psutil.Process(pid) for pid in pids]


def trial_close(kind: str, workers: int) -> dict[str, Any]:
    env = _build(kind, loader=True, workers=workers)
    _rollout(env, 200)
    tree = _worker_processes(env) + _loader_children(env)
    t = time.perf_counter()
    env.close()
    close_s = time.perf_counter() - t
    gone_s = _wait_gone(tree, cap=30.0, start=t)
    return {
        "close_s": close_s,
        "tree_gone_s": gone_s,
        "tree": len(tree),
        "left_after_close": len(_alive(tree)),
    }


def _wait_gone(procs: Sequence[psutil.Process], cap: float, start: float) -> float | None:
    while time.perf_counter() - start < cap:
        if not _alive(procs):
            return time.perf_counter() - start
        time.sleep(0.005)
    return None


def trial_death(kind: str, workers: int, cap: float) -> dict[str, Any]:
    env = _build(kind, loader=True, workers=workers)
    _rollout(env, 200)
    victim = _worker_processes(env)[0]
    victim_children = victim.children(recursive=True)
    everything = _worker_processes(env) + _loader_children(env)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.perf_counter())
        os.kill(victim.pid, signal.SIGKILL)

    timer = threading.Timer(0.3, kill)
    timer.start()
    error = None
    detect_s = None
    try:
        _rollout(env, 10_000_000)
    except Exception as err:  # the death surfaces as an exception; which one differs by class
        detect_s = time.perf_counter() - killed_at[0]
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
    finally:
        timer.cancel()
    cleanup_s = _wait_gone([victim, *victim_children], cap=cap, start=killed_at[0])
    with contextlib.suppress(Exception):
        env.close()
    leftover = _alive(everything)
    for proc in leftover:  # upstream leaves these behind: end them ourselves
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(leftover, timeout=5)
    _reap_zombies()
    return {
        "detect_s": detect_s,
        "cleanup_s": cleanup_s,
        "dead_worker_children": len(victim_children),
        "left_after_close": len(leftover),
        "error": error,
    }


def _reap_zombies() -> None:
    for proc in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    mode, kind, workers = spec["mode"], spec["kind"], int(spec["workers"])
    if mode == "throughput":
        return trial_throughput(kind, int(spec["steps"]), workers)
    if mode == "close":
        return trial_close(kind, workers)
    if mode == "death":
        return trial_death(kind, workers, float(spec["cap"]))
    if mode == "stats":
        return stats_overhead.trial(int(spec["steps"]), first=("on", "off")[int(spec["repeat"]) % 2])
    raise ValueError(mode)


# ============================================================================ parent side


def _strays(before: set[int]) -> list[psutil.Process]:
    """Processes that this script (or what it started) left, found by our tag variable."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid in before or proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("TORCHRL_EXT_BENCH_RUN") == RUN_TAG and not is_helper(proc):
                out.append(proc)
    return out


RUN_TAG = f"overhead-{os.getpid()}-{time.time_ns()}"


def run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="torchrl_ext-bench-overhead-") as tmp:
        result, error = run_script_child(
            str(Path(__file__).resolve()),
            spec,
            Path(tmp) / "result.json",
            timeout,
            env={"TORCHRL_EXT_BENCH_RUN": RUN_TAG},
        )
    return {"failed": error} if result is None else result


RAW_KEYS = (("close", "close_s"), ("death", "detect_s"), ("death", "cleanup_s"))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _med(values: Sequence[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def _fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    return "never (capped)" if value is None else f"{value:.{digits}f}{unit}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="timed steps per throughput trial")
    p.add_argument("--repeats", type=int, default=None, help="throughput trials per class")
    p.add_argument("--close-repeats", type=int, default=None)
    p.add_argument("--death-repeats", type=int, default=None)
    p.add_argument("--cleanup-cap", type=float, default=12.0, help="seconds to wait for a dead tree")
    p.add_argument("--max-external", type=float, default=0.3, help="cores other jobs may use during a trial")
    p.add_argument("--retries", type=int, default=2, help="repeats of a disturbed throughput trial")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (1_500 if args.quick else 4_000)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.close_repeats = args.close_repeats or (2 if args.quick else 4)
    args.death_repeats = args.death_repeats or (1 if args.quick else 3)
    if args.out is None:
        args.out = RESULTS / ("overhead_quick.md" if args.quick else "overhead.md")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(json.loads(args.child))
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    before = {p.pid for p in psutil.process_iter()}
    started = time.perf_counter()
    plan: list[dict[str, Any]] = []
    for mode, repeats in (
        ("throughput", args.repeats),
        ("close", args.close_repeats),
        ("death", args.death_repeats),
        ("stats", args.repeats),
    ):
        kinds = ("managed",) if mode == "stats" else CLASSES
        for r in range(repeats):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # each kind first in turn
            for kind in order:
                plan.append(
                    {
                        "mode": mode,
                        "kind": kind,
                        "repeat": r,
                        "workers": args.workers,
                        "steps": args.steps,
                        "cap": args.cleanup_cap,
                    }
                )
    results: list[tuple[dict[str, Any], dict[str, Any]]] = []
    retried = 0
    bar = tqdm(plan, desc="overhead", unit="trial", disable=args.no_progress)
    for spec in bar:
        bar.set_postfix_str(f"{spec['mode']} {spec['kind']} r{spec['repeat']}")
        for _ in range(1 + args.retries):
            wait_for_quiet(args.max_external, max_wait=20.0)
            result = run_trial(spec, timeout=120.0 + args.cleanup_cap)
            if result.get("external_cores", 0.0) <= args.max_external:
                break
            retried += 1
        if "failed" in result:
            tqdm.write(f"{spec['mode']} {spec['kind']}: {result['failed']}")
        results.append((spec, result))
    bar.close()
    strays = _strays(before)
    for proc in strays:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(strays, timeout=5)

    def pick_all(mode: str) -> list[dict[str, Any]]:
        return [r for s, r in results if s["mode"] == mode and "failed" not in r]

    def pick(mode: str, kind: str, key: str) -> list[Any]:
        return [
            r.get(key) for s, r in results if s["mode"] == mode and s["kind"] == kind and "failed" not in r
        ]

    sps = {k: pick("throughput", k, "steps_per_s") for k in CLASSES}
    paired = [m / u for u, m in zip(sps["upstream"], sps["managed"], strict=False)]
    ratio = _med(paired)
    stats_trials = pick_all("stats")
    stats_got = stats_overhead.summary(stats_trials)
    stats_ratio = stats_overhead.charged(stats_got)
    close_med = {k: _med(pick("close", k, "close_s")) for k in CLASSES}
    elapsed = time.perf_counter() - started
    lines = [
        f"# Supervision overhead{' (--quick)' if args.quick else ''}",
        "",
        f"Generated by `python benchmarks/overhead.py{' --quick' if args.quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__.split('+')[0]}, torchrl "
        f"{_version('torchrl')}; {elapsed / 60:.1f} min. {args.workers} workers, start method `fork`, "
        "every trial in a fresh interpreter, the two classes alternating. Other jobs shared the "
        f"machine: every trial waits until they use under {args.max_external:g} cores, and a "
        f"throughput trial during which they used more is repeated ({retried} repeats in all).",
        "",
        "| measurement | upstream ParallelEnv | ManagedParallelEnv | managed / upstream |",
        "|---|---|---|---|",
    ]
    up, man = _med(sps["upstream"]), _med(sps["managed"])
    lines.append(
        f"| steps/s, trivial env (median of {args.repeats}) | {_fmt(up, '', 0)} | {_fmt(man, '', 0)} | "
        f"{_fmt(ratio, 'x', 3)} (median of paired ratios) |"
    )
    lines.append(
        f"| steps/s, ManagedParallelEnv with statistics on / off (`collect_stats=False`; one "
        f"interpreter, stepped in turn, median of {len(stats_trials)}; supervisor CPU charged) | | "
        f"{_fmt(stats_got.get('on'), '', 0)} / {_fmt(stats_got.get('off'), '', 0)} | "
        f"{_fmt(stats_ratio, 'x', 4)} on / off (median of trial ratios: "
        f"{_fmt(stats_got.get('ratio'), 'x', 4)}) |"
    )
    c_up, c_man = close_med["upstream"], close_med["managed"]
    lines.append(
        f"| close() s, workers holding a persistent DataLoader(num_workers=2) | {_fmt(c_up)} | "
        f"{_fmt(c_man)} | {_fmt(None if not c_up or c_man is None else c_man / c_up, 'x', 2)} |"
    )
    for key, label in (
        ("tree_gone_s", "until every worker and loader process is gone, s"),
        ("left_after_close", "processes still alive when close() returned"),
    ):
        vals = {k: _med(pick("close", k, key)) for k in CLASSES}
        lines.append(f"| {label} | {_fmt(vals['upstream'])} | {_fmt(vals['managed'])} | |")
    for key, label in (
        ("detect_s", "worker SIGKILLed: until the rollout raises, s"),
        ("cleanup_s", f"worker SIGKILLed: until its loader children are gone, s (cap {args.cleanup_cap:g})"),
        ("left_after_close", "after the death and close(): processes left (then killed here)"),
    ):
        vals = {k: _med(pick("death", k, key)) for k in CLASSES}
        lines.append(f"| {label} | {_fmt(vals['upstream'])} | {_fmt(vals['managed'])} | |")
    lines.append("")
    errors = {k: sorted({str(e) for e in pick("death", k, "error")}) for k in CLASSES}
    lines.append(f"Exception on worker death: upstream {errors['upstream']}; managed {errors['managed']}.")
    lines.append("")
    raw = {k: [round(v) for v in sps[k]] for k in CLASSES}
    lines.append(
        f"Raw steps/s (trial order): upstream {raw['upstream']}; managed {raw['managed']}; "
        f"statistics on / off per trial {[round(r['ratio'], 4) for r in stats_trials]}; supervisor "
        f"thread CPU on / off per trial {[stats_overhead.cpu_pair(r) for r in stats_trials]}."
    )
    lines.append("")
    for kind in CLASSES:
        raw = {key: [_round(v) for v in pick(mode, kind, key)] for mode, key in RAW_KEYS}
        lines.append(
            f"Raw, {kind}: close() s {raw['close_s']}; death detect s {raw['detect_s']}; "
            f"cleanup s {raw['cleanup_s']}."
        )
        lines.append("")
    failed = [(s["mode"], s["kind"], r["failed"]) for s, r in results if "failed" in r]
    lines.append(f"Failed trials: {failed or 'none'}. Stray processes killed at the end: {len(strays)}.")
    lines.append("")
    lines.append("## Targets")
    lines.append("")
    t1 = ratio is not None and ratio >= 0.97
    t2 = c_up is not None and c_man is not None and c_man < c_up
    lines.append(
        f"* Managed >= 0.97x ParallelEnv steps/s: {_fmt(ratio, 'x')} -> {'met' if t1 else 'NOT met'}"
    )
    t3 = stats_ratio is not None and stats_ratio >= 0.99
    lines.append(
        f"* statistics on >= 0.99x off (supervisor CPU charged): {_fmt(stats_ratio, 'x', 4)} -> "
        f"{'met' if t3 else 'NOT met'}"
    )
    lines.append(
        f"* close() of healthy DataLoader-holding workers faster than upstream: {_fmt(c_man)} s vs "
        f"{_fmt(c_up)} s -> {'met' if t2 else 'NOT met'}"
    )
    lines.append("")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps([{"spec": s, "result": r} for s, r in results], indent=1)
    )
    print(text)
    print(f"wrote {args.out}")
    return 0


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__).split("+")[0]
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
