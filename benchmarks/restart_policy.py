"""Restart policy benchmark: recycling bounds memory, a recycled reset costs a normal one, and
lost workers are replaced in parallel.

Three measurements, every trial in a fresh interpreter, the trials of a round interleaved (the
order rotates per round). The env is ``PolicyEnv`` below, built by ``make_policy_env``, which
the workers import by reference (``restart_policy.make_policy_env``, as ``overhead.py`` does).

1. **Recycling bounds memory.** Every reset of the env keeps ``--growth-mib`` more (a bytearray
   with every page touched, held in a list on the env); its episodes are a few steps long.
   A worker tree's memory is measured as ``recycle_memory`` counts it: its USS, the sum over the
   worker and its descendants (psutil ``children(recursive=True)``) of
   ``torchrl_ext._platform.process_memory(pid).uss`` (``/proc/PID/smaps_rollup``: the resident
   pages no other process maps). Where ``smaps_rollup`` cannot be read (``process_memory``
   returns ``None``: macOS, ``TORCHRL_EXT_PORTABLE=1``) the library counts RSS, and so does this
   measurement, which the report then says. A probe env (2 workers, default start: forks of the
   preloaded server) is reset once and its larger worker tree is the baseline; the measured env
   is ``ManagedParallelEnv(2, factory, recycle_memory=baseline + --headroom-mib,
   max_restarts=1)`` (``max_restarts`` so that ``("next", "worker_restarted")`` exists), run with
   ``step_and_maybe_reset`` (as a collector does) for ``--episodes`` episodes per slot, ten times
   and more the episodes that fit under the cap. At every call in which a slot's episode ended,
   that slot's worker tree is read; the maximum is reported, with the largest
   ``worker_<i>/uss_bytes`` of ``stats(workers=True)`` read every 50 calls (``rss_bytes`` in
   the fallback).
2. **A recycled reset costs about a normal one.** Resets take a stable time (``--reset-sleep``
   seconds, a cost model, plus building a ``--reset-tensor-mib`` tensor, 4 MiB by default);
   2 workers, default start,
   ``recycle_every=3``, episode lengths 5 and 7 steps (``create_env_kwargs``) so that the slots
   mostly end their episodes in different calls. Every ``step_and_maybe_reset`` call in which
   exactly one slot's episode ended is timed, split into calls with a recycle (``env.restarts``
   grew) and without.
3. **Parallel replacement.** ``ManagedParallelEnv(4, factory, mp_start_method="spawn",
   max_restarts=40, restart_backoff=None)``; after a warm-up, SIGKILL one worker, poll
   ``env.stats()["deaths"]`` until it counts it (10 s deadline), then time the next
   ``step_and_maybe_reset`` call, which replaces it; the same with all 4 workers SIGKILLed at
   once, and, on a machine with 2 or 3 cores, with as many as it has cores (the target's case,
   one core per start-up, on a smaller machine). Spawn replacements import torch afresh,
   CPU-bound: with fewer cores than workers four start-ups compete for the cores, which the
   report says next to ``os.cpu_count()``.

Every env is closed in a ``finally``; after each trial the parent waits up to 5 s for the
processes tagged with this run to be gone and kills (and reports) whatever is left. Results:
``benchmarks/results/restart_policy.md`` and ``.json`` (``restart_policy_quick.*`` with
``--quick``).

    python benchmarks/restart_policy.py            # 3 rounds: about 6 minutes on 2 cores
    python benchmarks/restart_policy.py --quick    # 1 round: about 2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from _machine import child_trial, is_helper, run_script_child, wait_for_quiet
from trivial_env import TrivialEnv

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 1 << 20
RUN_VAR = "TORCHRL_EXT_BENCH_RUN"
RUN_TAG = f"restart_policy-{os.getpid()}-{time.time_ns()}"
CELLS = ("memory", "reset_cost", "parallel")
#: Targets.
FIT_FACTOR = 10
RESET_RATIO = 1.1
PARALLEL_RATIO = 1.5
#: Allowance over cap + one episode's growth for the max tree memory (page and allocator rounding).
MEMORY_SLACK = 2 * MIB
#: Episode lengths of the two slots of measurement 2.
RESET_COST_LENGTHS = (5, 7)
RECYCLE_EVERY = 3
PARALLEL_WORKERS = 4
PARALLEL_MAX_RESTARTS = 40  # 3 repeats of 1, 2 (or 3) and 4 losses: 24 at most


# ================================================================= the env (importable by reference)
class PolicyEnv(TrivialEnv):
    """``overhead.py``'s trivial env whose reset may keep memory (``grow_mib`` per reset, every
    page touched, kept in ``self.kept``) and take time (``reset_sleep`` seconds plus a
    ``reset_tensor_mib`` tensor built afresh); episodes end after ``episode_len`` steps."""

    def __init__(
        self,
        episode_len: int = 4,
        grow_mib: float = 0.0,
        reset_sleep: float = 0.0,
        reset_tensor_mib: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(loader=False, episode_len=episode_len, **kwargs)
        self.grow = int(grow_mib * MIB)
        self.reset_sleep = reset_sleep
        self.reset_floats = int(reset_tensor_mib * MIB) // 4
        self.kept: list[bytearray] = []

    def _next_item(self) -> torch.Tensor:
        """The reset's work, then its observation."""
        if self.grow:
            self.kept.append(bytearray(b"\x01") * self.grow)  # filled: every page resident
        if self.reset_sleep:
            time.sleep(self.reset_sleep)
        return torch.rand(self.reset_floats)[:4].clone() if self.reset_floats else torch.zeros(4)


