"""N env workers sharing one dataset: one ``EpisodeLedger`` against one loader per worker.

Every run steps a ``ManagedParallelEnv`` of ``LogReplayEnv`` workers (``examples/log_replay.py``:
a reset needs the next log file read and parsed, a step does a little compute) over the same
generated files, in a fresh interpreter, with the configurations interleaved:

1. ``ledger``   one ``torchrl_ext.data.EpisodeLedger(num_readers=2)`` built in the main process;
                every worker asks it for the next episode of one shared order
2. ``loaders``  one ``torchrl_ext.data.EpisodeLoader(num_workers=2)`` per env worker, each with
                its own order (what a user writes without the ledger)
3. ``oracle``   every episode preloaded in each worker: a reset costs nothing (upper bound)

for each number of env workers (default 2, 4, 8). ``--cluster`` adds the cluster row, on a Ray
cluster of 2 worker nodes started on this machine (``ray.cluster_utils.Cluster``), each node an
actor owning a ``ManagedParallelEnv`` of 2 env workers, both configurations in the same child
interpreter and the same cluster, their order alternating between repeats:

4. ``cluster``  one ``torchrl_ext.data.ClusterEpisodeLedger`` over the whole dataset
5. ``per_node`` one ``EpisodeLedger`` per node, each over the whole dataset (what a user writes
                without the cluster ledger: each episode played once per node per epoch)

both with ``num_readers=0`` (env workers load by index, on their node).

Reported per cell: frames/s (median of the repeats), processes (env workers plus the processes
that load data: the main process and the helpers every configuration has are not counted; the
whole tree's peak is given too), the
tree's peak PSS, and, from the episodes the workers actually played, duplicates per epoch and
coverage. An epoch of the ledger is its own; for the other configurations it is each run of
``len(dataset)`` consecutive resets across all workers (the data a user calls "one epoch").

    python benchmarks/ledger_scale.py            # about 8 minutes on 2 cores
    python benchmarks/ledger_scale.py --quick    # about 3 minutes
    python benchmarks/ledger_scale.py --quick --cluster --envs '' --configs ''  # the cluster row only

Results: ``benchmarks/results/ledger_scale.md`` (``_quick.md``) and the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from _machine import interleaved, is_helper, run_script_child, wait_for_quiet
from heavy_reset import EXAMPLES, RESULTS, TreeMonitor

CONFIGS = {
    "ledger": ("Managed, one EpisodeLedger (2 readers)", "ledger"),
    "loaders": ("Managed, EpisodeLoader per worker (2 loader workers each)", "episode_loader"),
    "oracle": ("Managed, preloaded (oracle)", "oracle"),
}


CLUSTER_CONFIGS = {
    "cluster": "Ray, 2 nodes x 2 env workers, one ClusterEpisodeLedger",
    "per_node": "Ray, 2 nodes x 2 env workers, one EpisodeLedger per node",
}
#: Worker nodes of the cluster row, and env workers per node.
CLUSTER_NODES, CLUSTER_ENVS = 2, 2


# ============================================================================ child process
class _Host:
    """A Ray actor on one node owning a ManagedParallelEnv of LogReplayEnv workers; with
    ``ledger`` None it builds an EpisodeLedger of its own (one per node)."""

    def __init__(self, spec: dict[str, Any], ledger: Any, stats_dir: str) -> None:
        sys.path.insert(0, str(EXAMPLES))
        import log_replay

        from torchrl_ext import ManagedParallelEnv
        from torchrl_ext.data import EpisodeLedger

        self.own = None
        if ledger is None:
            dataset = log_replay.LogDataset(spec["paths"], "local")
            self.own = ledger = EpisodeLedger(dataset, num_readers=0, seed=int(spec["seed"]))
        make_env = functools.partial(
            log_replay.LogReplayEnv,
            spec["paths"],
            "ledger",
            "local",
            step_work=spec["step_work"],
            stats_dir=stats_dir,
            episodes=ledger,
        )
        self.env = ManagedParallelEnv(CLUSTER_ENVS, make_env, daemon_workers=False, mp_start_method="fork")
        self.td = self.env.reset()

    def processes(self) -> int:
        """Env workers, plus this node's own ledger processes."""
        return len(self.env.worker_pids) + (len(self.own.pids()) if self.own is not None else 0)

    def play(self, frames: int) -> float:
        started = time.perf_counter()
        for _ in range(frames // CLUSTER_ENVS):
            self.td.set("action", self.env.action_spec.rand())
            _, self.td = self.env.step_and_maybe_reset(self.td)
        return time.perf_counter() - started

    def close(self) -> None:
        self.env.close()
        if self.own is not None:
            self.own.close()


def _played(stats_dir: Path) -> list[tuple[float, str, int]]:
    played = []
    for path in stats_dir.glob("played-*.txt"):
        for line in path.read_text().splitlines():
            stamp, fingerprint, epoch = line.split()
            played.append((float(stamp), fingerprint, int(epoch)))
    return sorted(played)


def run_cluster_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Both cluster configurations, in ``spec["order"]``, on one local Ray cluster."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from torchrl_ext.data import ClusterEpisodeLedger

    sys.path.insert(0, str(EXAMPLES))
    import log_replay

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    results: dict[str, Any] = {}
    try:
        nodes = [cluster.add_node(num_cpus=CLUSTER_ENVS) for _ in range(CLUSTER_NODES)]
        search = [str(EXAMPLES), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(search)}},  # log_replay's datasets
        )
        cluster.wait_for_nodes()
        host_class = ray.remote(num_cpus=0, max_restarts=0)(_Host)
        for config in spec["order"]:
            stats_dir = Path(spec["stats_dir"]) / config
            stats_dir.mkdir(parents=True, exist_ok=True)
            ledger = None
            if config == "cluster":
                dataset = log_replay.LogDataset(spec["paths"], "local")
                ledger = ClusterEpisodeLedger(dataset, num_readers=0, seed=int(spec["seed"]))
            hosts = [
                host_class.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
                ).remote(spec, ledger, str(stats_dir))
                for node in nodes
            ]
            try:
                processes = sum(ray.get([h.processes.remote() for h in hosts]))
                if ledger is not None:
                    processes += 1 + sum(len(p) for p in ledger.pids().values())  # its actor, agents
                per_host = int(spec["frames"]) // CLUSTER_NODES
                t0 = time.perf_counter()
                ray.get([h.play.remote(per_host) for h in hosts])
                wall = time.perf_counter() - t0
                ledger_stats = ledger.stats() if ledger is not None else {}
                ray.get([h.close.remote() for h in hosts])
            finally:
                for host in hosts:
                    ray.kill(host)
                if ledger is not None:
                    ledger.close()
            results[config] = {
                "fps": per_host * CLUSTER_NODES / wall,
                "processes": processes,
                "played": _played(stats_dir),
                "ledger": ledger_stats,
            }
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    return results


