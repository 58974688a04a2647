"""Microseconds per batched ``step_and_maybe_reset``: ManagedParallelEnv against upstream
``ParallelEnv`` and the vector envs users compare TorchRL with.

Every trial runs in a fresh interpreter; the configurations of one cell (env, workers) run
side by side in time (interleaved, the order rotated per repeat), so each ratio is paired.
A trial builds the batched env, warms it up, then times each of ``--steps`` batched steps
(``perf_counter`` around the call) and reports the min and the median.

Configurations (``--configs``):

* ``managed``: ``ManagedParallelEnv`` with no start method (the preloaded default);
* ``managed_fork``: ``ManagedParallelEnv(mp_start_method="fork")``;
* ``managed_hosts``, ``managed_fork_hosts``: the same with several envs per worker process,
  one process per core (``envs_per_worker = ceil(workers / cores)``); run only where that is
  more than one env per process (4 and 8 workers on 2 cores);
* ``upstream``: ``torchrl.envs.ParallelEnv`` with no start method (TorchRL's default);
* ``upstream_fork``: ``ParallelEnv(mp_start_method="fork")``;
* ``gym_async``: gymnasium ``AsyncVectorEnv(shared_memory=True, context="fork")``;
* ``sb3``: stable-baselines3 ``SubprocVecEnv(start_method="fork")``;
* ``floor``: the least a batched step with one env per process costs on this machine (no
  library): ``workers`` forked processes, each stepping its own env of the same kind through
  TorchRL's ``step_and_maybe_reset`` when the trial's process writes it one byte, and answering
  with one byte. Nothing is shared and nothing comes back to the caller. Its parent sleeps in a
  blocking read, so with fewer busy processes than cores a spinning wait (ours, by default) can
  beat it; where the step is CPU-bound (4 and 8 workers on 2 cores) no batched env with TorchRL's
  outputs, ours or upstream's, can step faster with the same processes, and "floor vs upstream"
  is the most any such design could be faster than upstream.

gymnasium and stable-baselines3 are a benchmark-only extra (``pip install -e .[bench]``).
Envs (``--envs``, see ``step_envs.py``): ``trivial`` (4 floats) and ``replay`` (200 floats and
one 3x84x84 uint8 frame). Output: ``benchmarks/results/step.md``, ``.json`` and ``.png``
(``step_quick.*`` with ``--quick``).

    python benchmarks/step.py --quick        # 2 workers, trivial env, about 2 minutes
    python benchmarks/step.py                # every cell, about 20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _machine import child_trial, interleaved, run_script_child, system_busy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = (
    "managed",
    "managed_fork",
    "managed_hosts",
    "managed_fork_hosts",
    "upstream",
    "upstream_fork",
    "gym_async",
    "sb3",
    "floor",
)


def envs_per_worker(workers: int) -> int:
    """The ``*_hosts`` configurations' envs per worker process: one process per core."""
    cores = os.cpu_count() or 1
    return -(-workers // cores)


# ============================================================================ child trials


def _torchrl_env(config: str, kind: str, workers: int) -> Any:
    import functools

    import step_envs
    from torchrl.envs import ParallelEnv

    fn = functools.partial(step_envs.make_env, kind)
    kwargs: dict[str, Any] = {"mp_start_method": "fork"} if "_fork" in config else {}
    if config.endswith("_hosts"):
        kwargs["envs_per_worker"] = envs_per_worker(workers)
    if config.startswith("managed"):
        from torchrl_ext import ManagedParallelEnv

        return ManagedParallelEnv(workers, fn, **kwargs)
    return ParallelEnv(workers, fn, **kwargs)


def _time_torchrl(env: Any, warmup: int, steps: int) -> tuple[list[float], dict[str, Any]]:
    td = env.reset()
    action = env.action_spec.zero()
    times = []
    for i in range(warmup + steps):
        td.set("action", action)
        t = time.perf_counter()
        _, td = env.step_and_maybe_reset(td)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    extra: dict[str, Any] = {}
    if "_managed_state" in env.__dict__:  # never getattr: ParallelEnv forwards it to the workers
        extra["step_path"] = env.step_path[0]
        extra["server_zygote"] = env.stats().get("server_zygote")
    return times, extra


def _timed(step: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _time_vec(env: Any, workers: int, warmup: int, steps: int) -> list[float]:
    """Per-step seconds of a gymnasium or SB3 vector env (same call: ``step(actions)``)."""
    import numpy as np

    env.reset()
    actions = np.zeros((workers, 1), dtype=np.float32)
    return _timed(lambda: env.step(actions), warmup, steps)


def _floor_worker(kind: str, commands: int, answers: int) -> None:
    """A ``floor`` process: step its env on each byte ``s``, answer ``d``; any other byte ends it."""
    import step_envs
    import torch

    torch.set_num_threads(1)  # as TorchRL's workers (num_sub_threads=1)
    env = step_envs.make_env(kind)
    action = env.action_spec.zero()
    root = env.reset().set("action", action)
    os.write(answers, b"r")
    with torch.no_grad():
        while os.read(commands, 1) == b"s":
            _, root = env.step_and_maybe_reset(root)
            root.set("action", action)
            os.write(answers, b"d")


class Floor:
    """``workers`` forked :func:`_floor_worker` processes and their pipes (the ``floor`` config)."""

    def __init__(self, kind: str, workers: int) -> None:
        #: (command pipe's write end, answer pipe's read end, pid) of each process.
        self.procs: list[tuple[int, int, int]] = []
        try:
            for _ in range(workers):
                cmd_r, cmd_w = os.pipe()
                ans_r, ans_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        os.close(cmd_w)
                        os.close(ans_r)
                        _floor_worker(kind, cmd_r, ans_w)
                        code = 0
                    finally:
                        os._exit(code)
                os.close(cmd_r)
                os.close(ans_w)
                self.procs.append((cmd_w, ans_r, pid))
            self._answers(b"r")
        except BaseException:
            self.close()
            raise

    def _answers(self, expected: bytes) -> None:
        for _, ans_r, pid in self.procs:
            got = os.read(ans_r, 1)
            if got != expected:
                raise RuntimeError(f"floor process {pid} answered {got!r}, not {expected!r} (it died?)")

    def step(self) -> None:
        for cmd_w, _, _ in self.procs:
            os.write(cmd_w, b"s")
        self._answers(b"d")

    def close(self) -> None:
        for cmd_w, ans_r, pid in self.procs:
            try:
                os.write(cmd_w, b"q")
            except OSError:  # gone already: reaped below
                pass
            os.close(cmd_w)
            os.close(ans_r)
            os.waitpid(pid, 0)
        self.procs = []


def trial(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import functools

    import step_envs

    config, kind, workers = spec["config"], spec["env"], int(spec["workers"])
    warmup, steps = int(spec["warmup"]), int(spec["steps"])
    busy, t0 = system_busy(), time.perf_counter()
    extra: dict[str, Any] = {}
    if config == "floor":
        floor = Floor(kind, workers)
        try:
            times = _timed(floor.step, warmup, steps)
        finally:
            floor.close()
    elif config in ("gym_async", "sb3"):
        fns = [functools.partial(step_envs.make_gym, kind) for _ in range(workers)]
        if config == "gym_async":
            from gymnasium.vector import AsyncVectorEnv

            env = AsyncVectorEnv(fns, shared_memory=True, context="fork")
        else:
            from stable_baselines3.common.vec_env import SubprocVecEnv

            env = SubprocVecEnv(fns, start_method="fork")
        try:
            times = _time_vec(env, workers, warmup, steps)
        finally:
            env.close()
    else:
        env = _torchrl_env(config, kind, workers)
        try:
            times, extra = _time_torchrl(env, warmup, steps)
        finally:
            env.close()
    elapsed = time.perf_counter() - t0
    return {
        "min_us": min(times) * 1e6,
        "median_us": statistics.median(times) * 1e6,
        "busy_cores": (system_busy() - busy) / elapsed,
        **extra,
    }


# ============================================================================ the parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", nargs="+", default=["trivial", "replay"], choices=["trivial", "replay"])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=2000, help="timed steps per trial")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2, help="trials per cell and configuration")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds a trial may take")
    p.add_argument("--quick", action="store_true", help="2 workers, trivial env, 1000 steps")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.envs, args.workers, args.steps = ["trivial"], [2], 1000
    return args


def _cell_rows(results: list[dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    cells = sorted({(r["env"], r["workers"]) for r in results}, key=lambda c: (c[0] != "trivial", c[0], c[1]))
    for kind, workers in cells:
        row: dict[str, Any] = {"env": kind, "workers": workers}
        for config in configs:
            got = [r for r in results if (r["env"], r["workers"], r["config"]) == (kind, workers, config)]
            ok = [r for r in got if "error" not in r]
            if ok:
                row[config] = {
                    "min_us": min(r["min_us"] for r in ok),
                    "median_us": statistics.median(r["median_us"] for r in ok),
                    "busy_cores": statistics.median(r["busy_cores"] for r in ok),
                    "step_path": ok[0].get("step_path"),
                    "server_zygote": ok[0].get("server_zygote"),
                }
            elif got:
                row[config] = {"error": got[0]["error"]}
        rows.append(row)
    return rows


def _ratio(row: dict[str, Any], a: str, b: str) -> float | None:
    """How many times faster ``a`` steps than ``b`` (median per-step time of ``b`` over ``a``)."""
    if "median_us" in row.get(a, {}) and "median_us" in row.get(b, {}):
        return float(row[b]["median_us"] / row[a]["median_us"])
    return None


def write_markdown(
    rows: list[dict[str, Any]], configs: Sequence[str], meta: dict[str, Any], path: Path
) -> None:
    lines = [
        "# Batched step: microseconds per `step_and_maybe_reset`",
        "",
        f"{meta['machine']}; {meta['repeats']} interleaved trial(s) per cell, "
        f"{meta['steps']} timed steps each after {meta['warmup']} warm-up steps; "
        "each cell's configurations ran side by side in time. "
        f"Machine load while measuring (all cores, every process, ours included): median "
        f"{meta['busy_cores_median']:.2f} busy cores of {meta['cores']}.",
        "",
        "Each cell: min / median microseconds per batched step (lower is better). Ratios: how many "
        "times faster ours steps (upstream's median over ours) with the same start method, and ours "
        "against gymnasium `AsyncVectorEnv` (its median over ours; the gate asks >= 1/1.5 = 0.67); "
        "`*_hosts`: `envs_per_worker=ceil(workers / cores)` (one process per core; blank where that "
        "is 1), against upstream with the same start method. "
        "`floor` (one env per forked process, a byte each way, nothing returned: see `step.py`) "
        "against upstream with the same start method (fork): where the step is CPU-bound, the most "
        "any design with one env per process could reach; and ours against the floor (its median "
        "over ours: 1.0 is the floor; its parent sleeps, so with 1 or 2 workers ours may beat it).",
        "",
    ]
    ratios = [("managed", "upstream"), ("managed_fork", "upstream_fork"), ("managed", "gym_async")]
    header = ["env", "workers", *configs, "managed vs upstream", "fork vs upstream fork", "managed vs gym"]
    if "managed_hosts" in configs or "managed_fork_hosts" in configs:
        ratios += [("managed_hosts", "upstream"), ("managed_fork_hosts", "upstream_fork")]
        header += ["hosts vs upstream", "fork hosts vs upstream fork"]
    if "floor" in configs:
        ratios += [("floor", "upstream_fork"), ("managed_fork", "floor")]
        header += ["floor vs upstream fork", "fork vs floor"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["env"], str(row["workers"])]
        for config in configs:
            got = row.get(config)
            if got is None:
                cells.append("")
            elif "error" in got:
                cells.append("failed")
            else:
                cells.append(f"{got['min_us']:.0f} / {got['median_us']:.0f}")
        for a, b in ratios:
            r = _ratio(row, a, b)
            cells.append("" if r is None else f"{r:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    ours = ("managed", "managed_fork", "managed_hosts", "managed_fork_hosts")
    paths = {row[c]["step_path"] for row in rows for c in ours if row.get(c, {}).get("step_path")}
    if paths:
        lines += ["", f"Step path of the managed envs (`env.step_path`): {', '.join(sorted(paths))}."]
    zygote = {row["managed"].get("server_zygote") for row in rows if "managed" in row}
    if zygote - {None}:
        kinds = {1: "a fork of the trial's process (zygote)", 0: "a new interpreter"}
        said = ", ".join(kinds.get(z, str(z)) for z in sorted(zygote - {None}))
        lines += [f"The default path's fork server (`stats()['server_zygote']`): {said}."]
    errors = [
        f"{row['env']}/{row['workers']}/{c}: {row[c]['error']}"
        for row in rows
        for c in configs
        if "error" in row.get(c, {})
    ]
    if errors:
        lines += ["", "Failed trials:", *[f"- {e}" for e in errors]]
    path.write_text("\n".join(lines) + "\n")


def write_chart(rows: list[dict[str, Any]], configs: Sequence[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = sorted({row["env"] for row in rows}, key=lambda k: k != "trivial")
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [row for row in rows if row["env"] == kind]
        for config in configs:
            xs = [row["workers"] for row in mine if "median_us" in row.get(config, {})]
            ys = [row[config]["median_us"] for row in mine if "median_us" in row.get(config, {})]
            if xs:
                ax.plot(xs, ys, marker="o", label=config)
        ax.set_title(f"{kind} env: median us per batched step")
        ax.set_xlabel("workers")
        ax.set_ylabel("microseconds (log)")
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["config"] in ("managed", "managed_hosts"):
            # The default path as a program gets it: the server forked from this process. Started
            # before child_trial arms its watchdog, a thread, which would make it a new interpreter.
            import torchrl_ext

            torchrl_ext.start_fork_server()
        result = child_trial({"trial": trial}, "trial", spec, Path(args.child_out))
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    out = args.out or RESULTS / ("step_quick" if args.quick else "step")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (repeat, kind, workers, config) in enumerate(
            interleaved(args.repeats, args.envs, args.workers, args.configs)
        ):
            if config.endswith("_hosts") and envs_per_worker(workers) == 1:
                continue  # the same as the configuration without hosts
            spec = {
                "config": config,
                "env": kind,
                "workers": workers,
                "steps": args.steps,
                "warmup": args.warmup,
                "timeout": args.timeout,
            }
            out_path = Path(tmp) / f"trial{n}.json"
            got, why = run_script_child(__file__, spec, out_path, args.timeout)
            result = got if got is not None else {"error": why}
            results.append({**spec, "repeat": repeat, **result})
            shown = result.get("error") or f"{result['min_us']:.0f} / {result['median_us']:.0f} us"
            print(f"[{repeat}] {kind:8s} {workers} {config:14s} {shown}", flush=True)
    rows = _cell_rows(results, args.configs)
    busy = [r["busy_cores"] for r in results if "busy_cores" in r]
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "cores": os.cpu_count(),
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "busy_cores_median": statistics.median(busy) if busy else float("nan"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "trials": results}, indent=1))
    write_markdown(rows, args.configs, meta, out.with_suffix(".md"))
    write_chart(rows, args.configs, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