def make_policy_env(**kwargs: Any) -> PolicyEnv:
    return PolicyEnv(**kwargs)


def make_policy_env_ref() -> Any:
    """``make_policy_env`` imported by module name, so that workers can find it by reference."""
    sys.path.insert(0, str(HERE))
    import restart_policy

    return restart_policy.make_policy_env


# ============================================================================ child trials


def memory_measure() -> str:
    """``"USS"`` where ``process_memory`` can read ``smaps_rollup`` (what ``recycle_memory``
    counts then), else ``"RSS"`` (the library's fallback too)."""
    from torchrl_ext import _platform

    return "USS" if _platform.process_memory(os.getpid()) is not None else "RSS"


def tree_memory(pid: int, measure: str) -> int | None:
    """``pid``'s tree (it and all its descendants), summed: their USS
    (``process_memory(pid).uss``) or, with ``measure`` ``"RSS"``, their RSS (``None``: gone)."""
    from torchrl_ext import _platform

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        if measure == "USS":
            memory = _platform.process_memory(proc.pid)
            total += memory.uss if memory is not None else 0  # None: gone meanwhile
        else:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
    return total


def _ended(out: Any, n: int) -> list[int]:
    done = out.get(("next", "done")).reshape(n)
    return [int(i) for i in done.nonzero().flatten().tolist()]


def _marked(out: Any, n: int) -> int | None:
    key = ("next", "worker_restarted")
    if key not in out.keys(include_nested=True):
        return None
    return int(out.get(key).reshape(n).sum())


