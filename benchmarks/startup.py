"""Start-up and close benchmark: how long until the first reset, what does a worker cost?

Six configurations, each trial in a fresh interpreter, interleaved (repeat r runs every cell
once before repeat r + 1 starts, and the order of the configurations rotates per repeat):

1. ``upstream_default``  ``torchrl.envs.ParallelEnv``, no ``mp_start_method`` (TorchRL: spawn)
2. ``upstream_fork``     ``ParallelEnv(mp_start_method="fork")``
3. ``managed_default``   ``ManagedParallelEnv(daemon_workers=False)``, no ``mp_start_method``:
                         workers are forks of the preloaded server (``start_method == "preloaded"``),
                         itself a fork of the trial's process (a zygote: the process is fork-safe)
3b. ``managed_interpreter`` the same with ``TORCHRL_EXT_ZYGOTE=0``: the server is a new
                         interpreter that imports torch again (the default path before the zygote,
                         and the fallback of a process that is not fork-safe)
4. ``managed_spawn``     ``ManagedParallelEnv(daemon_workers=False, mp_start_method="spawn")``
5. ``managed_fork``      ``ManagedParallelEnv(daemon_workers=False, mp_start_method="fork")``

for two envs from ``tests/envs.py`` (``trivial``: ``ToyEnv`` without a loader; ``dataloader``:
``ToyEnv(loader="persistent")``, a ``DataLoader(num_workers=2, persistent_workers=True)`` built
by the first reset, no ``multiprocessing_context``) and each number of workers.

Per trial: the first env of the process ("cold": from just before the constructor, after every
import, to the first finished ``reset()`` and to the end of a short rollout), ``close()`` time and
whether it was graceful, PSS per worker, defunct children 1 s after close, and a second env of
the same configuration built after the first was closed ("warm"). The parent captures the
trial's stderr to see whether ``multiprocessing``'s resource tracker warned at exit. Then a
SIGKILL-while-starting measurement: a process building a 4-worker ``managed_default`` env is
SIGKILLed during its first reset; the time until every process carrying its
``TORCHRL_EXT_OWNER`` tag is gone. Results: ``benchmarks/results/startup.md``
(``startup_quick.md`` with ``--quick``), a PNG chart next to it, the raw numbers as JSON.

    python benchmarks/startup.py               # workers 1,2,4,8, 3 repeats: about an hour on 2 cores
    python benchmarks/startup.py --repeats 1   # about 22 minutes
    python benchmarks/startup.py --quick       # workers 2,4, 1 repeat: about 12 minutes
    python benchmarks/startup.py --envs trivial --workers 1,2,4,8,16 --repeats 1 \
        --configs upstream_default,upstream_fork,managed_default,managed_interpreter  # the zygote

Most of the time goes to the spawn configurations with the dataloader env (every env worker and
every DataLoader worker imports torch).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from _machine import interleaved, kill_tree, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARK = "STARTUP-RESULT "
MIB = 2**20
#: Environment variable every process of this benchmark inherits, to find strays at the end.
RUN_VAR = "TORCHRL_EXT_BENCH_RUN"
RUN_TAG = f"startup-{os.getpid()}-{time.time_ns()}"
#: Helpers that may outlive an env on purpose (until interpreter exit).
HELPERS = ("resource_tracker", "_reaper.py", "torchrl_ext._forkserver", "multiprocessing.forkserver")


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    managed: bool
    start_method: str | None


CONFIGS = (
    Config("upstream_default", "upstream default (spawn)", False, None),
    Config("upstream_fork", "upstream fork", False, "fork"),
    Config("managed_default", "managed default (preloaded)", True, None),
    Config("managed_interpreter", "managed default, interpreter server", True, None),
    Config("managed_spawn", "managed spawn", True, "spawn"),
    Config("managed_fork", "managed fork", True, "fork"),
)
CONFIG_BY_KEY = {c.key: c for c in CONFIGS}
ENVS = ("trivial", "dataloader")
ENV_KWARGS: dict[str, dict[str, Any]] = {"trivial": {}, "dataloader": {"loader": "persistent"}}


# ============================================================================ child process


def _factory(env_kind: str) -> Any:
    from tests.envs import make_env

    return functools.partial(make_env, **ENV_KWARGS[env_kind])


def _build(config: Config, n: int, factory: Any) -> Any:
    from torchrl.envs import ParallelEnv

    from torchrl_ext import ManagedParallelEnv

    kwargs: dict[str, Any] = {}
    if config.start_method is not None:
        kwargs["mp_start_method"] = config.start_method
    if config.managed:
        return ManagedParallelEnv(n, factory, daemon_workers=False, **kwargs)
    return ParallelEnv(n, factory, **kwargs)


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:160] or proc.name()
    except psutil.Error:
        return "?"


def _pss(proc: psutil.Process) -> float:
    try:
        return float(getattr(proc.memory_full_info(), "pss", math.nan)) / MIB
    except psutil.Error:
        return math.nan


def _descendants() -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.Error:
        return None


def _others(live: list[str] | None) -> list[str]:
    """Live descendants that are not the lingering reaper (runs recorded before the reaper
    counted as a helper list it)."""
    return [entry for entry in live or [] if "_reaper.py" not in entry]


def _is_helper(proc: psutil.Process, cmd: str) -> bool:
    """A helper that may outlive an env; forks of a fork server share its command line, so a
    server counts only if its parent is not one. The reaper (which lingers 2 s after the last
    close, for the next env) runs behind a shim with its own command line."""
    if not any(h in cmd for h in HELPERS):
        return False
    if "_reaper.py" in cmd:
        return True
    try:
        parent = proc.parent()
    except psutil.Error:
        return True
    return parent is None or not any(h in _cmd(parent) for h in HELPERS)


def one_env(config: Config, n: int, factory: Any, steps: int) -> dict[str, Any]:
    """Build an env, time its first reset and a short rollout, measure it, close it."""
    t0 = time.perf_counter()
    env = _build(config, n, factory)
    try:
        td = env.reset()
        first_reset = time.perf_counter() - t0
        for _ in range(steps):
            td.set("action", env.action_spec.rand())
            _, td = env.step_and_maybe_reset(td)
        first_rollout = time.perf_counter() - t0
        procs = [] if config.managed else list(env._workers)
        pids = list(env.worker_pids) if config.managed else [p.pid for p in procs]
        worker_pss, tree_pss, loader_children = [], [], 0
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                kids = proc.children(recursive=True)
            except psutil.Error:
                worker_pss.append(math.nan)
                continue
            own = _pss(proc)
            worker_pss.append(own)
            tree_pss.append(own + sum(_pss(k) for k in kids))
            loader_children += len(kids)
        from torchrl_ext import _forkserver

        server = _forkserver.server_key()
        server_pss = [] if server is None else [_pss(psutil.Process(server[0]))]
        server_kind = _forkserver.server_kind()[0]
        start_method = env.start_method if config.managed else (config.start_method or "default")
    except BaseException:
        with contextlib.suppress(Exception):
            env.close()
        raise
    t1 = time.perf_counter()
    env.close()
    close_s = time.perf_counter() - t1
    alive_at_close = [
        pid for pid in pids if psutil.pid_exists(pid) and _status(psutil.Process(pid)) != "zombie"
    ]
    if config.managed:
        report = env.supervision_report
        outcomes = [] if report is None else [w.outcome for w in report.workers]
        exitcodes = [] if report is None else [w.exitcode for w in report.workers]
        graceful = bool(outcomes) and len(outcomes) == n and all(o == "graceful" for o in outcomes)
        leftovers_killed = None if report is None else report.leftovers_killed
    else:
        exitcodes = [p.exitcode for p in procs]  # joined by close(), never Process.close()d
        outcomes = ["exit 0" if c == 0 else f"exit {c}" for c in exitcodes]
        graceful = len(exitcodes) == n and all(c == 0 for c in exitcodes)
        leftovers_killed = None
    time.sleep(1.0)
    zombies, others = [], []
    for proc in _descendants():
        status, cmd = _status(proc), _cmd(proc)
        if server is not None and proc.pid == server[0]:
            continue  # the preloaded server (a zygote has this process's command line)
        if status == "zombie":
            with contextlib.suppress(psutil.Error):
                zombies.append(f"{proc.pid} {proc.name()} (parent {proc.ppid()})")
        elif status is not None and not _is_helper(proc, cmd):
            others.append(f"{proc.pid} {cmd}")
    return {
        "first_reset_s": first_reset,
        "first_rollout_s": first_rollout,
        "close_s": close_s,
        "graceful": graceful,
        "outcomes": outcomes,
        "exitcodes": exitcodes,
        "leftovers_killed": leftovers_killed,
        "alive_when_close_returned": len(alive_at_close),
        "worker_pss_mib": worker_pss,
        "worker_tree_pss_mib": tree_pss,
        "loader_children": loader_children,
        "server_pss_mib": server_pss,
        "server_kind": server_kind,
        "start_method": start_method,
        "zombies_after_1s": zombies,
        "live_descendants_after_1s": others,
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401  (imports happen before the clock starts)
    import torchrl.envs  # noqa: F401

    import torchrl_ext  # noqa: F401

    config = CONFIG_BY_KEY[spec["config"]]
    if config.key == "managed_interpreter":
        os.environ["TORCHRL_EXT_ZYGOTE"] = "0"
    factory = _factory(spec["env"])
    n, steps = int(spec["workers"]), int(spec["steps"])
    out: dict[str, Any] = {"cold": one_env(config, n, factory, steps)}
    out["warm"] = one_env(config, n, factory, steps)
    out["end_time"] = time.time()
    return out


def run_victim(spec: dict[str, Any]) -> None:
    """Build a managed default env, announce the first reset on stdout, reset, then wait."""
    sys.path.insert(0, str(ROOT))
    import torchrl.envs  # noqa: F401

    config = CONFIG_BY_KEY["managed_default"]
    env = _build(config, int(spec["workers"]), _factory(spec["env"]))
    print("RESETTING", flush=True)
    env.reset()
    print("RESET-DONE", flush=True)
    time.sleep(600)
    env.close()


# ============================================================================ parent side


def _child_env() -> dict[str, str]:
    env = dict(os.environ, **{RUN_VAR: RUN_TAG})
    env.pop("PYTHONWARNINGS", None)  # the resource tracker's warning is what we look for
    return env


def _strays(exclude: set[int] | None = None) -> list[psutil.Process]:
    """Live processes that carry this run's tag (started, directly or not, by this script)."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid() or (exclude and proc.pid in exclude):
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(RUN_VAR) == RUN_TAG and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def _kill(procs: Sequence[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(procs), timeout=5)


def run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One configuration in a fresh interpreter; its stderr is scanned for exit-time warnings."""
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, "--child", json.dumps(spec)]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
    try:
        out, err = proc.communicate(timeout=timeout)
        error = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        error = f"timed out after {timeout:.0f}s"
    ended = time.time()
    strays = _strays()
    _kill(strays)
    result: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK) :])
    if "error" in result:
        error = result["error"]
    if error is None and "cold" not in result:
        error = "no result line"
    warnings = [line for line in err.splitlines() if "resource_tracker" in line or "leaked" in line]
    result.update(
        error=error,
        resource_tracker_warning=bool(warnings),
        warning_lines=warnings[:5],
        stderr_tail=err.strip().splitlines()[-8:] if error else [],
        strays_after_exit=[_cmd(p) for p in strays],
        trial_wall_s=ended - started,
    )
    if "end_time" in result:  # last close() returned -> interpreter and its helpers gone
        result["exit_s"] = ended - result.pop("end_time")
    return result


def _tagged(owner: int) -> list[psutil.Process]:
    """Live processes whose environment carries a torchrl_ext tag of ``owner``."""
    prefix = f"{owner}:"
    out = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            tagged = proc.environ().get("TORCHRL_EXT_OWNER", "").startswith(prefix)
            if tagged and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def _server_forks(tree: Sequence[psutil.Process]) -> int:
    """How many processes of ``tree`` are forks of the preloaded server (not the server)."""
    marker = "torchrl_ext._forkserver"
    return max(0, sum(1 for p in tree if marker in _cmd(p) and _status(p) not in (None, "zombie")) - 1)


def run_kill_trial(env_kind: str, workers: int, delay: float, cap: float) -> dict[str, Any]:
    """SIGKILL a process while its managed env's first reset runs; time until its tree is gone.

    The kill comes once ``workers`` forks of the preloaded server exist (or the reset finished,
    or ``delay`` seconds after the victim announced the reset, whichever is first)."""
    script = str(Path(__file__).resolve())
    spec = {"env": env_kind, "workers": workers}
    proc = subprocess.Popen(
        [sys.executable, script, "--victim", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_child_env(),
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""

    def read(wait: float) -> None:
        nonlocal buf
        if select.select([fd], [], [], wait)[0]:
            buf += os.read(fd, 4096)

    deadline = time.monotonic() + 180.0
    while b"RESETTING" not in buf and time.monotonic() < deadline and proc.poll() is None:
        read(0.5)
    if b"RESETTING" not in buf:
        kill_tree(proc.pid)
        proc.wait()
        _kill(_strays())
        return {"error": "the victim never reached its first reset"}
    victim = psutil.Process(proc.pid)
    announced = time.monotonic()
    tree = victim.children(recursive=True)
    while time.monotonic() - announced < delay and b"RESET-DONE" not in buf:
        if _server_forks(tree) >= workers:
            break
        read(0.0)
        time.sleep(0.002)
        with contextlib.suppress(psutil.Error):
            tree = victim.children(recursive=True)
    read(0.0)
    reset_done = b"RESET-DONE" in buf
    forks_at_kill = _server_forks(tree)
    tree_cmds = [_cmd(p) for p in tree]
    killed_at = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    since_reset = time.monotonic() - announced
    proc.wait()
    seen: dict[int, str] = {}
    gone_s: float | None = None
    tree_gone_s: float | None = None
    while time.perf_counter() - killed_at < cap and (gone_s is None or tree_gone_s is None):
        tagged = _tagged(proc.pid)
        for p in tagged:
            seen.setdefault(p.pid, _cmd(p))
        now = time.perf_counter() - killed_at
        if gone_s is None and not tagged:
            gone_s = now
        if tree_gone_s is None and not [p for p in tree if _status(p) not in (None, "zombie")]:
            tree_gone_s = now
        time.sleep(0.02)
    left = [p for p in tree if _status(p) not in (None, "zombie")]
    leftovers = {p.pid: p for p in [*left, *_tagged(proc.pid), *_strays()]}
    left_cmds = [_cmd(p) for p in leftovers.values()]
    _kill(list(leftovers.values()))
    proc.stdout.close()
    return {
        "error": None,
        "gone_s": gone_s,
        "tree_gone_s": tree_gone_s,
        "reset_done_at_kill": reset_done,
        "kill_after_announce_s": since_reset,
        "server_forks_at_kill": forks_at_kill,
        "tagged_seen": len(seen),
        "tagged_cmds": sorted(seen.values()),
        "tree_at_kill": len(tree),
        "tree_cmds": tree_cmds,
        "killed_here": len(leftovers),
        "killed_here_cmds": left_cmds,
    }


# ---------------------------------------------------------------------------- statistics


def _median(values: Sequence[float | None]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def _fmt(value: float, digits: int = 2, unit: str = "") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}{unit}"


def _ok(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if not r.get("error")]


def _get(run: dict[str, Any], phase: str, key: str) -> Any:
    return run.get(phase, {}).get(key)


def _per_worker(run: dict[str, Any], phase: str = "cold") -> float:
    return _median(_get(run, phase, "worker_pss_mib") or [])


class Results:
    """Trials by (env, workers, config), and ratios paired by repeat."""

    def __init__(self, trials: list[dict[str, Any]]) -> None:
        self.trials = trials

    def runs(self, env: str, n: int, config: str) -> list[dict[str, Any]]:
        return [t for t in self.trials if (t["env"], t["workers"], t["config"]) == (env, n, config)]

    def runs_all(self, config: str) -> list[dict[str, Any]]:
        return [t for t in self.trials if t["config"] == config]

    def med(self, env: str, n: int, config: str, phase: str, key: str) -> float:
        return _median([_get(r, phase, key) for r in _ok(self.runs(env, n, config))])

    def pss(self, env: str, n: int, config: str) -> float:
        return _median([_per_worker(r) for r in _ok(self.runs(env, n, config))])

    def paired(self, env: str, n: int, num: str, den: str, value: Any) -> list[float]:
        """``value(num run) / value(den run)`` for each repeat in which both succeeded."""
        out = []
        for a in _ok(self.runs(env, n, num)):
            for b in _ok(self.runs(env, n, den)):
                if a["repeat"] == b["repeat"]:
                    x, y = value(a), value(b)
                    if x is not None and y and not math.isnan(x) and not math.isnan(y):
                        out.append(x / y)
        return out


def _phase(phase: str, key: str) -> Any:
    return lambda run: _get(run, phase, key)


def _ratio_text(pairs: Sequence[float], digits: int = 1) -> str:
    if not pairs:
        return "n/a"
    text = f"{_median(pairs):.{digits}f}x"
    if len(pairs) > 1:
        text += f" ({min(pairs):.{digits}f}-{max(pairs):.{digits}f})"
    return text


def _machine_lines(args: argparse.Namespace) -> list[str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return [
        f"Generated by `{args.command}` on {args.generated}; {args.elapsed / 60:.1f} min in all.",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({cpu}), {psutil.virtual_memory().total / 2**30:.1f} GiB "
        f"RAM, {platform.system()} {platform.release()}; Python {platform.python_version()}, "
        f"torch {_version('torch')}, torchrl {_version('torchrl')}, psutil {psutil.__version__}. "
        "A shared host: other jobs (another engineer's test runs) used the machine at the same time; "
        f"each trial waited (up to {args.quiet_wait:g} s) until they used under {args.max_external:g} "
        f"cores. Median load from other jobs just before a trial: {args.external_load:.2f} cores.",
        "",
        f"Code measured: {getattr(args, 'git', 'not recorded')} (at the start of the run; each trial "
        "imports torchrl_ext afresh, so edits made during the run reach the later trials).",
    ]


def build_markdown(res: Results, args: argparse.Namespace, chart: str) -> tuple[str, list[str]]:
    lines: list[str] = []
    add = lines.append
    add(f"# Start-up and close benchmark{' (--quick)' if args.quick else ''}")
    add("")
    lines.extend(_machine_lines(args))
    add("")
    add(
        f"Workers {args.workers}; {args.repeats} interleaved repeat(s) per cell, each trial a fresh "
        "interpreter that runs one configuration (the configuration order rotates per repeat). "
        f"Envs from `tests/envs.py`: **trivial** = `ToyEnv()`; **dataloader** = "
        '`ToyEnv(loader="persistent")`, whose first reset builds a `DataLoader(num_workers=2, '
        "persistent_workers=True)` (no `multiprocessing_context`) and whose episodes last 5 steps."
    )
    add("")
    add(
        "* **cold reset s**: from just before the env's constructor (torch, TorchRL and torchrl_ext "
        "already imported) to the first `reset()` returning, first env of the process. "
        f"**cold rollout s**: the same clock to the end of {args.steps} `step_and_maybe_reset` calls "
        "after it (the dataloader env resets, so draws from its loader, every 5 steps).\n"
        "* **warm reset s**: the same for a second env of the same configuration, built in the same "
        "process after the first was closed (for `managed default` the preloaded server is "
        "already running then).\n"
        "* **close s**: `close()` of the first env. **graceful**: trials in which every worker ended "
        'gracefully: managed, `env.supervision_report` lists every worker as `"graceful"`; '
        "upstream, every worker `Process.exitcode == 0` after `close()` (read from the "
        "`multiprocessing.Process` objects, which `close()` joins; 0 means the worker returned after "
        "the close message instead of being terminated or killed).\n"
        "* **exit s**: from the end of the trial (second env closed, plus the 1 s wait below) until "
        "the trial's interpreter and every helper holding its stderr (resource tracker, reaper, "
        "preloaded server) had exited, as seen by the parent.\n"
        "* **warn**: trials whose stderr (interpreter and its helpers, captured until they all "
        "exited) had a `resource_tracker` / `leaked` warning. **defunct**: zombie descendants of the "
        "trial's process 1 s after `close()` (sum over trials, cold and warm env). **other live**: "
        "live descendants 1 s after close that are not helpers (resource tracker, torchrl_ext "
        "reaper, preloaded server).\n"
        "* **PSS/worker MiB**: `psutil.Process(pid).memory_full_info().pss` of each worker after the "
        "first reset and rollout (median over workers; the DataLoader processes are not included). "
        "`managed default` also has the preloaded server (PSS given below the table); its pages are "
        "shared with the workers, and PSS splits them between all of them.\n"
        "* Cells are medians over the repeats; ratios are medians of ratios paired within a repeat "
        "(range in brackets when there is more than one repeat)."
    )
    add("")
    add(f"![first reset and PSS per configuration]({chart})")
    add("")
    add(
        "| env | workers | configuration | cold reset s | cold rollout s | warm reset s | warm rollout s "
        "| close s | exit s | graceful | warn | defunct | other live | PSS/worker MiB | errors |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    server_pss: list[float] = []
    for env in args.envs:
        for n in args.workers:
            for config in args.configs:
                runs = res.runs(env, n, config)
                ok = _ok(runs)
                graceful = sum(1 for r in ok if _get(r, "cold", "graceful") and _get(r, "warm", "graceful"))
                warn = sum(1 for r in ok if r.get("resource_tracker_warning"))
                defunct = sum(len(_get(r, p, "zombies_after_1s") or []) for r in ok for p in ("cold", "warm"))
                phases = ("cold", "warm")
                live = sum(len(_others(_get(r, p, "live_descendants_after_1s"))) for r in ok for p in phases)
                errors = len(runs) - len(ok)
                if config == "managed_default":
                    server_pss += [v for r in ok for v in (_get(r, "cold", "server_pss_mib") or [])]
                add(
                    f"| {env} | {n} | {CONFIG_BY_KEY[config].label} | "
                    f"{_fmt(res.med(env, n, config, 'cold', 'first_reset_s'))} | "
                    f"{_fmt(res.med(env, n, config, 'cold', 'first_rollout_s'))} | "
                    f"{_fmt(res.med(env, n, config, 'warm', 'first_reset_s'))} | "
                    f"{_fmt(res.med(env, n, config, 'warm', 'first_rollout_s'))} | "
                    f"{_fmt(res.med(env, n, config, 'cold', 'close_s'))} | "
                    f"{_fmt(_median([r.get('exit_s') for r in ok]))} | {graceful}/{len(ok)} | "
                    f"{warn} | {defunct} | {live} | {_fmt(res.pss(env, n, config), 0)} | "
                    f"{errors or ''} |"
                )
    add("")
    if server_pss:
        med = _median(server_pss)
        add(f"Preloaded server PSS (managed default, after the first reset): median {med:.0f} MiB.")
        add("")
    methods = sorted({str(_get(r, "cold", "start_method")) for r in _ok(res.runs_all("managed_default"))})
    add(f"`env.start_method` of the managed default envs: {methods}.")
    add("")
    add("## Ratios (paired within a repeat)")
    add("")
    add(
        "| env | workers | cold reset: upstream default / managed default | warm reset: upstream default / "
        "managed default | cold rollout: upstream default / managed default | warm reset: managed default / "
        "upstream fork | PSS/worker: managed default / upstream default | cold reset: managed default / "
        "upstream fork | cold reset: managed interpreter / managed default | PSS/worker: managed default / "
        "managed interpreter |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|")
    ud, md, uf, mi = "upstream_default", "managed_default", "upstream_fork", "managed_interpreter"
    for env in args.envs:
        for n in args.workers:
            add(
                f"| {env} | {n} | "
                f"{_ratio_text(res.paired(env, n, ud, md, _phase('cold', 'first_reset_s')))} | "
                f"{_ratio_text(res.paired(env, n, ud, md, _phase('warm', 'first_reset_s')))} | "
                f"{_ratio_text(res.paired(env, n, ud, md, _phase('cold', 'first_rollout_s')))} | "
                f"{_ratio_text(res.paired(env, n, md, uf, _phase('warm', 'first_reset_s')), 2)} | "
                f"{_ratio_text(res.paired(env, n, md, ud, _per_worker), 2)} | "
                f"{_ratio_text(res.paired(env, n, md, uf, _phase('cold', 'first_reset_s')), 2)} | "
                f"{_ratio_text(res.paired(env, n, mi, md, _phase('cold', 'first_reset_s')))} | "
                f"{_ratio_text(res.paired(env, n, md, mi, _per_worker), 2)} |"
            )
    add("")
    verdicts = _targets(res, args)
    add("## Targets")
    add("")
    add("| target | measured | met |")
    add("|---|---|---|")
    for text, measured, met in verdicts:
        add(f"| {text} | {measured} | {met} |")
    add("")
    lines.extend(_kill_section(args))
    lines.extend(_problems(res))
    return "\n".join(lines) + "\n", [f"{t}: {m} -> {v}" for t, m, v in verdicts]


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**NOT met**")


def _targets(res: Results, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    ud, md, uf, mi = "upstream_default", "managed_default", "upstream_fork", "managed_interpreter"
    out: list[tuple[str, str, str]] = []
    for env in args.envs:  # issue 47: the first env of a fork-safe program starts in a fork's time
        parts, fine, seen = [], True, False
        for n in args.workers:
            cold = res.med(env, n, md, "cold", "first_reset_s")
            if not math.isnan(cold):
                seen = True
                parts.append(f"{n}w {cold:.2f} s")
                fine = fine and cold <= 0.3
        kinds = sorted({str(_get(r, "cold", "server_kind")) for r in _ok(res.runs_all(md))})
        out.append(
            (
                f"cold first reset (build + reset), managed default, server a zygote, <= 0.3 s, {env}",
                f"{', '.join(parts) or 'not run'}; server kind {kinds}",
                _verdict(fine and kinds == ["zygote"] if seen else None),
            )
        )
        measured, met = _each_n(res, args, env, (md, mi), _per_worker, 1.05)
        out.append((f"PSS per worker, zygote <= interpreter server (5 % noise), {env}", measured, met))
    for n, goal in ((4, 4.0), (8, 8.0)):
        for env in args.envs:
            pairs = res.paired(env, n, ud, md, _phase("cold", "first_reset_s"))
            ok = None if not pairs else _median(pairs) >= goal
            out.append(
                (
                    f"cold first reset, managed default >= {goal:g}x faster than upstream default, "
                    f"{n} workers, {env}",
                    _ratio_text(pairs) if pairs else "not run" + (" (--quick)" if args.quick else ""),
                    _verdict(ok),
                )
            )
    for env in args.envs:
        measured, met = _each_n(res, args, env, (md, uf), _phase("warm", "first_reset_s"), 1.5)
        out.append((f"warm first reset, managed default within 1.5x of upstream fork, {env}", measured, met))
    pairs = res.paired("dataloader", 2, ud, md, _phase("cold", "first_rollout_s"))
    out.append(
        (
            "dataloader env, first finished rollout >= 4x faster than upstream default, 2 workers",
            _ratio_text(pairs),
            _verdict(None if not pairs else _median(pairs) >= 4.0),
        )
    )
    md_runs = _ok(res.runs_all(md))
    closes = [_get(r, p, "close_s") for r in md_runs for p in ("cold", "warm")]
    slow = [c for c in closes if c is not None and c > 1.0]
    ungraceful = [r for r in md_runs for p in ("cold", "warm") if not _get(r, p, "graceful")]
    warned = [r for r in md_runs if r.get("resource_tracker_warning")]
    defunct = sum(len(_get(r, p, "zombies_after_1s") or []) for r in md_runs for p in ("cold", "warm"))
    measured = (
        f"managed default, {len(closes)} closes: max {_fmt(max(closes) if closes else math.nan)} s "
        f"({len(slow)} over 1 s), {len(ungraceful)} not graceful, {len(warned)} trials warned at exit, "
        f"{defunct} defunct descendants"
    )
    ok = bool(md_runs) and not slow and not ungraceful and not warned and not defunct
    out.append(("close <= 1 s, graceful, no warning at exit, no defunct descendants", measured, _verdict(ok)))
    parts, fine, seen = [], True, False
    for env in args.envs:
        for n in args.workers:
            pairs = res.paired(env, n, md, ud, _per_worker)
            if pairs:
                seen = True
                parts.append(f"{env} {n}w {_median(pairs):.2f}x")
                fine = fine and _median(pairs) <= 0.7
    target = "PSS per worker, managed default <= 0.7x upstream default"
    out.append((target, ", ".join(parts), _verdict(fine if seen else None)))
    return out


def _each_n(
    res: Results, args: argparse.Namespace, env: str, configs: tuple[str, str], value: Any, bound: float
) -> tuple[str, str]:
    """The paired ratio ``configs[0] / configs[1]`` at each number of workers, and whether its
    median stays within ``bound`` at every one of them."""
    parts, fine = [], True
    for n in args.workers:
        pairs = res.paired(env, n, configs[0], configs[1], value)
        if pairs:
            parts.append(f"{n}w {_median(pairs):.2f}x")
            fine = fine and _median(pairs) <= bound
    return ", ".join(parts) or "not run", _verdict(fine if parts else None)


def _secs(value: float | None) -> str:
    return "never (capped)" if value is None else f"{value:.2f}"


def _kill_section(args: argparse.Namespace) -> list[str]:
    kills = args.kill_results
    if not kills:
        return []
    out = ["## SIGKILL while starting", ""]
    out.append(
        f"A fresh interpreter builds `ManagedParallelEnv({args.kill_workers}, ToyEnv, "
        "daemon_workers=False)` (preloaded path) and prints a line just before its first `reset()`. "
        "The parent then polls the victim's process tree and SIGKILLs the victim as soon as "
        f"{args.kill_workers} forks of the preloaded server (the workers) exist, or the reset has "
        f"returned, or {args.kill_delay:g} s have passed. From the kill on, it scans "
        "`psutil.process_iter()` every 20 ms for live processes whose environment has "
        "`TORCHRL_EXT_OWNER` starting with `<killed pid>:` (*tagged gone*), and separately watches "
        "every process that was below the victim at the kill, helpers included (*tree gone*); "
        f"both capped at {args.kill_cap:g} s. Forks made without exec (the workers, fork-context "
        "DataLoader workers) show the server's environment, which carries the tag. Whatever is "
        "left at the end is killed by this script (*killed here*)."
    )
    out.append("")
    out.append(
        "| env | trial | kill after 'resetting', ms | workers at kill | reset had returned | "
        "tagged gone, s | tree gone, s | tagged processes seen | processes below the victim | killed here |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for i, k in enumerate(kills):
        if k.get("error"):
            out.append(f"| {k['env']} | {i} | failed: {k['error']} |" + " |" * 7)
            continue
        out.append(
            f"| {k['env']} | {i} | {k['kill_after_announce_s'] * 1e3:.0f} | {k['server_forks_at_kill']} | "
            f"{'yes' if k['reset_done_at_kill'] else 'no'} | {_secs(k['gone_s'])} | "
            f"{_secs(k['tree_gone_s'])} | {k['tagged_seen']} | {k['tree_at_kill']} | {k['killed_here']} |"
        )
    out.append("")
    return out


def _problems(res: Results) -> list[str]:
    out = ["## Errors, warnings, non-graceful closes, leftovers", ""]
    found = False
    for t in res.trials:
        where = f"{t['env']} / {t['workers']} workers / {t['config']} / repeat {t['repeat']}"
        if t.get("error"):
            found = True
            tail = " | ".join(t.get("stderr_tail", []))[:400]
            out.append(f"* {where}: **error** {t['error']}; stderr tail: `{tail}`")
        for line in t.get("warning_lines", []):
            found = True
            out.append(f"* {where}: warning at exit: `{line[:300]}`")
        for phase in ("cold", "warm"):
            p = t.get(phase)
            if not p:
                continue
            if not p.get("graceful"):
                found = True
                out.append(
                    f"* {where} ({phase}): not graceful: outcomes {p.get('outcomes')}, "
                    f"exit codes {p.get('exitcodes')}"
                )
            if p.get("zombies_after_1s"):
                found = True
                out.append(f"* {where} ({phase}): defunct after 1 s: {p['zombies_after_1s']}")
            if _others(p.get("live_descendants_after_1s")):
                found = True
                out.append(f"* {where} ({phase}): live after 1 s: {p['live_descendants_after_1s']}")
        if t.get("strays_after_exit"):
            found = True
            strays = t["strays_after_exit"]
            out.append(f"* {where}: still running after the interpreter exited (killed): {strays}")
    if not found:
        out.append("None.")
    out.append("")
    return out


def _git_state() -> str:
    """The commit measured, and whether torchrl_ext/ had uncommitted changes at the start."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--shortstat", "HEAD", "--", "torchrl_ext"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"commit {head}" + (f", torchrl_ext/ with uncommitted changes ({diff})" if diff else "")


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__).split("+")[0]
    except Exception:
        return "?"


