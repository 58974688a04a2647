"""Restart benchmark: how soon does a lost worker's slot work again, and what would a rebuild cost?

Three measurements, every trial in a fresh interpreter, the trials of a round interleaved (the
order rotates per round), 4 workers of ``tests/envs.py``'s trivial ``ToyEnv`` by default:

1. **Restart latency.** ``ManagedParallelEnv(4, make_env, daemon_workers=False, max_restarts=N)``
   with the default start (forks of the preloaded server), and for context with
   ``mp_start_method="fork"`` and ``"spawn"``. Between two steps a random worker is SIGKILLed and
   ``step_and_maybe_reset`` is called at once; the call returns normally, and
   ``env.restarts[-1].ready_after`` (from the loss being noticed to the replacement having built
   its env) is the latency. ``--kills`` such restarts in one env (``--spawn-kills`` under spawn).
   For the preloaded start a few more kills are followed by a pause before the next call
   (``--idle-kills``): restarts happen in the calling thread, at the next call, so there
   ``ready_after`` also counts the pause, and the next call's duration is what the restart costs.
2. **Upstream rebuild.** What a user of ``torchrl.envs.ParallelEnv(4, make_env)`` (TorchRL's
   default start method, spawn) pays instead: after a worker was SIGKILLed, ``close()`` (which
   raises after a death: ``close(raise_if_closed=False)`` in ``try``), construct a new env, first
   ``reset()``. Every timed build is a rebuild: the interpreter built (and imported) an env first.
3. **Hang detection.** ``ManagedParallelEnv(4, make_env, create_env_kwargs=[{}, {}, {},
   {"step_sleep": 3600.0}], step_timeout=1.0, max_restarts=N)``: worker 3 never answers a step.
   Each repeat is ``env.step(env.rand_action(env.reset()))``; the detection latency is from the
   call's start to ``env.restarts[-1].time`` (the hung worker's loss noticed, after its SIGKILL).

Every env is closed; each trial checks that no worker (of any incarnation) is alive after
``close()`` and that no process but the known helpers is left below it, and the parent kills and
reports whatever this run left behind. Results: ``benchmarks/results/restart.md`` and ``.json``
(``restart_quick.*`` with ``--quick``).

    python benchmarks/restart.py            # 2 rounds, 20 kills per env: about 5 minutes on 2 cores
    python benchmarks/restart.py --quick    # 1 round, 5 kills per env: about 2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import startup
from _machine import child_trial, interleaved, run_script_child, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: Start methods of the restart-latency trials (``preloaded``: no ``mp_start_method``).
METHODS = ("preloaded", "fork", "spawn")
CELLS = (*METHODS, "upstream", "hang")
TARGET_LATENCY_S = 0.5
TARGET_RATIO = 10.0
TARGET_HANG_SLACK_S = 0.5
#: Columns of the hang table: key, scale, digits.
HANG_COLUMNS = (("detect_s", 1.0, 3), ("call_s", 1.0, 3), ("ready_after_s", 1e3, 0))


# ============================================================================ child process


def _factory() -> Any:
    from tests.envs import make_env

    return functools.partial(make_env)


def _step(env: Any, td: Any) -> tuple[Any, Any, float]:
    td.set("action", env.action_spec.rand())
    t = time.perf_counter()
    out, td = env.step_and_maybe_reset(td)
    return out, td, time.perf_counter() - t


def _live(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` that are running (not gone, not a zombie)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if startup._status(psutil.Process(pid)) not in (None, "zombie"):
                out.append(pid)
    return out


def _leftovers(wait: float = 3.0) -> list[str]:
    """Descendants of this process that are not helpers, waiting up to ``wait`` s for them to go."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process().children(recursive=True):
                cmd = startup._cmd(proc)
                if startup._status(proc) not in (None, "zombie") and not startup._is_helper(proc, cmd):
                    left.append(f"{proc.pid} {cmd}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _closed(env: Any, pids: Sequence[int], managed: bool) -> dict[str, Any]:
    """Close ``env``; which of ``pids`` (every worker it ever had) and other descendants remain."""
    t = time.perf_counter()
    env.close()
    out: dict[str, Any] = {"close_s": time.perf_counter() - t}
    if managed:
        report = env.supervision_report
        out["outcomes"] = None if report is None else [w.outcome for w in report.workers]
        out["report_restarts"] = None if report is None else report.restarts
    time.sleep(0.2)
    out["workers_alive_after_close"] = _live(pids)
    out["leftovers_after_close"] = _leftovers()
    return out


@contextlib.contextmanager
def _managed(
    out: dict[str, Any], n: int, factory: Any, **kwargs: Any
) -> Iterator[tuple[Any, Any, list[int]]]:
    """A ``ManagedParallelEnv(daemon_workers=False)`` reset once (time to that reset and start
    method in ``out``), with the list its user extends with the pids of new workers; closed
    (and checked, into ``out``) at the end."""
    from torchrl_ext import ManagedParallelEnv

    t = time.perf_counter()
    # The restart itself is measured: no backoff between repeated restarts of a slot.
    kwargs.setdefault("restart_backoff", None)
    env = ManagedParallelEnv(n, factory, daemon_workers=False, **kwargs)
    try:
        td = env.reset()
        out.update(first_reset_s=time.perf_counter() - t, start_method=env.start_method)
        pids = list(env.worker_pids)
        yield env, td, pids
    except BaseException:
        with contextlib.suppress(Exception):
            env.close()
        raise
    out.update(_closed(env, pids, managed=True))


def trial_restart(spec: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL a random worker between steps ``kills`` times, calling the next step at once (then
    ``idle_kills`` times with a pause first); read each restart's record."""
    method, n = spec["method"], int(spec["workers"])
    kills, idle_kills = int(spec["kills"]), int(spec.get("idle_kills", 0))
    rng = random.Random(int(spec["seed"]))
    kwargs = {} if method == "preloaded" else {"mp_start_method": method}
    out: dict[str, Any] = {"restarts": [], "idle_restarts": [], "checks_failed": []}
    with _managed(out, n, _factory(), max_restarts=kills + idle_kills + 2, **kwargs) as (env, td, pids):
        normal: list[float] = []
        for i in range(kills + idle_kills):
            for _ in range(int(spec["steps_between"])):
                _, td, dt = _step(env, td)
                normal.append(dt)
            slot = rng.randrange(n)
            victim = env.worker_pids[slot]
            idle = i >= kills
            before = len(env.restarts)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            if idle:
                time.sleep(float(spec["idle_wait"]))
            nxt, td, call_s = _step(env, td)
            records = env.restarts
            record = records[-1] if len(records) > before else None
            if record is None:
                out["checks_failed"].append(f"kill {i}: no restart recorded (slot {slot}, pid {victim})")
                continue
            pids.append(record.new_pid)
            marked = bool(nxt.get(("next", "worker_restarted")).reshape(n)[slot])
            problems = [
                what
                for what, bad in (
                    (f"{len(records) - before} records", len(records) != before + 1),
                    (f"slot {record.slot} != {slot}", record.slot != slot),
                    (f"old pid {record.old_pid} != {victim}", record.old_pid != victim),
                    ("new pid not in worker_pids", record.new_pid != env.worker_pids[slot]),
                    (f"cause {record.cause!r}", record.cause != -signal.SIGKILL),
                    ("transition not marked worker_restarted", not marked),
                )
                if bad
            ]
            if problems:
                out["checks_failed"].append(f"kill {i}: " + "; ".join(problems))
            (out["idle_restarts"] if idle else out["restarts"]).append(
                {
                    "slot": slot,
                    "ready_after_s": record.ready_after,
                    "kill_to_noticed_s": record.time - killed_at,
                    "kill_to_ready_s": record.time + record.ready_after - killed_at,
                    "call_s": call_s,
                    "command": record.command,
                    "cause": record.cause,
                }
            )
        for _ in range(int(spec["steps_between"])):  # the env still works after the last restart
            _, td, dt = _step(env, td)
            normal.append(dt)
        out["normal_step_s"] = statistics.median(normal) if normal else math.nan
        out["restart_count"] = len(env.restarts)
    return out


def trial_upstream(spec: dict[str, Any]) -> dict[str, Any]:
    """Upstream ``ParallelEnv``: after a worker's SIGKILL, close + construct + first reset."""
    from torchrl.envs import ParallelEnv

    n, rng = int(spec["workers"]), random.Random(int(spec["seed"]))
    factory = _factory()
    out: dict[str, Any] = {"rebuilds": []}
    t = time.perf_counter()
    env = ParallelEnv(n, factory)
    td = env.reset()
    out["first_build_s"] = time.perf_counter() - t
    pids: list[int] = []
    try:
        for _ in range(int(spec["rebuilds"])):
            for _ in range(int(spec["steps_between"])):
                _, td, _ = _step(env, td)
            workers = list(env._workers)
            old = [p.pid for p in workers]  # close() may close the Process objects
            pids += old
            victim = workers[rng.randrange(n)]
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            t0 = time.perf_counter()
            error = None
            try:
                env.close(raise_if_closed=False)
            except Exception as err:
                error = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
            t1 = time.perf_counter()
            env = ParallelEnv(n, factory)
            t2 = time.perf_counter()
            td = env.reset()
            t3 = time.perf_counter()
            out["rebuilds"].append(
                {
                    "close_s": t1 - t0,
                    "construct_s": t2 - t1,
                    "reset_s": t3 - t2,
                    "rebuild_s": t3 - t0,
                    "close_error": error,
                    "old_workers_alive": len(_live(old)),
                }
            )
        pids += [p.pid for p in env._workers]
    except BaseException:
        with contextlib.suppress(Exception):
            env.close(raise_if_closed=False)
        raise
    out.update(_closed(env, pids, managed=False))
    return out


def trial_hang(spec: dict[str, Any]) -> dict[str, Any]:
    """The last worker sleeps an hour in every step: each step call hangs until step_timeout."""
    from tests.envs import make_env

    n, repeats, timeout = int(spec["workers"]), int(spec["repeats"]), float(spec["step_timeout"])
    per_worker: list[dict[str, Any]] = [{} for _ in range(n - 1)] + [{"step_sleep": 3600.0}]
    out: dict[str, Any] = {"hangs": [], "checks_failed": []}
    hung = {"create_env_kwargs": per_worker, "max_restarts": repeats + 2, "step_timeout": timeout}
    with _managed(out, n, make_env, **hung) as (env, td, pids):
        for i in range(repeats):
            td = env.reset()
            action = env.rand_action(td)
            before = len(env.restarts)
            started = time.time()
            t0 = time.perf_counter()
            nxt = env.step(action)
            call_s = time.perf_counter() - t0
            records = env.restarts
            if len(records) != before + 1:
                out["checks_failed"].append(f"repeat {i}: {len(records) - before} restarts recorded")
                continue
            record = records[-1]
            pids.append(record.new_pid)
            marked = bool(nxt.get(("next", "worker_restarted")).reshape(n)[n - 1])
            if record.cause != "hung" or record.slot != n - 1 or not marked:
                out["checks_failed"].append(
                    f"repeat {i}: cause {record.cause!r}, slot {record.slot}, marked {marked}"
                )
            out["hangs"].append(
                {
                    "detect_s": record.time - started,
                    "call_s": call_s,
                    "ready_after_s": record.ready_after,
                    "command": record.command,
                }
            )
    return out


TRIALS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "restart": trial_restart,
    "upstream": trial_upstream,
    "hang": trial_hang,
}


def run_child(spec: dict[str, Any], out_path: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    return child_trial(TRIALS, spec["mode"], spec, out_path, ("torch", "torchrl.envs", "torchrl_ext"))


# ============================================================================ parent side


def _spec(cell: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    base = {"workers": args.workers, "seed": round_, "steps_between": args.steps_between}
    if cell in METHODS:
        kills = args.spawn_kills if cell == "spawn" else args.kills
        idle = args.idle_kills if cell == "preloaded" else 0
        timeout = 90.0 + (40.0 if cell == "spawn" else 2.0) * (kills + idle)
        restart = {"method": cell, "kills": kills, "idle_kills": idle, "idle_wait": args.idle_wait}
        return {**base, **restart, "mode": "restart", "timeout": timeout}
    if cell == "upstream":
        return {
            **base,
            "mode": "upstream",
            "rebuilds": args.rebuilds,
            "timeout": 120.0 + 60.0 * args.rebuilds,
        }
    timeout = 90.0 + (args.step_timeout + 10.0) * args.hang_repeats
    hang = {"repeats": args.hang_repeats, "step_timeout": args.step_timeout}
    return {**base, **hang, "mode": "hang", "timeout": timeout}


def _wait_strays(cap: float = 5.0) -> tuple[list[str], float]:
    """After a trial: wait up to ``cap`` s until nothing tagged with this run is alive; kill and
    return whatever is left (and how long the wait took)."""
    t = time.monotonic()
    while (strays := startup._strays()) and time.monotonic() - t < cap:
        time.sleep(0.05)
    cmds = [startup._cmd(p) for p in strays]
    startup._kill(strays)
    return cmds, time.monotonic() - t


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="torchrl_ext-bench-restart-") as tmp:
        out_path = Path(tmp) / "result.json"
        t = time.perf_counter()
        result, error = run_script_child(
            str(Path(__file__).resolve()),
            spec,
            out_path,
            float(spec["timeout"]),
            env={startup.RUN_VAR: startup.RUN_TAG},
        )
        wall = time.perf_counter() - t
        stacks = (Path(tmp) / "stacks.txt").read_text() if (Path(tmp) / "stacks.txt").exists() else ""
    if result is None:
        result = {"error": error, "stacks": stacks[-6000:] or None}
    strays, waited = _wait_strays()
    result.update(trial_wall_s=wall, strays_after_exit=strays, strays_wait_s=waited)
    return result


# ---------------------------------------------------------------------------- statistics and report


def _values(trials: Sequence[dict[str, Any]], cell: str, list_key: str, key: str) -> list[float]:
    return [float(r[key]) for t in trials if t["cell"] == cell for r in t.get(list_key, [])]


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _max(values: Sequence[float]) -> float:
    return max(values) if values else math.nan


def _f(value: float, digits: int = 3) -> str:
    return startup._fmt(value, digits)


def _x(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0f}x"


def _ms(value: float) -> str:
    return startup._fmt(value * 1e3, 0)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def _joined(rows: Sequence[dict[str, Any]], key: str, scale: float, digits: int) -> str:
    return ", ".join(f"{row[key] * scale:.{digits}f}" for row in rows) or "n/a"


def _verdict(ok: bool | None) -> str:
    return startup._verdict(ok)


def _round_ratios(trials: Sequence[dict[str, Any]]) -> list[float]:
    """Per round: median upstream rebuild / median preloaded ``ready_after`` of the same round."""
    out = []
    for r in sorted({t["round"] for t in trials}):
        same = [t for t in trials if t["round"] == r]
        up = _med(_values(same, "upstream", "rebuilds", "rebuild_s"))
        managed = _med(_values(same, "preloaded", "restarts", "ready_after_s"))
        if not math.isnan(up) and managed and not math.isnan(managed):
            out.append(up / managed)
    return out


def _latency_table(trials: Sequence[dict[str, Any]]) -> list[str]:
    header = (
        "start method",
        "restarts",
        "ready_after median / max, ms",
        "kill to ready median / max, ms",
        "kill to noticed median, ms",
        "step call with restart median / max, ms",
        "normal step, ms",
        "first reset, s",
        "close, s",
    )
    rows = []
    for method in METHODS:
        spread = {
            key: _values(trials, method, "restarts", key)
            for key in ("ready_after_s", "kill_to_ready_s", "kill_to_noticed_s", "call_s")
        }
        ok = [t for t in trials if t["cell"] == method and not t.get("error")]
        once = {
            key: _med([t[key] for t in ok if key in t])
            for key in ("normal_step_s", "first_reset_s", "close_s")
        }
        rows.append(
            (
                "default (preloaded)" if method == "preloaded" else method,
                len(spread["ready_after_s"]),
                *(
                    f"{_ms(_med(spread[key]))} / {_ms(_max(spread[key]))}"
                    for key in ("ready_after_s", "kill_to_ready_s")
                ),
                _ms(_med(spread["kill_to_noticed_s"])),
                f"{_ms(_med(spread['call_s']))} / {_ms(_max(spread['call_s']))}",
                _f(once["normal_step_s"] * 1e3, 2),
                _f(once["first_reset_s"], 2),
                _f(once["close_s"]),
            )
        )
    return _table(header, rows)


def build_markdown(trials: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, list[str]]:
    lines: list[str] = [f"# Worker restart benchmark{' (--quick)' if args.quick else ''}", ""]
    add = lines.append
    lines.extend(startup._machine_lines(args))
    add("")
    loads = [t["loadavg"][0] for t in trials if t.get("loadavg")]
    if loads:
        add(f"Load average (1 min) when each trial ended: {min(loads):.2f} to {max(loads):.2f}.")
        add("")
    add(
        f"{args.rounds} round(s); each round runs every trial once, each trial a fresh interpreter "
        "(imports done before any clock starts), the order rotated per round. "
        f"{args.workers} workers of `tests/envs.py`'s `make_env` (a trivial `ToyEnv`), "
        f"{args.steps_between} `step_and_maybe_reset` calls between two kills."
    )
    add("")
    add("## 1. Restart latency")
    add("")
    add(
        f"`ManagedParallelEnv({args.workers}, partial(make_env), daemon_workers=False, max_restarts=N)`, "
        "one env per trial. Between two steps a random worker is SIGKILLed and the next "
        f"`step_and_maybe_reset` is called at once; {args.kills} kills per env ({args.spawn_kills} under "
        "spawn, whose replacement imports torch afresh). Each call is expected to return normally with "
        "the slot's transition marked `worker_restarted`, and one new record with the killed slot, "
        "old and new pid and cause -9: "
        f"{sum(len(t.get('checks_failed', [])) for t in trials if t['cell'] in METHODS)} such checks "
        f"failed, {sum(1 for t in trials if t['cell'] in METHODS and t.get('error'))} trials raised "
        "(both listed at the end)."
    )
    add("")
    add(
        "* **ready_after**: `env.restarts[-1].ready_after`, from the loss being noticed (the "
        "supervisor thread sees the worker's exit) to the replacement having built its env "
        "(TorchRL's handshake). **kill to ready**: the same end, from just before `os.kill` "
        "(`record.time + record.ready_after - kill time`, wall clock). **kill to noticed**: "
        "`record.time - kill time`.\n"
        "* **step call with restart**: the whole `step_and_maybe_reset` call that followed the kill "
        "(restart, reset of the new env, marked transition, the other workers' steps, and the "
        "automatic reset of the marked slot). **normal step**: median call without a kill.\n"
        "* **first reset**: from the constructor to the first `reset()` returning (for the preloaded "
        "start this includes starting the fork server). **close**: `close()` after all the restarts."
    )
    add("")
    lines.extend(_latency_table(trials))
    add("")
    idle = [r for t in trials if t["cell"] == "preloaded" for r in t.get("idle_restarts", [])]
    if idle:
        calls = [r["call_s"] for r in idle]
        ready = [r["ready_after_s"] for r in idle]
        add(
            f"**Death noticed while idle** (default start, {len(idle)} kills each followed by "
            f"{args.idle_wait:g} s before the next call): the restart is made by the next call, so "
            f"`ready_after` also counts the pause (median {_ms(_med(ready))} ms, max {_ms(_max(ready))} ms); "
            f"the next call took median {_ms(_med(calls))} ms, max {_ms(_max(calls))} ms."
        )
        add("")
    add("## 2. Versus rebuilding an upstream ParallelEnv")
    add("")
    add(
        f"`torchrl.envs.ParallelEnv({args.workers}, partial(make_env))`, no `mp_start_method` "
        f"(TorchRL's default: spawn). In one interpreter: build and reset a first env (not counted: "
        f"imports, first use), then {args.rebuilds} times: {args.steps_between} steps, SIGKILL a random "
        "worker and join it, then time `close(raise_if_closed=False)` (in `try`; it raises after a "
        "death), constructing a new env and its first `reset()`."
    )
    add("")
    rows = []
    for key, label in (
        ("close_s", "close()"),
        ("construct_s", "constructor"),
        ("reset_s", "first reset()"),
        ("rebuild_s", "**rebuild: close + construct + reset**"),
    ):
        vals = _values(trials, "upstream", "rebuilds", key)
        rows.append(
            (label, len(vals), _f(_med(vals), 2), _f(min(vals, default=math.nan), 2), _f(_max(vals), 2))
        )
    lines.extend(_table(("", "n", "median s", "min s", "max s"), rows))
    firsts = [t["first_build_s"] for t in trials if t["cell"] == "upstream" and "first_build_s" in t]
    add("")
    errors = sorted({r["close_error"] or "none" for t in trials for r in t.get("rebuilds", [])})
    alive = sum(r["old_workers_alive"] for t in trials for r in t.get("rebuilds", []))
    add(
        f"First env of each interpreter (not counted): median {_f(_med(firsts), 2)} s. What `close()` "
        f"raised: {errors}. Workers of a closed env still alive after it: {alive}."
    )
    add("")
    rebuild = _med(_values(trials, "upstream", "rebuilds", "rebuild_s"))
    ready = _med(_values(trials, "preloaded", "restarts", "ready_after_s"))
    to_ready = _med(_values(trials, "preloaded", "restarts", "kill_to_ready_s"))
    call = _med(_values(trials, "preloaded", "restarts", "call_s"))
    ratio = rebuild / ready if ready else math.nan
    per_round = _round_ratios(trials)
    add(
        f"**Ratio** upstream rebuild / managed restart (default start), medians: "
        f"{_f(rebuild, 2)} s / {_ms(ready)} ms `ready_after` = **{_x(ratio)}** (per round: "
        f"{', '.join(_x(r) for r in per_round) or 'n/a'}); against kill to ready "
        f"{_x(rebuild / to_ready if to_ready else math.nan)}; against the whole step call with the "
        f"restart {_x(rebuild / call if call else math.nan)}."
    )
    add("")
    add("## 3. Hang detection")
    add("")
    add(
        f"`ManagedParallelEnv({args.workers}, make_env, create_env_kwargs=[{{}}, ..., "
        f'{{"step_sleep": 3600.0}}], daemon_workers=False, max_restarts=N, step_timeout='
        f"{args.step_timeout:g})` (default start): the last worker sleeps an hour in each step, and so "
        f"does each of its replacements. {args.hang_repeats} times per env: "
        "`env.step(env.rand_action(env.reset()))`. **detection**: from the step call's start to "
        "`env.restarts[-1].time` (the hung worker SIGKILLed and its loss noticed); **call**: the "
        "whole `step()` call; **ready_after**: the replacement's start."
    )
    add("")
    rows = [
        (t["round"], *(_joined(t.get("hangs", []), k, scale, d) for k, scale, d in HANG_COLUMNS))
        for t in trials
        if t["cell"] == "hang"
    ]
    lines.extend([*_table(("round", "detection s", "call s", "ready_after ms"), rows), ""])
    detect = _values(trials, "hang", "hangs", "detect_s")
    verdicts = _targets(trials, args, ratio, detect)
    lines.extend(["## Targets", "", *_table(("target", "measured", "met"), verdicts), ""])
    lines.extend(_problems(trials, args))
    return "\n".join(lines) + "\n", [f"{t}: {m} -> {v}" for t, m, v in verdicts]


def _targets(
    trials: list[dict[str, Any]], args: argparse.Namespace, ratio: float, detect: list[float]
) -> list[tuple[str, str, str]]:
    ready = _values(trials, "preloaded", "restarts", "ready_after_s")
    to_ready = _values(trials, "preloaded", "restarts", "kill_to_ready_s")
    seen = bool(ready)
    limit = args.step_timeout + TARGET_HANG_SLACK_S
    return [
        (
            f"restart latency, default start, median <= {TARGET_LATENCY_S:g} s",
            f"ready_after {_ms(_med(ready))} ms, kill to ready {_ms(_med(to_ready))} ms "
            f"({len(ready)} restarts)",
            _verdict(_med(ready) <= TARGET_LATENCY_S if seen else None),
        ),
        (
            f"restart latency, default start, every restart <= {TARGET_LATENCY_S:g} s",
            f"max ready_after {_ms(_max(ready))} ms, max kill to ready {_ms(_max(to_ready))} ms",
            _verdict(_max(ready) <= TARGET_LATENCY_S if seen else None),
        ),
        (
            f"upstream rebuild / managed restart (medians) >= {TARGET_RATIO:g}x",
            _x(ratio),
            _verdict(None if math.isnan(ratio) else ratio >= TARGET_RATIO),
        ),
        (
            f"hang detected within step_timeout + {TARGET_HANG_SLACK_S:g} s = {limit:g} s, every repeat",
            f"{len(detect)} hangs: median {_f(_med(detect))} s, max {_f(_max(detect))} s",
            _verdict(_max(detect) <= limit if detect else None),
        ),
        (
            "nothing left running (workers of every incarnation, descendants, processes of this run)",
            f"{_count_left(trials)} left after close or exit; {args.final_strays} at the end of the run",
            _verdict(_count_left(trials) == 0 and args.final_strays == 0),
        ),
    ]


def _count_left(trials: Sequence[dict[str, Any]]) -> int:
    return sum(
        len(t.get(key) or [])
        for t in trials
        for key in ("workers_alive_after_close", "leftovers_after_close", "strays_after_exit")
    )


def _problems(trials: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    out = ["## Errors, failed checks, leftovers", ""]
    for t in trials:
        where = f"round {t['round']} / {t['cell']}"
        if t.get("error"):
            out.append(f"* {where}: **error** `{t['error']}`")
            for block in (t.get("traceback"), t.get("stacks")):
                if block:
                    out.extend(["", "```", block.rstrip(), "```", ""])
        out.extend(f"* {where}: check failed: {c}" for c in t.get("checks_failed", []))
        for key, label in (
            ("workers_alive_after_close", "workers alive after close()"),
            ("leftovers_after_close", "other descendants alive 3 s after close()"),
            ("strays_after_exit", "processes of the trial alive 5 s after it exited (killed here)"),
        ):
            if t.get(key):
                out.append(f"* {where}: {label}: {t[key]}")
        if t.get("outcomes") and any(o != "graceful" for o in t["outcomes"]):
            out.append(f"* {where}: close() not graceful: {t['outcomes']}")
    if args.final_strays:
        out.append(f"* end of run: {args.final_strays} process(es) of this run still alive (killed)")
    if len(out) == 2:
        out.append("None.")
    out.append("")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="rounds of every trial (default 2, --quick 1)")
    p.add_argument("--kills", type=int, default=None, help="restarts per env, preloaded and fork (20; 5)")
    p.add_argument("--spawn-kills", type=int, default=None, help="restarts per env under spawn (3; 2)")
    p.add_argument("--idle-kills", type=int, default=None, help="kills followed by a pause (5; 3)")
    p.add_argument("--idle-wait", type=float, default=0.5, help="that pause, s")
    p.add_argument("--rebuilds", type=int, default=None, help="upstream rebuilds per interpreter (3; 2)")
    p.add_argument("--hang-repeats", type=int, default=None, help="hung steps per env (5; 3)")
    p.add_argument("--step-timeout", type=float, default=1.0)
    p.add_argument("--steps-between", type=int, default=10, help="steps between two kills")
    p.add_argument("--max-external", type=float, default=0.3, help="cores other jobs may use before a trial")
    p.add_argument("--quiet-wait", type=float, default=8.0, help="seconds to wait for them at most")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: benchmarks/results/)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("rounds", 2, 1),
        ("kills", 20, 5),
        ("spawn_kills", 3, 2),
        ("idle_kills", 5, 3),
        ("rebuilds", 3, 2),
        ("hang_repeats", 5, 3),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.out is None:
        args.out = RESULTS / ("restart_quick.md" if quick else "restart.md")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        out_path = Path(args.child_out)
        result = run_child(json.loads(args.child), out_path)
        out_path.write_text(json.dumps(result))
        return 0
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    started = time.perf_counter()
    args.git = startup._git_state()
    schedule = list(interleaved(args.rounds, ("restart",), (args.workers,), CELLS))
    trials: list[dict[str, Any]] = []
    loads: list[float] = []
    bar = tqdm(schedule, desc="restart", unit="trial", disable=args.no_progress)
    try:
        for round_, _, _, cell in bar:
            bar.set_postfix_str(f"r{round_} {cell}")
            loads.append(wait_for_quiet(args.max_external, max_wait=args.quiet_wait))
            result = run_trial(_spec(cell, round_, args))
            result.update(round=round_, cell=cell, external_load=loads[-1], loadavg=os.getloadavg())
            trials.append(result)
            if result.get("error"):
                tqdm.write(f"r{round_} {cell}: {result['error']}")
    finally:
        bar.close()
        strays = startup._strays()
        startup._kill(strays)
        children = psutil.Process().children(recursive=True)
        startup._kill(children)
    args.final_strays = len({p.pid for p in [*strays, *children]})
    args.external_load = _med(loads)
    args.command = " ".join(["python benchmarks/restart.py", *(sys.argv[1:] if argv is None else argv)])
    args.generated = time.strftime("%Y-%m-%d %H:%M")
    args.elapsed = time.perf_counter() - started
    markdown, verdicts = build_markdown(trials, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    raw = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trials": trials,
    }
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(markdown)
    for verdict in verdicts:
        print("TARGET", verdict)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
