"""Operational statistics of one ManagedParallelEnv, in TorchRL's ``stats()`` convention.

A cheap, flat mapping of scalars, safe to call from any thread while the env runs, which
``torchrl.record.loggers.monitoring.LoggerMonitor`` polls and logs (see docs/watching.md).
Where each number comes from::

    env calling thread ──► CallStats: steps, worker resets (EpisodeEnds reads those inside
                           step_and_maybe_reset), latency windows, the wait for the workers
                           (plain counters: one writer, no lock, nothing on the hot path but
                           two clock reads, an append and a look at the step's done bytes)
    supervisor thread  ──► TreeSampler.maybe_sample(): each worker's tree (the worker and all
                           its descendants) at most once per SAMPLE_INTERVAL: RSS, descendants,
                           open fds; USS and PSS (costly: smaps_rollup) at most once per
                           PSS_INTERVAL, and only while someone reads stats(); with
                           recycle_memory, USS also of each tree whose RSS is over it, at
                           most WATCH_SHARE of the thread's time
                           LossCounts: deaths, hangs and env errors seen
    SlotKeeper         ──► env.restarts: restarts by cause, time of the last one
    stats() (any thread) ──► snapshot(): reads all of the above, takes no lock of theirs

Every field below states who writes it; readers in other threads only ever see a whole value
(a counter, or a dict replaced as a whole).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from tensordict import TensorDict

from . import _platform
from ._compat import Upstream
from ._errors import WorkerDiedError
from ._marks import RESTARTED_KEY
from ._record import TreeSample, WorkerRecord, sample_tree
from ._status import publish

__all__ = [
    "PSS_INTERVAL",
    "SAMPLE_INTERVAL",
    "WATCH_SHARE",
    "WINDOW",
    "EnvStats",
    "StatsView",
    "snapshot",
    "stats_view",
]

#: Calls kept in each latency window (p50, p95 and max are over the last ``WINDOW`` calls).
WINDOW = 1024
#: Seconds between two memory samples of the workers' trees (RSS, descendants, fds).
SAMPLE_INTERVAL = 1.0
#: Seconds between two USS and PSS samples of every tree (reading ``/proc/PID/smaps_rollup``
#: costs about 10 ms for a process with torch loaded); sampled only while ``stats()`` was read
#: within ``PSS_INTERVAL * 6`` seconds.
PSS_INTERVAL = 10.0
#: With ``recycle_memory``, the share of its time a thread may spend reading the USS of the
#: trees whose RSS is over it: after reads that took ``t`` seconds, the supervisor's next ones
#: wait ``max(SAMPLE_INTERVAL, t / WATCH_SHARE)``; the recycler's at a boundary, which refresh
#: its estimates (NOTE [unique memory] in ``_recycle``), ``t x workers / WATCH_SHARE``.
WATCH_SHARE = 0.05


class LatencyWindow:
    """The durations of the last ``size`` calls, in seconds (one writer thread)."""

    __slots__ = ("_values",)

    def __init__(self, size: int = WINDOW) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def last(self) -> float | None:
        """The latest duration (``None`` before the first call)."""
        try:
            return self._values[-1]
        except IndexError:
            return None

    def summary(self, name: str) -> dict[str, float]:
        """``{name}_ms_p50``, ``_p95`` and ``_max`` (NaN before the first call)."""
        values = sorted(self._values.copy())  # deque.copy() is atomic under the GIL
        if not values:
            nan = float("nan")
            return {f"{name}_ms_p50": nan, f"{name}_ms_p95": nan, f"{name}_ms_max": nan}
        return {
            f"{name}_ms_p50": 1e3 * _quantile(values, 0.50),
            f"{name}_ms_p95": 1e3 * _quantile(values, 0.95),
            f"{name}_ms_max": 1e3 * values[-1],
        }

    def clear(self) -> None:
        self._values.clear()


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` (linear interpolation, as numpy's default).

    Example:
        >>> _quantile([1.0, 2.0, 3.0, 4.0], 0.5)
        2.5
    """
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


#: The kinds of measured call (:attr:`CallStats.in_flight`).
STEP, RESET, STEP_AND_MAYBE_RESET = "step", "reset", "step_and_maybe_reset"