def _data_processes() -> int:
    """Processes of this run that are neither the main process nor a helper."""
    found = 0
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and not is_helper(proc):
                found += 1
    return found


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    if "order" in spec:
        return run_cluster_child(spec)
    sys.path.insert(0, str(EXAMPLES))
    import log_replay

    from torchrl_ext import ManagedParallelEnv
    from torchrl_ext.data import EpisodeLedger

    n = int(spec["envs"])
    config = spec["config"]
    stats_dir = Path(spec["stats_dir"])
    stats_dir.mkdir(parents=True, exist_ok=True)
    ledger = None
    if config == "ledger":
        dataset = log_replay.LogDataset(spec["paths"], "local")
        ledger = EpisodeLedger(
            dataset,
            num_readers=2,
            seed=int(spec["seed"]),
            prefetch=int(spec["prefetch"]),
            reader_nice=spec["reader_nice"],
        )
    make_env = functools.partial(
        log_replay.LogReplayEnv,
        spec["paths"],
        CONFIGS[config][1],
        "local",
        num_workers=2,
        prefetch=2,
        mp_context="fork",
        step_work=spec["step_work"],
        stats_dir=str(stats_dir),
        episodes=ledger,
    )
    env = ManagedParallelEnv(n, make_env, daemon_workers=False, mp_start_method="fork")
    try:
        env.set_seed(int(spec["seed"]))
        td = env.reset()
        t0 = time.perf_counter()
        frames = processes = 0
        while frames < spec["frames"]:
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
            frames += n
            if frames % (50 * n) == 0:
                processes = max(processes, _data_processes())
        wall = time.perf_counter() - t0
        ledger_stats = ledger.stats() if ledger is not None else {}
    finally:
        env.close()
        if ledger is not None:
            ledger.close()
    return {
        "fps": frames / wall,
        "processes": processes,
        "played": _played(stats_dir),
        "ledger": ledger_stats,
    }