def make_chart(res: Results, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("cold", "first_reset_s", "cold: first reset, s"),
        ("warm", "first_reset_s", "warm: first reset, s"),
    )
    fig, axes = plt.subplots(len(args.envs), 3, figsize=(16, 4.6 * len(args.envs)), squeeze=False)
    width = 0.8 / len(args.configs)
    for row, env in enumerate(args.envs):
        for col in range(3):
            ax = axes[row][col]
            for i, config in enumerate(args.configs):
                xs, ys, lo, hi = [], [], [], []
                for g, n in enumerate(args.workers):
                    ok = _ok(res.runs(env, n, config))
                    if col < 2:
                        phase, key, _ = panels[col]
                        values = [v for v in (_get(r, phase, key) for r in ok) if v is not None]
                    else:
                        values = [v for v in (_per_worker(r) for r in ok) if not math.isnan(v)]
                    if not values:
                        continue
                    med = _median(values)
                    xs.append(g + (i - (len(args.configs) - 1) / 2) * width)
                    ys.append(med)
                    lo.append(med - min(values))
                    hi.append(max(values) - med)
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=CONFIG_BY_KEY[config].label)
            names = [f"{n} worker{'s' if n > 1 else ''}" for n in args.workers]
            ax.set_xticks(range(len(args.workers)), names)
            if col < 2:
                ax.set_yscale("log")
                ax.set_title(f"{env} env, {panels[col][2]} (log)")
            else:
                ax.set_title(f"{env} env, PSS per worker, MiB")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle(f"Start-up on {os.cpu_count()} cores (median, min-max bars; lower is better)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(res: Results, args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    chart = args.out.with_suffix(".png")
    make_chart(res, args, chart)
    markdown, verdicts = build_markdown(res, args, chart.name)
    args.out.write_text(markdown)
    raw = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "render"},
        "trials": res.trials,
    }
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(markdown)
    for verdict in verdicts:
        print("TARGET", verdict)
    print(f"wrote {args.out}, {chart} and {args.out.with_suffix('.json')}")