@dataclass
class CallStats:
    """What the env's calling thread measures (it alone writes these fields; a reader's
    ``stats(reset=True)`` clears the counters and windows).

    A batched call counts once whatever the number of workers; a worker reset counts once per
    worker that reset, wherever it happened.
    """

    #: Batched step calls: ``step`` and ``step_and_maybe_reset``.
    steps: int = 0
    #: The ``step_and_maybe_reset`` calls in which at least one worker reset.
    boundary_steps: int = 0
    #: Worker resets: each worker a reset call asked to reset, and each worker whose transition
    #: in a ``step_and_maybe_reset`` says it reset (:class:`EpisodeEnds`).
    resets: int = 0
    #: Batched reset calls (``reset``, full or partial); a reset inside ``step_and_maybe_reset``
    #: is part of that step.
    reset_calls: int = 0
    #: ``resets`` by the owner's worker slot (written by :meth:`end`; readers use ``.get``).
    slot_resets: dict[int, int] = field(default_factory=dict)
    #: Seconds the main process spent waiting for its workers' answers.
    wait_s: float = 0.0
    #: Every step call; the boundary steps among them; every reset call.
    step_latency: LatencyWindow = field(default_factory=LatencyWindow)
    boundary_latency: LatencyWindow = field(default_factory=LatencyWindow)
    reset_latency: LatencyWindow = field(default_factory=LatencyWindow)
    #: The kind of the measured call in flight (``None`` between calls; set and cleared by
    #: the env around TorchRL's call): what TorchRL calls inside it is part of it.
    in_flight: str | None = None
    #: The slots the reset call in flight asked to reset (written by the env's wait).
    asked: Sequence[int] = ()
    #: Which rows of this env's transitions ended their episode; made at the first
    #: ``step_and_maybe_reset`` of each start (from the env's done spec), dropped at close.
    ends: EpisodeEnds | None = None

    def begin(self, kind: str) -> None:
        self.in_flight, self.asked = kind, ()

    def end(self, kind: str, seconds: float, reset_slots: Sequence[int] = ()) -> None:
        """A call of ``kind`` returned after ``seconds``; a step's ``reset_slots`` reset in it
        (a reset call's are those it asked)."""
        if kind == RESET:
            self.reset_calls += 1
            self.reset_latency.add(seconds)
            reset_slots = self.asked
        else:
            self.steps += 1
            self.step_latency.add(seconds)
            if not reset_slots:
                return
            self.boundary_steps += 1
            self.boundary_latency.add(seconds)
        self.resets += len(reset_slots)
        counts = self.slot_resets
        for slot in reset_slots:
            counts[slot] = counts.get(slot, 0) + 1

    def clear(self) -> None:
        self.steps = self.boundary_steps = self.resets = self.reset_calls = 0
        self.slot_resets = {}
        self.wait_s = 0.0
        self.step_latency.clear()
        self.boundary_latency.clear()
        self.reset_latency.clear()