# ============================================================================ parent side
def epoch_figures(played: Sequence[Sequence[Any]], num_episodes: int) -> tuple[float, float, int]:
    """``(duplicates per epoch, coverage, epochs)`` over the complete epochs of ``played``
    (``[time, fingerprint, ledger epoch]`` rows, in time order)."""
    if played and played[0][2] >= 0:  # the ledger's own epochs; the newest may be unfinished
        by_epoch: dict[int, list[str]] = defaultdict(list)
        for _t, fingerprint, epoch in played:
            by_epoch[epoch].append(fingerprint)
        epochs = [by_epoch[e] for e in sorted(by_epoch)[:-1]]
    else:  # consecutive runs of num_episodes resets
        rows = [fingerprint for _t, fingerprint, _e in played]
        epochs = [rows[i : i + num_episodes] for i in range(0, len(rows) - num_episodes + 1, num_episodes)]
    if not epochs:
        return float("nan"), float("nan"), 0
    duplicates = [sum(c - 1 for c in Counter(e).values()) for e in epochs]
    coverage = [len(set(e)) / num_episodes for e in epochs]
    return statistics.fmean(duplicates), statistics.fmean(coverage), len(epochs)


def run_one(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    monitor = TreeMonitor()
    out_path = Path(spec["stats_dir"]) / "result.json"
    result, error = run_script_child(
        str(Path(__file__).resolve()), spec, out_path, timeout, watch=monitor.watching
    )
    if result is None:
        return {"error": error}
    result["peak_pss_mb"] = monitor.peak_pss / 1e6
    result["peak_tree"] = monitor.peak_procs
    dup, cov, epochs = epoch_figures(result.pop("played"), len(spec["paths"]))
    result.update(duplicates=dup, coverage=cov, epochs=epochs)
    return result


def run_cluster_one(spec: dict[str, Any], timeout: float) -> dict[str, dict[str, Any]]:
    """One repeat of the cluster row: ``{config: result}``, both from one child and one cluster."""
    out_path = Path(spec["stats_dir"]) / "result.json"
    result, error = run_script_child(str(Path(__file__).resolve()), spec, out_path, timeout)
    if result is None:
        return {config: {"error": error} for config in spec["order"]}
    for run in result.values():
        dup, cov, epochs = epoch_figures(run.pop("played"), len(spec["paths"]))
        run.update(duplicates=dup, coverage=cov, epochs=epochs)
    return result


def cluster_markdown(cells: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The cluster row's table: each configuration, and the cluster ledger against one ledger
    per node paired within a repeat (one child, one cluster)."""
    lines = [
        "",
        f"## A Ray cluster: {CLUSTER_NODES} nodes x {CLUSTER_ENVS} env workers",
        "",
        "Both configurations in one child interpreter on one `ray.cluster_utils.Cluster` of "
        f"{CLUSTER_NODES} worker nodes on this machine, order alternating between repeats; "
        "`num_readers=0` (env workers load by index). `processes`: env workers and ledger "
        "processes (the cluster ledger's actor and its agents, or each node's ledger process). "
        "An epoch is the ledger's own: with one ledger per node, each node's epoch `e` together.",
        "",
        "| configuration | frames/s | x per node | processes | duplicates / epoch | coverage | epochs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = cells.get("per_node", [])
    for config, label in CLUSTER_CONFIGS.items():
        runs = cells.get(config, [])
        ok = [r for r in runs if "error" not in r]
        if not ok:
            errors = "; ".join(r.get("error", "") for r in runs)
            lines.append(f"| {label} | failed: {errors} | | | | | |")
            continue
        lines.append(
            f"| {label} | {_median(ok, 'fps'):,.0f} | {_paired_ratio(runs, base):.2f}x | "
            f"{max(r['processes'] for r in ok)} | {max(r['duplicates'] for r in ok):.1f} | "
            f"{min(r['coverage'] for r in ok):.0%} | {min(r['epochs'] for r in ok)} |"
        )
    return lines


def _paired_ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> float:
    """Median over repeats of frames/s against ``base``'s run of the same repeat."""
    ratios = [
        a["fps"] / b["fps"] for a, b in zip(runs, base, strict=False) if "error" not in a and "error" not in b
    ]
    return statistics.median(ratios) if ratios else float("nan")


def _median(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if "error" not in r]
    return statistics.median(values) if values else float("nan")


def build_markdown(cells: dict[tuple[int, str], list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        "# One ledger for N env workers",
        "",
        f"Generated {args.generated} by `benchmarks/ledger_scale.py{' --quick' if args.quick else ''}` "
        f"in {args.elapsed / 60:.1f} min on {psutil.cpu_count()} cores: {args.files} log files of "
        f"{args.file_mb} MB, episodes of about {args.episode_len} steps, {args.frames} frames per run, "
        f"{args.repeats} interleaved repeat(s), `--step-work {args.step_work}`.",
        "",
        "`frames/s` is the median over repeats, `x loaders` the median of ratios paired within a "
        "repeat; `processes`: env workers and data processes (the ledger's own and its readers, or "
        "the loaders' workers), the main process and shared helpers not counted; `tree peak`: the "
        "whole tree's; `PSS MB`: the tree's peak proportional memory.",
        "",
        "| env workers | configuration | frames/s | x loaders | processes | tree peak | PSS MB "
        "| duplicates / epoch | coverage | epochs |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for n in args.envs:
        loaders = cells.get((n, "loaders"), [])
        for config in args.configs:
            runs = cells.get((n, config), [])
            ok = [r for r in runs if "error" not in r]
            if not ok:
                errors = "; ".join(r.get("error", "") for r in runs)
                lines.append(f"| {n} | {CONFIGS[config][0]} | failed: {errors} | | | | | | | |")
                continue
            fps = _median(ok, "fps")
            lines.append(
                f"| {n} | {CONFIGS[config][0]} | {fps:,.0f} | {_paired_ratio(runs, loaders):.2f}x | "
                f"{max(r['processes'] for r in ok)} | {max(r['peak_tree'] for r in ok)} | "
                f"{_median(ok, 'peak_pss_mb'):,.0f} | {max(r['duplicates'] for r in ok):.1f} | "
                f"{min(r['coverage'] for r in ok):.0%} | {min(r['epochs'] for r in ok)} |"
            )
        ledger = [r for r in cells.get((n, "ledger"), []) if "error" not in r]
        loader_runs = [r for r in cells.get((n, "loaders"), []) if "error" not in r]
        if n == max(args.envs) and ledger and loader_runs:
            fps_ratio = _paired_ratio(cells[(n, "ledger")], loaders)
            procs = max(r["processes"] for r in ledger) / max(r["processes"] for r in loader_runs)
            dup = max(r["duplicates"] for r in ledger)
            cov = min(r["coverage"] for r in ledger)
            met = fps_ratio >= 1.0 and procs < 0.5 and dup == 0 and cov == 1.0
            verdicts.append(
                f"Target, {n} workers: the ledger at least as fast as per-worker loaders "
                f"({fps_ratio:.2f}x), fewer than half their processes ({procs:.2f}x), 0 duplicates "
                f"({dup:g}) and 100 % coverage ({cov:.0%}): **{'met' if met else 'NOT met'}**."
            )
    cluster = getattr(args, "cluster_cells", None) or {}
    return "\n".join([*lines, "", *verdicts, *(cluster_markdown(cluster) if cluster else []), ""])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default="2,4,8", help="numbers of env workers")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {list(CONFIGS)}")
    p.add_argument("--files", type=int, default=24, help="log files (episodes per epoch)")
    p.add_argument("--file-mb", type=float, default=2.0)
    p.add_argument("--episode-len", type=int, default=60, help="mean steps per episode")
    p.add_argument("--step-work", type=int, default=40)
    p.add_argument("--frames", type=int, default=None, help="frames per run (all workers together)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=2, help="the ledger's episodes ahead per reader")
    p.add_argument(
        "--reader-nice",
        type=lambda v: None if v == "none" else int(v),
        default=19,
        help="the ledger's reader_nice (its default: 19; 'none': the main process's priority)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cluster", action="store_true", help="add the Ray cluster row (needs the ray extra)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--render", type=Path, help="only rebuild the report from this results JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.envs = [int(v) for v in args.envs.split(",") if v]
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.frames = args.frames or (4_000 if args.quick else 8_000)
    if args.out is None:
        args.out = RESULTS / ("ledger_scale_quick.md" if args.quick else "ledger_scale.md")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_child(json.loads(args.child))))
        return 0
    if args.render:
        return render(args.render)
    sys.path.insert(0, str(EXAMPLES))
    import log_replay

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="torchrl_ext-bench-ledger-"))
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        paths = log_replay.generate_logs(
            tmp / "logs", args.files, episode_len=args.episode_len, file_mb=args.file_mb, seed=args.seed
        )
        for index, (repeat, _group, n, config) in enumerate(
            interleaved(args.repeats, ["local"], args.envs, args.configs)
        ):
            spec = {
                "config": config,
                "envs": n,
                "paths": [str(p) for p in paths],
                "step_work": args.step_work,
                "frames": args.frames,
                "seed": args.seed + repeat,
                "stats_dir": str(tmp / "runs" / f"{index:03d}"),
                "prefetch": args.prefetch,
                "reader_nice": args.reader_nice,
            }
            wait_for_quiet(0.3, max_wait=20.0)
            result = run_one(spec, timeout=120.0 + 0.05 * args.frames)
            cells.setdefault((n, config), []).append(result)
            print(f"r{repeat} {n} workers {config}: " + json.dumps(result), flush=True)
        cluster_cells: dict[str, list[dict[str, Any]]] = {}
        for repeat in range(args.repeats if args.cluster else 0):
            order = list(CLUSTER_CONFIGS)[:: 1 if repeat % 2 == 0 else -1]
            spec = {
                "order": order,
                "paths": [str(p) for p in paths],
                "step_work": args.step_work,
                "frames": args.frames,
                "seed": args.seed + repeat,
                "stats_dir": str(tmp / "runs" / f"cluster-{repeat:03d}"),
            }
            wait_for_quiet(0.3, max_wait=20.0)
            for config, result in run_cluster_one(spec, timeout=300.0 + 0.1 * args.frames).items():
                cluster_cells.setdefault(config, []).append(result)
                print(f"r{repeat} cluster {config}: " + json.dumps(result), flush=True)
        args.cluster_cells = cluster_cells
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.generated = time.strftime("%Y-%m-%d %H:%M")
    args.elapsed = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("out", "child", "child_out", "render")}
    raw = {"meta": meta, "cells": {f"{n}/{config}": runs for (n, config), runs in cells.items()}}
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    return render(args.out.with_suffix(".json"))


def render(path: Path) -> int:
    """Write the Markdown report beside the results JSON ``path``, and print it."""
    raw = json.loads(path.read_text())
    args = argparse.Namespace(**raw["meta"])
    cells = {(int(key.split("/")[0]), key.split("/")[1]): runs for key, runs in raw["cells"].items()}
    args.cluster_cells = raw["meta"].get("cluster_cells", {})
    out = path.with_suffix(".md")
    out.write_text(build_markdown(cells, args))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
