"""``python -m torchrl_ext status``: every managed env on this machine, as ``ps`` lists processes.

Data flow::

    open env: supervisor thread, at each tree sample (``_stats``, at most once a second)
        └─► publish(): status.json in the start's report directory, replaced atomically
            ($TMPDIR/torchrl_ext-<owner pid>-*/reports-*/status.json; removed with the
            directory when the env closes, or by the reaper when the owner dies)
    python -m torchrl_ext status
        └─► read_envs(): every status.json whose owner still runs (pid and create time), plus
            what /proc says now of each worker: state, CPU %, tree RSS and USS, children

A published file holds the env's label, its owner, and per slot the worker's pid, create time
and restarts, and the env's last step latency; nothing in it is needed for the env to run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from . import _identity, _platform

__all__ = ["EnvStatus", "WorkerStatus", "format_table", "publish", "read_envs"]

STATUS_NAME = "status.json"


def publish(
    path: str,
    label: str,
    owner: tuple[int, float],
    workers: Sequence[tuple[int, int, float, int]],
    last_step_ms: float | None,
    server: str | None = None,
) -> None:
    """Write ``path`` (atomically): ``workers`` are ``(slot, pid, create_time, restarts)``;
    ``server`` is the preloaded server's kind (and why not a zygote), if the env uses one."""
    data = {
        "label": label,
        "owner_pid": owner[0],
        "owner_create_time": owner[1],
        "workers": [list(w) for w in workers],
        "last_step_ms": last_step_ms,
        "updated": time.time(),
        "server": server,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as ``status`` shows it."""

    slot: int
    pid: int
    #: psutil's status (``"running"``, ``"sleeping"``, ``"zombie"``...), ``"gone"`` if it exited.
    state: str
    cpu_percent: float | None
    #: Its tree's resident memory, each process in full (shared pages once per process).
    tree_rss: int | None
    #: Its tree's unique memory: per process, the pages no other process maps, summed (what
    #: ``recycle_memory`` counts); ``None`` where ``smaps_rollup`` cannot be read.
    tree_uss: int | None
    children: int
    restarts: int


@dataclass(frozen=True)
class EnvStatus:
    """One open managed env as ``status`` shows it."""

    label: str
    owner_pid: int
    command: str
    last_step_ms: float | None
    #: Seconds since the env last published (about 1 s while it runs).
    age_s: float
    workers: tuple[WorkerStatus, ...]
    #: The preloaded server the workers are forks of: ``"zygote"``, ``"interpreter (<why>)"``,
    #: or ``None`` (no server).
    server: str | None = None


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_envs(base: str | None = None, cpu_interval: float = 0.2) -> list[EnvStatus]:
    """Every managed env whose owner runs, from the status files under ``base`` (default: the
    temporary directory); CPU % is measured over ``cpu_interval`` seconds."""
    found = []
    for path in sorted(
        glob.glob(os.path.join(base or tempfile.gettempdir(), "torchrl_ext-*", "reports-*", STATUS_NAME))
    ):
        data = _load(path)
        if data is None:
            continue
        owner = _identity.same_process(int(data["owner_pid"]), float(data["owner_create_time"]))
        if owner is None:
            continue  # a dead owner's leftovers are `sweep`'s business
        procs = {}
        for slot, pid, ctime, _restarts in data["workers"]:
            proc = _identity.same_process(int(pid), float(ctime))
            tree = [] if proc is None else [proc, *_identity.descendants(proc.pid)]
            for member in tree:
                with contextlib.suppress(psutil.Error):
                    member.cpu_percent(None)  # primes the measurement
            procs[int(slot)] = tree
        found.append((data, owner, procs))
    if found and cpu_interval > 0:
        time.sleep(cpu_interval)
    envs = []
    for data, owner, procs in found:
        try:
            command = " ".join(owner.cmdline())
        except psutil.Error:
            command = "?"
        workers = []
        for slot, pid, _ctime, restarts in data["workers"]:
            tree = procs.get(int(slot), [])
            workers.append(_worker_status(int(slot), int(pid), tree, int(restarts)))
        envs.append(
            EnvStatus(
                label=str(data["label"]),
                owner_pid=owner.pid,
                command=command,
                last_step_ms=data.get("last_step_ms"),
                age_s=max(0.0, time.time() - float(data["updated"])),
                workers=tuple(workers),
                server=data.get("server"),
            )
        )
    return envs


def _worker_status(slot: int, pid: int, tree: list[psutil.Process], restarts: int) -> WorkerStatus:
    state, cpu, rss, uss = "gone", None, None, None
    if tree:
        try:
            state = tree[0].status()
        except psutil.Error:
            tree = []
    if tree:
        cpu, rss, unique = 0.0, 0, 0
        smaps = _platform.has_smaps_rollup()
        for member in tree:
            with contextlib.suppress(psutil.Error):
                cpu += member.cpu_percent(None)
                memory = _platform.process_memory(member.pid) if smaps else None
                if memory is not None:
                    rss, unique = rss + memory.rss, unique + memory.uss
                else:  # no smaps_rollup, or it ended (its RSS read fails too, then)
                    rss += member.memory_info().rss
        uss = unique if smaps else None
    return WorkerStatus(slot, pid, state, cpu, rss, uss, max(0, len(tree) - 1), restarts)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f} MiB"


def format_table(envs: Sequence[EnvStatus]) -> str:
    """A plain table, one line per worker, as ``ps`` prints processes."""
    if not envs:
        return "no managed envs running\n"
    header = (
        "OWNER",
        "ENV",
        "SLOT",
        "PID",
        "STATE",
        "CPU%",
        "TREE RSS",
        "TREE USS",
        "CHILDREN",
        "RESTARTS",
        "LAST STEP",
    )
    rows = [header]
    for env in envs:
        step = "-" if env.last_step_ms is None else f"{env.last_step_ms:.1f} ms"
        for w in env.workers:
            cpu = "-" if w.cpu_percent is None else f"{w.cpu_percent:.0f}"
            rows.append(
                (
                    str(env.owner_pid),
                    env.label,
                    str(w.slot),
                    str(w.pid),
                    w.state,
                    cpu,
                    _mib(w.tree_rss),
                    _mib(w.tree_uss),
                    str(w.children),
                    str(w.restarts),
                    step,
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    commands = [
        f"{env.owner_pid}: {env.command}" + ("" if env.server is None else f"  [fork server: {env.server}]")
        for env in envs
    ]
    return "\n".join([*lines, "", "owners:", *dict.fromkeys(commands)]) + "\n"


def as_json(envs: Sequence[EnvStatus]) -> str:
    return json.dumps([asdict(env) for env in envs], indent=1) + "\n"