class EpisodeEnds:
    """Which workers reset inside one ``step_and_maybe_reset``, read from its transition.

    A worker resets its env there when the env's ``any_done`` says so (TorchRL's rule, here
    per row): with a root ``done`` and ``terminated`` in the done spec, ``("next", "done")``
    alone; else any done entry. A restarted slot's marked transition (``worker_restarted``)
    is done too, but no episode ended there: its new worker's reset belongs to the restart.

    The hot path only looks for a set byte: in the owner's stacked shared buffer, where the
    workers wrote the transition (its done entries kept as numpy views while the buffer lives),
    else in the transition itself. The rows are read from the transition only when one is set.
    """

    __slots__ = ("_buffer", "_shared", "keys")

    def __init__(self, env: Any) -> None:
        names = set(env.full_done_spec.keys())
        simple = "done" in names and "terminated" in names
        #: The entries read, under ``"next"`` (one tuple each: one lookup).
        self.keys: tuple[tuple[str, ...], ...] = tuple(
            ("next", *((key,) if isinstance(key, str) else key))
            for key in (["done"] if simple else env.done_keys)
        )
        #: The shared buffer ``_shared`` views (``None`` before the first look).
        self._buffer: Any = None
        #: Numpy views of ``_buffer``'s done entries (``None``: not a dense CPU buffer of
        #: bools, as a view's or one without buffers; the transition is read instead).
        self._shared: list[Any] | None = None

    def rows(self, env: Any, transition: Any, given: Any) -> list[int]:
        """The rows of ``transition`` (the output of ``env``'s step) whose episode ended,
        among those ``given`` (the step's input) asked to step (its ``"_step"`` mask)."""
        if not self._any_set(env, transition):
            return []
        ended = None
        for key in self.keys:
            value = transition.get(key, None)
            if value is not None:
                rows = value.cpu().reshape(value.shape[0], -1).any(-1)
                ended = rows if ended is None else ended | rows
        if ended is None:
            return []
        restarted = transition.get(("next", RESTARTED_KEY), None)
        if restarted is not None:
            ended &= ~restarted.cpu().reshape(ended.shape[0], -1).any(-1)
        stepped = given.get("_step", None)
        if stepped is not None:
            ended &= stepped.cpu().reshape(ended.shape[0], -1).any(-1)
        return [int(i) for i in ended.nonzero().flatten().tolist()]

    def _any_set(self, env: Any, transition: Any) -> bool:
        """Whether a done entry may be set (always True when one is; a row a partial step
        skipped may keep an old one in the shared buffer)."""
        buffer = Upstream(env).parent_buffer
        if buffer is not self._buffer:
            self._buffer, self._shared = buffer, self._views(buffer)
        if self._shared is not None:
            for flags in self._shared:  # noqa: SIM110 - a generator costs more, per step
                if b"\x01" in flags.tobytes():
                    return True
            return False
        for key in self.keys:
            try:
                value = transition.get(key)  # without a default: half the cost of one
            except KeyError:
                continue
            if value.any():
                return True
        return False

    def _views(self, buffer: Any) -> list[Any] | None:
        if type(buffer) is not TensorDict:  # absent (no buffers), or a view's lazy stack
            return None
        views = []
        for key in self.keys:
            value = buffer.get(key, None)
            if value is None or not (value.is_cpu and value.dtype is torch.bool and value.is_contiguous()):
                return None
            views.append(value.numpy())
        return views


@dataclass
class LossCounts:
    """Losses the supervisor's watcher saw (it alone writes these), over the env's life."""

    deaths: int = 0
    hangs: int = 0
    #: Workers that exited with an exception of their env.
    env_errors: int = 0

    def count(self, hung: bool, failure: BaseException) -> None:
        """One more loss: a hang, a death, or an exception of the env."""
        if hung:
            self.hangs += 1
        elif isinstance(failure, WorkerDiedError):
            self.deaths += 1
        else:
            self.env_errors += 1


