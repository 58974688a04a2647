"""Demo: env workers that load a log file per reset through a persistent DataLoader.

The env (``LogReplayEnv`` from ``examples/log_replay.py``) replays one logged episode per
reset. Its episodes come from ``torchrl_ext.data.EpisodeLoader``: a DataLoader with
``num_workers=2`` inside every env worker, which reads and parses the next files while the
current episode runs. It runs on the default start path (what the import swap alone gives on
TorchRL >= 0.11: workers forked from the preloaded server; ``--start-method`` picks another).
The demo prints the throughput, the env's ``stats()`` and what closing took; then, side by side
with upstream ``ParallelEnv`` (its own default start method) on the same env, each in a fresh
interpreter of its own (``examples/compare.py``): the cold start, what a SIGKILL of a
worker leaves behind, and what each interpreter left at its exit (leaked semaphores, live
processes). It ends with a summary and checks that no process was left behind (exit code 1 if
one was).

    python examples/heavy_reset.py            # about 2 minutes on 2 cores
    python examples/heavy_reset.py --quick    # about 1.5 minutes
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import compare  # examples/ is on sys.path when this file runs as a script
import log_replay

from torchrl_ext import ManagedParallelEnv
from torchrl_ext._sweep import leftover_processes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=2, help="env worker processes")
    p.add_argument("--loader-workers", type=int, default=2, help="DataLoader workers per env")
    p.add_argument("--episode-len", type=int, default=400, help="mean steps per episode")
    p.add_argument("--file-mb", type=float, default=3.0, help="size of one log file, MB")
    p.add_argument("--files", type=int, default=8, help="number of log files to generate")
    p.add_argument("--frames", type=int, default=None, help="frames to collect (all envs together)")
    p.add_argument(
        "--start-method",
        default="default",
        choices=["default", "fork", "forkserver", "spawn"],
        help="for the env workers and the DataLoader workers (default: the library's default path)",
    )
    p.add_argument("--no-compare", action="store_true", help="skip the comparison with upstream")
    p.add_argument("--profile", default="local", choices=sorted(log_replay.PROFILES))
    p.add_argument("--quick", action="store_true", help="smaller files, fewer frames (CI)")
    args = p.parse_args(argv)
    if args.quick:
        args.file_mb = min(args.file_mb, 1.0)
        args.files = min(args.files, 4)
        args.episode_len = min(args.episode_len, 200)
    if args.frames is None:
        args.frames = 2_000 if args.quick else 12_000
    return args


#: The ``stats()`` key of a worker's memory, per slot (``worker_<i>/<key>``), and how it is named.
#: The tree's unique memory (USS: pages no other process maps), what ``recycle_memory`` counts;
#: its resident memory (``rss_bytes``) counts each page the DataLoader workers share with the
#: env worker once per process (NaN where /proc/PID/smaps_rollup cannot be read).
WORKER_MEMORY_KEY, WORKER_MEMORY_LABEL = "uss_bytes", "tree USS"


def print_stats(stats: dict[str, float | int]) -> None:
    """The env's ``stats()``, as a table (see docs/watching.md)."""
    print('env.stats(workers="both"):')
    keys = ("steps", "boundary_steps", "resets", "step_ms_p50", "step_ms_p95", "boundary_ms_p95")
    for key in (*keys, "wait_s", "restarts"):
        value = stats[key]
        print(f"  {key:<26} {value:.2f}" if isinstance(value, float) else f"  {key:<26} {value}")
    slot = 0
    while f"worker_{slot}/alive" in stats:
        memory = stats.get(f"worker_{slot}/{WORKER_MEMORY_KEY}", 0) / (1 << 20)
        kids = stats.get(f"worker_{slot}/descendants", 0)
        pid = stats.get(f"worker_{slot}/pid")
        print(f"  worker {slot}: pid {pid}, {WORKER_MEMORY_LABEL} {memory:.0f} MiB, {kids} children")
        slot += 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="torchrl_ext-heavy-reset-"))
    try:
        return run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> int:
    t = time.perf_counter()
    paths = log_replay.generate_logs(
        tmp / "logs", args.files, episode_len=args.episode_len, file_mb=args.file_mb, length_jitter=0.25
    )
    size = sum(p.stat().st_size for p in paths) / 1e6
    print(f"generated {len(paths)} log files ({size:.1f} MB) in {time.perf_counter() - t:.1f}s")
    stats = tmp / "stats"
    stats.mkdir()
    env_kwargs = {  # LogReplayEnv's arguments; also sent to the comparison's interpreters
        "paths": [str(p) for p in paths],
        "source": "episode_loader",
        "profile": args.profile,
        "num_workers": args.loader_workers,
        "mp_context": None if args.start_method == "default" else args.start_method,
    }
    make_env = functools.partial(log_replay.LogReplayEnv, **env_kwargs, stats_dir=str(stats))
    t = time.perf_counter()
    chosen = {} if args.start_method == "default" else {"mp_start_method": args.start_method}
    env = ManagedParallelEnv(args.envs, make_env, daemon_workers=False, **chosen)
    try:
        env.set_seed(0)
        td = env.reset()
        startup = time.perf_counter() - t
        print(
            f"started {args.envs} env workers, each with an EpisodeLoader of "
            f"{args.loader_workers} DataLoader workers (start path: {env.start_method}), in {startup:.1f}s"
        )
        frames = 0
        t = time.perf_counter()
        while frames < args.frames:
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
            frames += args.envs
        elapsed = time.perf_counter() - t
        print_stats(env.stats(workers="both"))
    finally:
        t_close = time.perf_counter()
        env.close()
        close_s = time.perf_counter() - t_close
    resets = [float(v) for f in stats.glob("resets-*.txt") for v in f.read_text().split()[1:]]
    print(f"env frames/s: {frames / elapsed:,.0f} ({frames} frames in {elapsed:.1f}s)")
    if resets:
        p95 = sorted(resets)[int(0.95 * (len(resets) - 1))]
        print(
            f"reset latency inside the env: p50 {statistics.median(resets) * 1e3:.1f} ms, "
            f"p95 {p95 * 1e3:.1f} ms over {len(resets)} resets"
        )
    print(f"close() took {close_s:.2f}s")
    print(env.supervision_report)
    sides = None if args.no_compare else compare.compare_with_upstream(env_kwargs, chosen)
    report = env.supervision_report
    closed = "graceful" if report is not None and report.clean else "NOT graceful"
    print(
        f"\nsummary: ManagedParallelEnv, {args.envs} env workers x {args.loader_workers} DataLoader "
        f"workers, start path {env.start_method}: {frames / elapsed:,.0f} env frames/s, "
        f"closed in {close_s:.2f}s ({closed})"
    )
    if sides is not None:
        up, ours = sides["upstream"], sides["managed"]
        print(
            f"  vs upstream, each in a fresh interpreter: cold start {ours['cold_s']:.1f}s "
            f"(upstream {up['cold_s']:.1f}s); a SIGKILLed worker's DataLoader workers alive "
            f"{compare.LINGER:g} s later: {ours['left']} (upstream {up['left']})"
        )
        print(
            f"  at the interpreter's exit: leaked semaphores {ours['leaked'].get('semaphore', 0)} "
            f"(upstream {up['leaked'].get('semaphore', 0)}), processes alive {compare.AFTER_EXIT:g} s "
            f"later {ours['after_exit']} (upstream {up['after_exit']})"
        )
    leftovers = leftover_processes()
    deadline = time.monotonic() + 2.0
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.05)
        leftovers = leftover_processes()
    if leftovers:
        print(f"LEAKED {len(leftovers)} process(es): {[p.pid for p in leftovers]}")
        return 1
    print("nothing leaked: no env worker or DataLoader worker process is left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