def _live(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def _close(env: Any, pids: Sequence[int], out: dict[str, Any]) -> None:
    """Close ``env``; which of ``pids`` (every worker it had) are alive 3 s later."""
    t = time.perf_counter()
    env.close(raise_if_closed=False)
    out["close_s"] = time.perf_counter() - t
    deadline = time.monotonic() + 3.0
    while (alive := _live(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["workers_alive_after_close"] = alive


def trial_memory(spec: dict[str, Any]) -> dict[str, Any]:
    from torchrl_ext import ManagedParallelEnv

    n, growth = 2, int(spec["growth_mib"] * MIB)
    factory = functools.partial(
        make_policy_env_ref(), episode_len=int(spec["episode_len"]), grow_mib=spec["growth_mib"]
    )
    measure = memory_measure()
    stats_key = "uss_bytes" if measure == "USS" else "rss_bytes"
    out: dict[str, Any] = {"measure": measure}
    probe = ManagedParallelEnv(n, factory)
    try:
        probe.reset()
        out["probe_start_method"] = probe.start_method
        baselines = [tree_memory(pid, measure) or 0 for pid in probe.worker_pids]
    finally:
        probe.close(raise_if_closed=False)
    baseline = max(baselines)
    cap = baseline + int(spec["headroom_mib"] * MIB)
    fit = (cap - baseline) // growth
    out.update(probe_baselines=baselines, baseline=baseline, cap=cap, fit=fit, growth=growth)
    env = ManagedParallelEnv(n, factory, recycle_memory=cap, max_restarts=1)
    pids: set[int] = set()
    try:
        t0 = time.perf_counter()
        td = env.reset()
        out["start_method"] = env.start_method
        pids.update(env.worker_pids)
        out["baselines"] = [tree_memory(pid, measure) or 0 for pid in env.worker_pids]
        episodes = [0] * n
        max_tree = [0] * n
        stats_max = [0.0] * n
        marked = 0
        key_seen = False
        steps = 0
        while min(episodes) < int(spec["episodes"]):
            td.set("action", env.action_spec.rand())
            nxt, td = env.step_and_maybe_reset(td)
            steps += 1
            flagged = _marked(nxt, n)
            if flagged is not None:
                key_seen = True
                marked += flagged
            current = env.worker_pids
            pids.update(current)
            for slot in _ended(nxt, n):
                episodes[slot] += 1
                held = tree_memory(current[slot], measure)
                if held is not None:
                    max_tree[slot] = max(max_tree[slot], held)
            if steps % 50 == 0:
                stats = env.stats(workers="both")
                for slot in range(n):
                    value = float(stats.get(f"worker_{slot}/{stats_key}", math.nan))
                    if not math.isnan(value):
                        stats_max[slot] = max(stats_max[slot], value)
        out["run_s"] = time.perf_counter() - t0
        records = env.restarts
        out.update(
            episodes=episodes,
            steps=steps,
            max_tree=max_tree,
            stats_max=stats_max,
            marked=marked,
            marked_key_present=key_seen,
            recycles_memory=sum(1 for r in records if r.cause == "memory"),
            recycles_other=sum(1 for r in records if r.recycled and r.cause != "memory"),
            not_recycled=[str(r) for r in records if not r.recycled],
            recycle_ready_after=[r.ready_after for r in records if r.recycled],
            recycles_per_slot=[sum(1 for r in records if r.recycled and r.slot == s) for s in range(n)],
        )
        pids.update(r.new_pid for r in records)
    finally:
        _close(env, sorted(pids), out)
    return out


def trial_reset_cost(spec: dict[str, Any]) -> dict[str, Any]:
    from torchrl_ext import ManagedParallelEnv

    n = 2
    factory = functools.partial(
        make_policy_env_ref(),
        reset_sleep=float(spec["reset_sleep"]),
        reset_tensor_mib=float(spec.get("reset_tensor_mib", 4.0)),
    )
    lengths = [int(v) for v in spec.get("lengths", RESET_COST_LENGTHS)]
    kwargs = [{"episode_len": length} for length in lengths]
    env = ManagedParallelEnv(n, factory, create_env_kwargs=kwargs, recycle_every=RECYCLE_EVERY)
    out: dict[str, Any] = {
        **{key: [] for key in ("recycled_s", "normal_s", "both_s", "plain_s", "odd")},
        "standby_built": [],
        "standby_prepared": [],
    }
    pids: set[int] = set()
    # Diagnostics only (private): whether a due slot's standby had built its env, and reset it
    # ahead (NOTE [prepared reset]: its answer read, or waiting in its pipe), before the call.
    slots = env._state.keeper.slots
    try:
        td = env.reset()
        out["start_method"] = env.start_method
        pids.update(env.worker_pids)
        for _ in range(3 * max(lengths) * RECYCLE_EVERY):  # warm-up, a recycle per slot
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
        warm = len(env.restarts)
        target = int(spec["boundaries"])
        calls = 0
        while min(len(out["recycled_s"]), len(out["normal_s"])) < target and calls < 100 * target:
            td.set("action", env.action_spec.rand())
            before = len(env.restarts)
            standbys = {slot.index: (slot, slot.standby) for slot in slots if slot.standby is not None}
            built = {s for s, (_slot, launch) in standbys.items() if launch.ready or launch.channel.poll(0)}
            prepared = {
                s
                for s, (slot, launch) in standbys.items()
                if slot.prepared == "answered" or (slot.prepared == "sent" and launch.channel.poll(0))
            }
            t = time.perf_counter()
            nxt, td = env.step_and_maybe_reset(td)
            dt = time.perf_counter() - t
            calls += 1
            grew = len(env.restarts) - before
            ended = _ended(nxt, n)
            pids.update(env.worker_pids)
            if len(ended) == 1:
                out["recycled_s" if grew else "normal_s"].append(dt)
                if grew:
                    out["standby_built"].append(ended[0] in built)
                    out["standby_prepared"].append(ended[0] in prepared)
            elif len(ended) > 1:
                out["both_s"].append(dt)
            else:
                out["plain_s"].append(dt)
            if grew and not ended:
                out["odd"].append(f"call {calls}: {grew} recycle(s) without an episode end")
        records = env.restarts
        pids.update(r.new_pid for r in records)
        out.update(
            calls=calls,
            warm_up_recycles=warm,
            causes=sorted({str(r.cause) for r in records}),
            not_recycled=[str(r) for r in records if not r.recycled],
            ready_after=[r.ready_after for r in records[warm:] if r.recycled],
        )
    finally:
        _close(env, sorted(pids), out)
    return out


def _cpu_s(pid: int) -> float | None:
    """CPU seconds ``pid`` used so far (a replacement: its start-up, env build and first reset)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def _wait_deaths(env: Any, count: int, deadline_s: float) -> float | None:
    t = time.perf_counter()
    while time.perf_counter() - t < deadline_s:
        if int(env.stats()["deaths"]) >= count:
            return time.perf_counter() - t
        time.sleep(0.005)
    return None


def _parallel_cores() -> int:
    """How many workers at once this machine has a core for each (the "cores" kind), or 0 when
    that is one or all of them (nothing the other two kinds do not show)."""
    k = min(os.cpu_count() or 1, PARALLEL_WORKERS)
    return k if 1 < k < PARALLEL_WORKERS else 0


def _parallel_kinds() -> tuple[str, ...]:
    """The kinds of loss measured: one worker, as many as the cores (when that is a third
    case), all of them."""
    return ("one", "cores", "all") if _parallel_cores() else ("one", "all")


def _parallel_slots(kind: str, rep: int, n: int) -> list[int]:
    if kind == "one":
        return [rep % n]
    if kind == "cores":
        k = _parallel_cores()
        return sorted((rep + i) % n for i in range(k))
    return list(range(n))


def trial_parallel(spec: dict[str, Any]) -> dict[str, Any]:
    from torchrl_ext import ManagedParallelEnv

    n = PARALLEL_WORKERS
    t0 = time.perf_counter()
    env = ManagedParallelEnv(
        n,
        make_policy_env_ref(),
        mp_start_method="spawn",
        max_restarts=PARALLEL_MAX_RESTARTS,
        restart_backoff=None,
    )
    out: dict[str, Any] = {"events": [], "checks_failed": []}
    pids: set[int] = set()
    try:
        td = env.reset()
        out.update(first_reset_s=time.perf_counter() - t0, start_method=env.start_method)
        pids.update(env.worker_pids)
        for _ in range(20):
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
        repeats = int(spec["repeats"])
        kinds = _parallel_kinds()
        for rep in range(repeats):
            shift = (rep + int(spec["round"])) % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                out.setdefault("quiet_load", []).append(wait_for_quiet(0.3, max_wait=5.0))
                current = env.worker_pids
                slots = _parallel_slots(kind, rep, n)
                deaths = int(env.stats()["deaths"])
                before = len(env.restarts)
                killed = time.perf_counter()
                for slot in slots:
                    os.kill(current[slot], signal.SIGKILL)
                counted = _wait_deaths(env, deaths + len(slots), 10.0)
                waited = time.perf_counter() - killed
                td.set("action", env.action_spec.rand())
                t = time.perf_counter()
                nxt, td = env.step_and_maybe_reset(td)
                call_s = time.perf_counter() - t
                records = env.restarts[before:]
                pids.update(env.worker_pids)
                cpu = [_cpu_s(r.new_pid) for r in records]
                flags = nxt.get(("next", "worker_restarted")).reshape(n).tolist()
                problems = [
                    what
                    for what, bad in (
                        ("deaths not counted within 10 s", counted is None),
                        (f"{len(records)} records", len(records) != len(slots)),
                        (
                            f"slots {sorted(r.slot for r in records)}",
                            sorted(r.slot for r in records) != slots,
                        ),
                        (f"causes {[r.cause for r in records]}", any(r.cause != -9 for r in records)),
                        (f"backoffs {[r.backoff for r in records]}", any(r.backoff for r in records)),
                        (f"marked {flags}", [i for i, f in enumerate(flags) if f] != slots),
                    )
                    if bad
                ]
                if problems:
                    out["checks_failed"].append(f"repeat {rep} {kind}: " + "; ".join(problems))
                out["events"].append(
                    {
                        "kind": kind,
                        "repeat": rep,
                        "call_s": call_s,
                        "noticed_s": counted,
                        "kill_to_call_s": waited,
                        "ready_after": [r.ready_after for r in records],
                        "replacement_cpu_s": cpu,
                    }
                )
                for _ in range(10):  # the env works on
                    td.set("action", env.action_spec.rand())
                    _, td = env.step_and_maybe_reset(td)
        pids.update(r.new_pid for r in env.restarts)
        out["restarts"] = len(env.restarts)
    finally:
        _close(env, sorted(pids), out)
    return out


TRIALS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "memory": trial_memory,
    "reset_cost": trial_reset_cost,
    "parallel": trial_parallel,
}


def run_child(spec: dict[str, Any], out_path: Path) -> dict[str, Any]:
    return child_trial(TRIALS, spec["cell"], spec, out_path)


# ============================================================================ parent side


def _strays() -> list[psutil.Process]:
    """Live processes that carry this run's tag (started, directly or not, by this script)."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(RUN_VAR) == RUN_TAG and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def _end_strays(cap: float = 5.0) -> list[str]:
    """Wait up to ``cap`` s until nothing tagged with this run is alive; kill what is left and
    return it (helpers marked)."""
    deadline = time.monotonic() + cap
    while (strays := _strays()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = []
    for proc in strays:
        with contextlib.suppress(psutil.Error):
            left.append(
                f"{proc.pid}{' (helper)' if is_helper(proc) else ''} {' '.join(proc.cmdline())[:120]}"
            )
            proc.kill()
    psutil.wait_procs(strays, timeout=5)
    return left


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="torchrl_ext-bench-restart-policy-") as tmp:
        t = time.perf_counter()
        result, error = run_script_child(
            str(Path(__file__).resolve()),
            spec,
            Path(tmp) / "result.json",
            float(spec["timeout"]),
            env={RUN_VAR: RUN_TAG},
        )
        wall = time.perf_counter() - t
        stacks_path = Path(tmp) / "stacks.txt"
        stacks = stacks_path.read_text() if stacks_path.exists() else ""
    if result is None:
        result = {"error": error, "stacks": stacks[-6000:] or None}
    result.update(trial_wall_s=wall, strays_after_exit=_end_strays())
    return result


def _med(values: Sequence[float | None]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def _f(value: float, digits: int = 3, unit: str = "") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}{unit}"


def _mib(value: float) -> str:
    return _f(value / MIB, 1, " MiB")


def _ms(value: float) -> str:
    return _f(value * 1e3, 1, " ms")


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def _cells(trials: Sequence[dict[str, Any]], cell: str) -> list[dict[str, Any]]:
    return [t["result"] for t in trials if t["spec"]["cell"] == cell and not t["result"].get("error")]


def _memory_section(
    trials: Sequence[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    runs = _cells(trials, "memory")
    measures = sorted({r["measure"] for r in runs}) or ["USS"]
    measure = "/".join(measures)  # one of them: every trial ran on this machine
    if "RSS" in measures:
        how = (
            "**RSS, not USS: `/proc/PID/smaps_rollup` cannot be read here (`process_memory` "
            "returned `None`), so `recycle_memory` counts the trees' RSS, and so does this "
            "table** (psutil, the worker and its descendants)"
        )
    else:
        how = (
            "USS, as `recycle_memory` counts it: over the worker and its descendants, the sum of "
            "`torchrl_ext._platform.process_memory(pid).uss` (`smaps_rollup`: the resident pages "
            "no other process maps)"
        )
    key = "uss_bytes" if measure == "USS" else "rss_bytes"
    lines = [
        "## 1. Recycling bounds memory",
        "",
        f"2 workers, default start, `PolicyEnv(episode_len={args.episode_len}, "
        f"grow_mib={args.growth_mib:g})`: "
        f"every reset keeps {args.growth_mib:g} MiB more. A worker tree's memory is its {how}. "
        f"`recycle_memory` = the larger worker tree of a probe env after its first reset + "
        f"{args.headroom_mib:g} MiB, `max_restarts=1`; `step_and_maybe_reset` until every slot ran "
        f"{args.episodes} episodes; the slot's worker tree read at every call in which its episode "
        f"ended; `stats(workers=True)['worker_<i>/{key}']` read every 50 calls (the library "
        "samples it at most every 10 s: report only).",
        "",
        f"| trial | start | baseline {measure} | cap | episodes fit | episodes per slot | "
        f"max tree {measure} per slot | over cap | stats() max {key} per slot | "
        "recycles (memory) per slot | marked | other restarts | recycle reset median |",
        "|" + "---|" * 13,
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i + 1} | {r['start_method']} | {_mib(r['baseline'])} | {_mib(r['cap'])} | {r['fit']} | "
            f"{r['episodes']} | {', '.join(_mib(v) for v in r['max_tree'])} | "
            f"{_mib(max(r['max_tree']) - r['cap'])} | {', '.join(_mib(v) for v in r['stats_max'])} | "
            f"{r['recycles_per_slot']} | {r['marked']} | {len(r['not_recycled'])} | "
            f"{_ms(_med(r['recycle_ready_after']))} |"
        )
    lines.append("")
    if runs:
        lines.append(
            f"Baselines: probe {[_mib(v) for r in runs for v in r['probe_baselines']]}, measured env "
            f"{[_mib(v) for r in runs for v in r['baselines']]}. `worker_restarted` key present: "
            f"{sorted({r['marked_key_present'] for r in runs})}. Recycles with another cause: "
            f"{sum(r['recycles_other'] for r in runs)}. Restarts that are not recycles: "
            f"{[s for r in runs for s in r['not_recycled']] or 'none'}."
        )
        lines.append("")
    ok = bool(runs)
    min_ratio = min((min(r["episodes"]) / max(r["fit"], 1) for r in runs), default=math.nan)
    over = max((max(r["max_tree"]) - r["cap"] for r in runs), default=math.nan)
    growth = args.growth_mib * MIB
    marked = sum(r["marked"] for r in runs)
    others = sum(len(r["not_recycled"]) for r in runs)
    present = all(r["marked_key_present"] for r in runs)
    recycles = sum(r["recycles_memory"] for r in runs)
    targets = [
        f"* episodes per slot >= {FIT_FACTOR}x the episodes that fit under the cap: "
        f"{_f(min_ratio, 1, 'x')} (min over trials and slots) -> {_verdict(ok and min_ratio >= FIT_FACTOR)}",
        f"* 0 marked transitions (`worker_restarted` present and never True) and 0 restarts that are "
        f"not recycles: {marked} marked, key present {present}, {others} other restarts -> "
        f"{_verdict(ok and marked == 0 and present and others == 0)}",
        f"* max worker tree {measure} <= cap + one episode's growth ({args.growth_mib:g} MiB, + "
        f"{MEMORY_SLACK // MIB} MiB rounding): {_mib(over)} over the cap at most -> "
        f"{_verdict(ok and over <= growth + MEMORY_SLACK)}",
        f'* recycles (cause "memory"): {recycles} in {len(runs)} trial(s) (report only)',
    ]
    return lines, targets


def _reset_section(trials: Sequence[dict[str, Any]], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    runs = _cells(trials, "reset_cost")
    lines = [
        "## 2. A recycled reset costs about a normal one",
        "",
        f"2 workers, default start, `recycle_every={RECYCLE_EVERY}`, resets of `time.sleep("
        f"{args.reset_sleep:g})`"
        + (f" + a fresh {args.reset_tensor_mib:g} MiB `torch.rand`" if args.reset_tensor_mib else "")
        + f", episode lengths {args.lengths} "
        "steps. Timed: each `step_and_maybe_reset` call in which exactly one slot's episode ended, "
        "with a recycle in it (the old worker steps, the standby started ahead takes the slot and "
        "publishes the reset it did ahead) or without (the worker steps and resets itself). The "
        "standby is started between calls, after the boundary at which its slot became due, and "
        "resets its env once it is seeded: that cost lands on calls without an episode end (the "
        "plain-step columns). A standby not built, or not reset, before its call does that in "
        "the call (last column).",
        "",
        "| trial | recycled calls | normal calls | recycled median | normal median | ratio | extra | "
        "recycled p90 | normal p90 | both ended median | plain step median / max | "
        "record ready_after median | standby built / reset ahead before the call |",
        "|" + "---|" * 13,
    ]
    ratios = []
    for i, r in enumerate(runs):
        rec, nor = _med(r["recycled_s"]), _med(r["normal_s"])
        ratio = rec / nor if nor else math.nan
        ratios.append(ratio)
        lines.append(
            f"| {i + 1} | {len(r['recycled_s'])} | {len(r['normal_s'])} | {_ms(rec)} | {_ms(nor)} | "
            f"{_f(ratio, 3, 'x')} | {_ms(rec - nor)} | {_ms(_quantile(r['recycled_s'], 0.9))} | "
            f"{_ms(_quantile(r['normal_s'], 0.9))} | {_ms(_med(r['both_s']))} | "
            f"{_ms(_med(r['plain_s']))} / {_ms(max(r['plain_s'], default=math.nan))} | "
            f"{_ms(_med(r['ready_after']))} | {sum(r['standby_built'])} / "
            f"{sum(r.get('standby_prepared', []))} of {len(r['standby_built'])} |"
        )
    lines.append("")
    pooled_rec = _med([v for r in runs for v in r["recycled_s"]])
    pooled_nor = _med([v for r in runs for v in r["normal_s"]])
    if runs:
        lines.append(
            f"Pooled medians: recycled {_ms(pooled_rec)}, normal {_ms(pooled_nor)} (extra "
            f"{_ms(pooled_rec - pooled_nor)} per recycled boundary: the target is a ratio, so it "
            f"depends on the reset's cost, {args.reset_sleep * 1e3:g} ms here). Causes seen: "
            f"{sorted({c for r in runs for c in r['causes']})}; restarts that are not recycles: "
            f"{[s for r in runs for s in r['not_recycled']] or 'none'}; anomalies: "
            f"{[s for r in runs for s in r['odd']] or 'none'}."
        )
        lines.append("")
    ratio = _med(ratios)
    met = None if math.isnan(ratio) else ratio <= RESET_RATIO
    targets = [
        f"* median recycled / median normal boundary call <= {RESET_RATIO:g}x: {_f(ratio, 3, 'x')} "
        f"(median of {len(ratios)} trial ratio(s)) -> {_verdict(met)}",
    ]
    return lines, targets


def _quantile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _parallel_section(
    trials: Sequence[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    runs = _cells(trials, "parallel")
    events = [e for r in runs for e in r["events"]]
    lines = [
        "## 3. Parallel replacement",
        "",
        f'`ManagedParallelEnv({PARALLEL_WORKERS}, factory, mp_start_method="spawn", '
        f"max_restarts={PARALLEL_MAX_RESTARTS}, restart_backoff=None)`, {args.repeats} repeat(s) of each "
        "kind per trial, the order rotating: SIGKILL one worker (or, where the machine has 2 or 3 "
        "cores, that many at once; or all four at once), poll "
        '`env.stats()["deaths"]` until it counts them, then time the next `step_and_maybe_reset` '
        "call (which starts every replacement, then awaits all their handshakes, then steps and "
        "resets the marked slots).",
        "",
        f"**This machine has {os.cpu_count()} CPU core(s).** A spawn start-up imports torch and is "
        "CPU-bound: with fewer cores than replacements, four start-ups compete for the cores, so "
        f"four at once cannot take the time of one here (with {os.cpu_count()} cores the floor is "
        f"about {max(1.0, PARALLEL_WORKERS / max(1, os.cpu_count() or 1)):g}x one, before the contention "
        "itself); the target is for a machine with at least 4 free cores.",
        "",
        "| killed | events | call median | call min / max | kill to deaths counted median | "
        "record ready_after median (max per event) |",
        "|" + "---|" * 6,
    ]
    med: dict[str, float] = {}
    labels = {
        "one": "1 worker",
        "cores": f"{_parallel_cores()} at once (one per core)",
        "all": f"all {PARALLEL_WORKERS} at once",
    }
    for kind in _parallel_kinds():
        label = labels[kind]
        ev = [e for e in events if e["kind"] == kind]
        calls = [e["call_s"] for e in ev]
        med[kind] = _med(calls)
        lines.append(
            f"| {label} | {len(ev)} | {_f(med[kind], 2, ' s')} | {_f(min(calls, default=math.nan), 2)} / "
            f"{_f(max(calls, default=math.nan), 2)} s | {_ms(_med([e['noticed_s'] for e in ev]))} | "
            f"{_f(_med([max(e['ready_after'], default=math.nan) for e in ev]), 2, ' s')} |"
        )
    lines.append("")
    if runs:
        lines.append(
            f"First reset of each env (4 spawn starts at once, torch imported afresh): "
            f"{[round(r['first_reset_s'], 2) for r in runs]} s. Raw call s, in order: "
            f"{[(e['kind'], round(e['call_s'], 2)) for e in events]}. Failed checks: "
            f"{[c for r in runs for c in r['checks_failed']] or 'none'}."
        )
        lines.append("")
    cpu_one = _med([c for e in events for c in e.get("replacement_cpu_s", [])])
    cores = os.cpu_count() or 1
    floor = PARALLEL_WORKERS * cpu_one / min(cores, PARALLEL_WORKERS) / med["one"] if med["one"] else math.nan
    lines.append(
        f"CPU seconds one spawn replacement used by the end of the call (start-up, imports, env "
        f"build, first reset): median {_f(cpu_one, 2, ' s')}. {PARALLEL_WORKERS} of them need "
        f"{_f(PARALLEL_WORKERS * cpu_one, 1, ' CPU-s')}; on {cores} core(s) that alone is at least "
        f"{_f(floor, 2, 'x')} the one-worker call, the floor of the ratio below on this machine."
    )
    lines.append("")
    ratio = med["all"] / med["one"] if med["one"] else math.nan
    targets = [
        f"* {PARALLEL_WORKERS} lost at once replaced in <= {PARALLEL_RATIO:g}x the time of one "
        f"(call medians, {os.cpu_count()} cores): {_f(med['all'], 2)} s / {_f(med['one'], 2)} s = "
        f"{_f(ratio, 2, 'x')} "
        f"(serial would be about {PARALLEL_WORKERS}x) -> "
        f"{_verdict(None if math.isnan(ratio) else ratio <= PARALLEL_RATIO)}",
    ]
    if "cores" in med:
        k = _parallel_cores()
        per_core = med["cores"] / med["one"] if med["one"] else math.nan
        targets.append(
            f"* {k} lost at once, one per core ({k} = this machine's cores), in <= {PARALLEL_RATIO:g}x the "
            f"time of one (report only: the case the target above describes, with as many cores as "
            f"losses): {_f(med['cores'], 2)} s / {_f(med['one'], 2)} s = {_f(per_core, 2, 'x')} "
            f"(serial would be about {k}x)"
        )
    return lines, targets


def _shown_args(argv: Sequence[str]) -> list[str]:
    """The command line's options that change the measurement (not where it is written)."""
    shown: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith(("--out=", "--no-progress")):
            shown.append(arg)
    return shown


def build_markdown(trials: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cmd = " ".join(["python benchmarks/restart_policy.py", *_shown_args(sys.argv[1:])])
    lines = [
        f"# Restart policy: recycling and parallel replacement{' (--quick)' if args.quick else ''}",
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores, "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, Python {platform.python_version()}, torch "
        f"{torch.__version__.split('+')[0]}, torchrl {_version('torchrl')}; {args.elapsed / 60:.1f} min. "
        f"{args.rounds} round(s), every trial a fresh interpreter, the order rotated per round. Other "
        f"jobs may share the machine: each trial waited (up to {args.quiet_wait:g} s) until they used "
        f"under {args.max_external:g} cores (load before each trial: "
        f"{[round(t['load_before'], 2) for t in trials]} cores).",
        "",
    ]
    targets: list[str] = []
    sections = {"memory": _memory_section, "reset_cost": _reset_section, "parallel": _parallel_section}
    for cell, section in sections.items():
        if cell not in args.cells:  # not run: neither measured nor judged
            targets.append(f"* `{cell}`: not run (`--cells {','.join(args.cells)}`)")
            continue
        body, met = section(trials, args)
        lines += body
        targets += met
    lines += ["## Targets", "", *targets, ""]
    problems = []
    for t in trials:
        where = f"round {t['spec']['round']} / {t['spec']['cell']}"
        r = t["result"]
        if r.get("error"):
            problems.append(f"* {where}: **error** `{r['error']}`")
            for block in (r.get("traceback"), r.get("stacks")):
                if block:
                    problems += ["", "```", block.rstrip(), "```", ""]
        if r.get("workers_alive_after_close"):
            problems.append(f"* {where}: workers alive 3 s after close(): {r['workers_alive_after_close']}")
        if r.get("strays_after_exit"):
            problems.append(f"* {where}: alive 5 s after the trial exited (killed): {r['strays_after_exit']}")
    if args.final_strays:
        problems.append(f"* end of run: still alive (killed): {args.final_strays}")
    lines += ["## Errors and leftovers", "", *(problems or ["None."]), ""]
    return "\n".join(lines) + "\n"


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__).split("+")[0]
    except Exception:
        return "?"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="rounds of the three trials (3; --quick 1)")
    p.add_argument("--episodes", type=int, default=110, help="episodes per slot, measurement 1")
    p.add_argument("--episode-len", type=int, default=4, help="steps per episode, measurement 1")
    p.add_argument("--growth-mib", type=float, default=20.0, help="memory kept per reset, MiB")
    p.add_argument("--headroom-mib", type=float, default=200.0, help="recycle_memory over the baseline, MiB")
    p.add_argument("--boundaries", type=int, default=None, help="boundary calls of each kind (80; 60)")
    p.add_argument("--reset-sleep", type=float, default=0.02, help="seconds each reset sleeps, measurement 2")
    p.add_argument(
        "--reset-tensor-mib",
        type=float,
        default=4.0,
        help="MiB of tensor each reset builds afresh, measurement 2 (0: none; a fresh worker pays the "
        "first touch of that memory)",
    )
    p.add_argument(
        "--lengths",
        default=",".join(map(str, RESET_COST_LENGTHS)),
        help="the two slots' episode lengths, measurement 2 (steps, comma-separated)",
    )
    p.add_argument("--cells", default=",".join(CELLS), help=f"measurements to run (of {', '.join(CELLS)})")
    p.add_argument(
        "--repeats", type=int, default=None, help="kills of each kind per trial, measurement 3 (3; 2)"
    )
    p.add_argument("--max-external", type=float, default=0.3, help="cores other jobs may use before a trial")
    p.add_argument("--quiet-wait", type=float, default=15.0, help="seconds to wait for them at most")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: benchmarks/results/)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    args.cells = [c for c in args.cells.split(",") if c]
    if len(args.lengths) != 2 or not set(args.cells) <= set(CELLS):
        p.error("--lengths takes two episode lengths; --cells names measurements of " + ", ".join(CELLS))
    args.boundaries = args.boundaries or (60 if args.quick else 80)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.repeats * (1 + PARALLEL_WORKERS) > PARALLEL_MAX_RESTARTS:
        p.error(f"--repeats {args.repeats}: more restarts than max_restarts={PARALLEL_MAX_RESTARTS}")
    if args.out is None:
        args.out = RESULTS / ("restart_policy_quick.md" if args.quick else "restart_policy.md")
    return args


def _spec(cell: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, Any] = {"cell": cell, "round": round_}
    if cell == "memory":
        return {
            **base,
            "episodes": args.episodes,
            "episode_len": args.episode_len,
            "growth_mib": args.growth_mib,
            "headroom_mib": args.headroom_mib,
            "timeout": 240.0,
        }
    if cell == "reset_cost":
        return {
            **base,
            "boundaries": args.boundaries,
            "reset_sleep": args.reset_sleep,
            "reset_tensor_mib": args.reset_tensor_mib,
            "lengths": args.lengths,
            "timeout": 240.0,
        }
    return {**base, "repeats": args.repeats, "timeout": 120.0 + 60.0 * args.repeats}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        out_path = Path(args.child_out)
        out_path.write_text(json.dumps(run_child(json.loads(args.child), out_path)))
        return 0
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    started = time.perf_counter()
    plan = []
    for r in range(args.rounds):
        shift = r % len(CELLS)
        plan += [_spec(cell, r, args) for cell in (*CELLS[shift:], *CELLS[:shift]) if cell in args.cells]
    trials: list[dict[str, Any]] = []
    bar = tqdm(plan, desc="restart_policy", unit="trial", disable=args.no_progress)
    try:
        for spec in bar:
            bar.set_postfix_str(f"{spec['cell']} r{spec['round']}")
            load = wait_for_quiet(args.max_external, max_wait=args.quiet_wait)
            result = run_trial(spec)
            if result.get("error"):
                tqdm.write(f"{spec['cell']} r{spec['round']}: {result['error']}")
            trials.append({"spec": spec, "load_before": load, "result": result})
    finally:
        bar.close()
        args.final_strays = _end_strays(cap=1.0)
    args.elapsed = time.perf_counter() - started
    text = build_markdown(trials, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(trials, indent=1))
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