class TreeSampler:
    """The last sample of each slot's tree; written by the supervisor's thread only.

    ``samples`` is replaced as a whole at each sample (readers never see it change), keyed
    by slot; a slot whose worker was lost keeps its last sample until its replacement's.
    A worker's first sample reads its USS and PSS (``smaps_rollup``); a later sample that does
    not keeps the last ones.
    """

    def __init__(self) -> None:
        self.samples: dict[int, TreeSample] = {}
        self._next = 0.0
        self._next_pss = 0.0
        self._next_watch = 0.0
        #: ``time.monotonic()`` of the last ``stats()`` read (written by readers).
        self.read_at = -math.inf
        #: ``recycle_memory`` (written by the recycler): a tree whose RSS is over it may be
        #: over it in USS too, so its USS is read at each sample (within ``WATCH_SHARE``).
        self.unique_over: int | None = None

    def rss_of(self, worker: WorkerRecord) -> int | None:
        """The last sampled RSS of ``worker``'s tree (``None``: never sampled)."""
        sample = self.samples.get(worker.index)
        return sample.rss if sample is not None and sample.pid == worker.pid else None

    def maybe_sample(self, workers: Iterable[WorkerRecord]) -> bool:
        """Sample the tree of each of ``workers`` (live ones) if due; whether it did."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + SAMPLE_INTERVAL
        first = not self.samples
        every = now >= self._next_pss and (first or now - self.read_at < 6 * PSS_INTERVAL)
        if every:
            self._next_pss = now + PSS_INTERVAL
        over = self.unique_over
        watch = over is not None and not every and now >= self._next_watch and _platform.has_smaps_rollup()
        spent = 0.0
        samples = dict(self.samples)
        this_round: dict[int, TreeSample] = {}  # by pid: a host's slots share its tree (_hosts)
        for worker in workers:
            slot, pid = worker.index, worker.pid
            if pid in this_round:
                samples[slot] = this_round[pid]
                continue
            previous = samples.get(slot)
            if previous is not None and previous.pid != pid:
                previous = None  # a new worker: its USS and PSS are read now
            sample = sample_tree(
                pid, worker.create_time, worker.descendants.values(), every or previous is None
            )
            if sample is None:
                continue
            if watch and over is not None and sample.uss is None and sample.rss > over:  # USS <= RSS
                t0 = time.perf_counter()
                sample = sample_tree(pid, worker.create_time, worker.descendants.values(), True) or sample
                spent += time.perf_counter() - t0
            if sample.uss is None and previous is not None:
                sample = dataclasses.replace(sample, pss=previous.pss, uss=previous.uss)  # they stand
            samples[slot] = this_round[pid] = sample
        if watch:
            self._next_watch = now + max(SAMPLE_INTERVAL, spent / WATCH_SHARE)
        self.samples = samples
        return True


@dataclass
class EnvStats:
    """Everything ``stats()`` reads that is not already the env's (``env.restarts``): lives as
    long as the env, across its starts; each part says who writes it."""

    calls: CallStats = field(default_factory=CallStats)
    losses: LossCounts = field(default_factory=LossCounts)
    sampler: TreeSampler = field(default_factory=TreeSampler)
    #: Serializes ``stats(reset=True)`` callers (the calling thread's counters are read, then
    #: cleared, by one reader at a time).
    reading: threading.Lock = field(default_factory=threading.Lock)
    #: The slot keeper's records (append-only; the same list, set with the keeper).
    restarts: list[Any] = field(default_factory=list)
    #: Set by each start's supervisor (:meth:`bind`): its label, and where ``python -m
    #: torchrl_ext status`` reads this env (in the start's report directory).
    label: str = ""
    status_path: str | None = None
    #: The preloaded server the last start forked its workers from: ``"zygote"`` or
    #: ``"interpreter"`` (``None``: no server), and why not a zygote; set by each start.
    server_kind: str | None = None
    server_fallback: str | None = None

    def server_text(self) -> str | None:
        """The server as ``status`` shows it (``"interpreter (<why>)"``), if any."""
        if self.server_kind is None or self.server_fallback is None:
            return self.server_kind
        return f"{self.server_kind} ({self.server_fallback})"

    def bind(self, label: str, status_path: str) -> None:
        self.label, self.status_path = label, status_path

    def observe(self, workers: Sequence[WorkerRecord], owner: tuple[int, float]) -> None:
        """From the supervisor's thread: sample the live ``workers``' trees if due, and then
        publish the env's status for ``python -m torchrl_ext status`` (``_status``)."""
        if not self.sampler.maybe_sample(workers) or self.status_path is None:
            return
        restarts = list(self.restarts)
        rows = [
            (w.index, w.pid, w.create_time, sum(r.slot == w.index and not r.recycled for r in restarts))
            for w in workers
        ]
        last = self.calls.step_latency.last()
        last_ms = None if last is None else 1e3 * last
        publish(self.status_path, self.label, owner, rows, last_ms, server=self.server_text())


#: What ``stats(workers=...)`` returns, named as TorchRL's multi-process collectors name it:
#: ``"aggregate"`` the env's keys, ``"per_worker"`` the slots' keys (``worker_<i>/<metric>``)
#: instead, ``"both"`` the union; ``workers`` and ``workers_alive`` are in every view.
StatsView = Literal["aggregate", "per_worker", "both"]
_VIEWS: tuple[StatsView, ...] = get_args(StatsView)


def stats_view(workers: object) -> StatsView:
    """``stats()``'s ``workers`` argument as a view. A bool (this library's former spelling)
    still works, with a ``DeprecationWarning`` naming its replacement (``True``: ``"both"``,
    ``False``: ``"aggregate"``), attributed to the caller of ``stats()``; anything else that is
    not a view raises ``ValueError``.

    Example:
        >>> stats_view("per_worker")
        'per_worker'
        >>> stats_view("all")
        Traceback (most recent call last):
        ...
        ValueError: workers must be one of 'aggregate', 'per_worker' or 'both', got 'all' (str)
    """
    if isinstance(workers, bool):
        view: StatsView = "both" if workers else "aggregate"
        warnings.warn(
            f"stats(workers={workers}) is deprecated: pass workers={view!r}, as for TorchRL's "
            f"collectors (a bool will be refused in a future release)",
            DeprecationWarning,
            stacklevel=3,  # the caller of ManagedParallelEnv.stats()
        )
        return view
    for view in _VIEWS:
        if isinstance(workers, str) and workers == view:
            return view
    raise ValueError(
        f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r} "
        f"({type(workers).__name__})"
    )