def render(path: Path) -> int:
    """Rebuild the report of an earlier run from its JSON (after changing the report code)."""
    raw = json.loads(path.read_text())
    args = argparse.Namespace(**raw["args"])
    args.out = Path(args.out)
    write_report(Results(raw["trials"]), args)
    return 0


def _csv(kind: type, text: str) -> list[Any]:
    return [kind(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=functools.partial(_csv, int), default=None, help="e.g. 1,2,4,8")
    p.add_argument("--envs", type=functools.partial(_csv, str), default=None, help="trivial,dataloader")
    p.add_argument("--configs", type=functools.partial(_csv, str), default=None, help="subset of configs")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats per cell")
    p.add_argument("--steps", type=int, default=20, help="steps of the first rollout")
    p.add_argument("--kill-repeats", type=int, default=None, help="SIGKILL trials per env (0: skip)")
    p.add_argument("--kill-workers", type=int, default=4)
    p.add_argument(
        "--kill-delay",
        type=float,
        default=5.0,
        help="at most this many seconds between 'resetting' and SIGKILL",
    )
    p.add_argument("--kill-cap", type=float, default=30.0, help="seconds to wait for the killed tree")
    p.add_argument("--max-external", type=float, default=0.3, help="cores other jobs may use before a trial")
    p.add_argument("--quiet-wait", type=float, default=8.0, help="seconds to wait for them at most")
    p.add_argument("--quick", action="store_true", help="workers 2,4 and one repeat")
    p.add_argument("--out", type=Path, default=None, help="markdown output (default: benchmarks/results/)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render", type=Path, help="only rebuild the report from this results JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--victim", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workers = args.workers or ([2, 4] if args.quick else [1, 2, 4, 8])
    args.envs = args.envs or list(ENVS)
    args.configs = args.configs or [c.key for c in CONFIGS]
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.kill_repeats is None:
        args.kill_repeats = 1 if args.quick else 3
    unknown = [c for c in args.configs if c not in CONFIG_BY_KEY] + [e for e in args.envs if e not in ENVS]
    if unknown:
        p.error(f"unknown {unknown}; configs {list(CONFIG_BY_KEY)}, envs {list(ENVS)}")
    if args.out is None:
        args.out = RESULTS / ("startup_quick.md" if args.quick else "startup.md")
    return args


def _schedule(args: argparse.Namespace) -> Iterator[tuple[int, str, int, str]]:
    return interleaved(args.repeats, args.envs, args.workers, args.configs)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        try:
            result = run_child(json.loads(args.child))
        except BaseException as err:  # reported to the parent, which counts the trial as failed
            tail = traceback.format_exc().strip().splitlines()[-3:]
            result = {"error": f"{type(err).__name__}: {err}"[:300], "traceback": tail}
        print(MARK + json.dumps(result), flush=True)
        return 0
    if args.victim:
        run_victim(json.loads(args.victim))
        return 0
    if args.render:
        return render(args.render)

    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    started = time.perf_counter()
    args.git = _git_state()
    schedule = list(_schedule(args))
    kills = [(env, r) for r in range(args.kill_repeats) for env in args.envs]
    trials: list[dict[str, Any]] = []
    loads: list[float] = []
    bar = tqdm(total=len(schedule) + len(kills), desc="startup", unit="trial", disable=args.no_progress)
    kill_results: list[dict[str, Any]] = []
    try:
        for repeat, env, n, config in schedule:
            bar.set_postfix_str(f"r{repeat} {env} {n}w {config}")
            loads.append(wait_for_quiet(args.max_external, max_wait=args.quiet_wait))
            spec = {"config": config, "env": env, "workers": n, "steps": args.steps}
            result = run_trial(spec, timeout=120.0 + 60.0 * n)
            result.update(repeat=repeat, env=env, workers=n, config=config, external_load=loads[-1])
            trials.append(result)
            if result.get("error"):
                tqdm.write(f"{env} {n}w {config} r{repeat}: {result['error']}")
            bar.update()
        for env, r in kills:
            bar.set_postfix_str(f"SIGKILL {env} r{r}")
            wait_for_quiet(args.max_external, max_wait=args.quiet_wait)
            kill = run_kill_trial(env, args.kill_workers, args.kill_delay, args.kill_cap)
            kill.update(env=env, repeat=r)
            kill_results.append(kill)
            bar.update()
    finally:
        bar.close()
        strays = _strays()
        _kill(strays)
    args.kill_results = kill_results
    args.final_strays = len(strays)
    args.external_load = _median(loads)
    args.command = " ".join(["python benchmarks/startup.py", *(sys.argv[1:] if argv is None else argv)])
    args.generated = time.strftime("%Y-%m-%d %H:%M")
    args.elapsed = time.perf_counter() - started
    write_report(Results(trials), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