#: Restart causes counted as hangs: no answer within ``step_timeout`` or ``start_timeout``.
_HANGS = ("hung", "start_timeout")


def snapshot(
    stats: EnvStats,
    *,
    num_workers: int,
    alive: Sequence[bool],
    restarts: Sequence[Any],
    view: StatsView,
    reset: bool,
) -> dict[str, float | int]:
    """The flat mapping ``ManagedParallelEnv.stats()`` returns (see its docstring): ``workers``
    and ``workers_alive``, then the env's keys (``view`` ``"aggregate"`` or ``"both"``) and the
    slots' keys (``"per_worker"`` or ``"both"``)."""
    with stats.reading:
        stats.sampler.read_at = time.monotonic()
        calls = stats.calls
        lost = [r for r in restarts if not r.recycled]
        samples = {slot: s for slot, s in stats.sampler.samples.items() if slot < len(alive) and alive[slot]}
        out: dict[str, float | int] = {"workers": num_workers, "workers_alive": sum(alive)}
        if stats.server_kind is not None:  # 1: forks of a zygote; 0: of a new interpreter
            out["server_zygote"] = int(stats.server_kind == "zygote")
        if view != "per_worker":
            out.update(_aggregate(stats, restarts, lost, samples))
        if view != "aggregate":
            for slot in range(num_workers):
                sample = samples.get(slot)
                prefix = f"worker_{slot}/"
                out[prefix + "alive"] = int(slot < len(alive) and alive[slot])
                out[prefix + "resets"] = calls.slot_resets.get(slot, 0)
                out[prefix + "restarts"] = sum(r.slot == slot for r in lost)
                out[prefix + "recycles"] = sum(r.slot == slot for r in restarts) - out[prefix + "restarts"]
                if sample is not None:
                    out[prefix + "pid"] = sample.pid
                    out[prefix + "rss_bytes"] = sample.rss
                    out[prefix + "pss_bytes"] = float("nan") if sample.pss is None else sample.pss
                    out[prefix + "uss_bytes"] = float("nan") if sample.uss is None else sample.uss
                    out[prefix + "descendants"] = sample.descendants
                    out[prefix + "fds"] = sample.fds
        if reset:
            calls.clear()
    return out


def _aggregate(
    stats: EnvStats, restarts: Sequence[Any], lost: Sequence[Any], samples: dict[int, TreeSample]
) -> dict[str, float | int]:
    """The env's keys: the calls, losses and restarts, and the sums over the live trees (a
    host's tree once, however many of its slots are live: ``_hosts``)."""
    calls, losses = stats.calls, stats.losses
    trees = list({sample.pid: sample for sample in samples.values()}.values())
    return {
        "steps": calls.steps,
        "boundary_steps": calls.boundary_steps,
        "resets": calls.resets,
        "reset_calls": calls.reset_calls,
        "wait_s": calls.wait_s,
        **calls.step_latency.summary("step"),
        **calls.boundary_latency.summary("boundary"),
        **calls.reset_latency.summary("reset"),
        "restarts": len(lost),
        "restarts_died": sum(isinstance(r.cause, int) for r in lost),
        "restarts_hung": sum(r.cause in _HANGS for r in lost),
        "restarts_error": sum(isinstance(r.cause, str) and r.cause not in _HANGS for r in lost),
        "recycles": len(restarts) - len(lost),
        "recycles_memory": sum(r.cause == "memory" for r in restarts),
        "recycles_episodes": sum(r.cause == "episodes" for r in restarts),
        "deaths": losses.deaths,
        "hangs": losses.hangs,
        "env_errors": losses.env_errors,
        "seconds_since_restart": time.time() - lost[-1].time if lost else float("nan"),
        "tree_rss_bytes": sum(s.rss for s in trees),
        "tree_pss_bytes": _total(s.pss for s in trees),
        "tree_uss_bytes": _total(s.uss for s in trees),
        "descendants": sum(s.descendants for s in trees),
        "fds": sum(s.fds for s in trees),
    }


def _total(values: Iterable[int | None]) -> float | int:
    """The sum of ``values``; NaN if there are none or one is unknown."""
    known = list(values)
    return sum(v for v in known if v is not None) if known and None not in known else float("nan")
