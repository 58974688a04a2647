"""Tests for torchrl_ext.data: episode loader, sampler, thread prefetcher, memmap conversion."""

from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import Dataset
from torch.utils.data._utils import signal_handling

from tests.polling import wait_until
from torchrl_ext.data import (
    EpisodeLoader,
    EpisodeSampler,
    MemmapEpisodeDataset,
    ThreadPrefetcher,
    memmap_episodes,
)
from torchrl_ext.data._episode_loader import DEFAULT_WORKER_NICE

pytestmark = pytest.mark.compat

N_EPISODES = 6
T_STEPS = 5
# Importing torchrl switches the global start method to "spawn"; fork keeps worker start-up cheap.
FORK = "fork"


class Episodes(Dataset[TensorDict]):
    """Tiny synthetic episodes; episode ``i`` is filled with ``i`` so content can be checked."""

    def __init__(self, n: int = N_EPISODES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> TensorDict:
        return TensorDict(
            {"idx": torch.full((T_STEPS,), i), "obs": torch.full((T_STEPS, 8), float(i))},
            batch_size=[T_STEPS],
        )


def _idx(episode: Any) -> int:
    i = int(episode["idx"][0])
    assert torch.equal(episode["obs"], torch.full((T_STEPS, 8), float(i)))
    return i


def _stream(seed: int, count: int, n: int = N_EPISODES, shuffle: bool = True) -> list[int]:
    return list(itertools.islice(iter(EpisodeSampler(n, shuffle=shuffle, seed=seed)), count))


def _assert_epochs(order: list[int], n: int = N_EPISODES) -> None:
    assert len(order) % n == 0
    for start in range(0, len(order), n):
        assert sorted(order[start : start + n]) == list(range(n)), order


def _children() -> set[int]:
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        pids.add(proc.pid)
    return pids


@contextmanager
def _capture(name: str = "torchrl_ext") -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Handler(logging.DEBUG)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# --------------------------------------------------------------------------------- sampler
def test_sampler_epochs_seeds_and_shuffle() -> None:
    order = _stream(0, 5 * N_EPISODES)
    _assert_epochs(order)
    assert order[:N_EPISODES] != order[N_EPISODES : 2 * N_EPISODES]  # fresh permutation per epoch
    assert order == _stream(0, 5 * N_EPISODES)
    assert order != _stream(1, 5 * N_EPISODES)
    assert _stream(0, 7, n=3, shuffle=False) == [0, 1, 2, 0, 1, 2, 0]

    sampler = EpisodeSampler(N_EPISODES, seed=0)
    running = iter(sampler)
    first = next(running)
    sampler.set_seed(1)  # affects new iterators only
    assert [first, *itertools.islice(running, N_EPISODES - 1)] == _stream(0, N_EPISODES)
    assert list(itertools.islice(iter(sampler), N_EPISODES)) == _stream(1, N_EPISODES)
    with pytest.raises(ValueError):
        EpisodeSampler(0)


# ---------------------------------------------------------------------------- lazy start
def test_construction_starts_nothing() -> None:
    children, threads = _children(), set(threading.enumerate())
    loaders = [EpisodeLoader(Episodes(), num_workers=2), EpisodeLoader(Episodes(), num_workers=0)]
    prefetcher = ThreadPrefetcher(Episodes(), prefetch=2)
    assert _children() == children
    assert set(threading.enumerate()) == threads
    assert not any(loader.started for loader in loaders) and not prefetcher.started
    assert [loader.num_workers for loader in loaders] == [2, 0]
    for loader in loaders:
        loader.close()
        assert loader.closed and not loader.started
    prefetcher.close()
    assert set(threading.enumerate()) == threads


# ------------------------------------------------------------------------- thread backend
def test_thread_backend_order_epochs_and_reseed() -> None:
    count = 3 * N_EPISODES
    with _capture() as records:
        with EpisodeLoader(Episodes(), num_workers=0, prefetch=2, seed=11) as loader:
            got = [_idx(next(loader)) for _ in range(count)]
            assert loader.backend == "thread" and loader.num_workers == 0 and loader.started
            loader.set_seed(12)
            reseeded = [_idx(loader.next()) for _ in range(N_EPISODES)]
        assert loader.closed and not loader.started
        with pytest.raises(RuntimeError):
            next(loader)
        assert not [r for r in records if r.levelno >= logging.WARNING]
    _assert_epochs(got)
    assert got == _stream(11, count)
    assert reseeded == _stream(12, N_EPISODES)
    assert not [t for t in threading.enumerate() if t.name == "torchrl_ext-episodes"]

    with EpisodeLoader(Episodes(), num_workers=0, shuffle=False) as loader:
        assert [_idx(next(loader)) for _ in range(8)] == [0, 1, 2, 3, 4, 5, 0, 1]


def test_pickled_loader_is_an_unstarted_copy() -> None:
    loader = EpisodeLoader(Episodes(), num_workers=0, seed=5)
    first = [_idx(next(loader)) for _ in range(3)]
    copy = pickle.loads(pickle.dumps(loader))
    loader.close()
    assert not copy.started and copy.seed == 5 and not copy.closed
    with copy:
        assert [_idx(next(copy)) for _ in range(3)] == first


# --------------------------------------------------------------------- DataLoader backend
def _forked_child_uses_copy(loader: EpisodeLoader[Any], q: Any) -> None:
    try:
        inherited = id(loader._iterator)
        got = [_idx(next(loader)) for _ in range(N_EPISODES)]
        loader.close()
        # torch registers each live iterator's worker pids in a process-wide table keyed by
        # id(); the fork copied the parent's entry. Were it left here, a new iterator that
        # reuses that id() could not start ("_set_worker_pids should be called only once").
        signal_handling._set_worker_pids(inherited, (os.getpid(),))
        signal_handling._remove_worker_pids(inherited)
        q.put(("ok", got))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_dataloader_backend_order_reseed_fork_and_close() -> None:
    baseline = _children()
    count = 3 * N_EPISODES
    loader = EpisodeLoader(Episodes(), num_workers=2, prefetch=2, seed=7, multiprocessing_context=FORK)
    got = [_idx(next(loader)) for _ in range(count)]
    assert loader.backend == "dataloader" and loader.num_workers == 2 and loader.started
    assert len(_children() - baseline) == 2

    _assert_epochs(got)
    assert got == _stream(7, count)  # same seed -> same order, whatever the backend
    with EpisodeLoader(Episodes(), num_workers=0, seed=7) as same_seed:
        assert [_idx(next(same_seed)) for _ in range(count)] == got
    assert _stream(8, count) != got

    # A started loader copied by fork must not disturb the parent's workers.
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_forked_child_uses_copy, args=(loader, q))
    child.start()
    status, payload = q.get(timeout=60)
    child.join(timeout=30)
    assert status == "ok", payload
    _assert_epochs(payload)

    loader.set_seed(8)  # restart in place, workers kept
    assert [_idx(next(loader)) for _ in range(count)] == _stream(8, count)
    workers = _children() - baseline
    assert len(workers) == 2

    loader.close()
    loader.close()
    assert loader.closed and not loader.started
    wait_until(lambda: not (_children() - baseline), "the loader's workers exited after close()")
    with pytest.raises(RuntimeError):
        next(loader)


def test_memmap_dataset_through_spawned_workers_and_del_reaps(tmp_path: Path) -> None:
    baseline = _children()
    paths = []
    for i in range(4):
        path = tmp_path / f"raw{i}.pt"
        torch.save({"idx": torch.full((T_STEPS,), i), "obs": torch.full((T_STEPS, 8), float(i))}, path)
        paths.append(path)
    dataset = memmap_episodes(paths, torch.load, tmp_path / "mm")
    # spawn, as in a process that imported torchrl: the memmap episodes travel by file name.
    loader = EpisodeLoader(dataset, num_workers=2, seed=0, multiprocessing_context="spawn")
    got = [_idx(next(loader)) for _ in range(8)]
    assert got == _stream(0, 8, n=4)
    assert len(_children() - baseline) == 2
    del loader  # no close(): __del__ must still shut the workers down
    gc.collect()
    wait_until(lambda: not (_children() - baseline), "the dropped loader's workers exited")


# ------------------------------------------------------------------------ daemonic fallback
def _daemonic_child(q: Any) -> None:
    try:
        with _capture() as records:
            report: dict[str, Any] = {"daemon": multiprocessing.current_process().daemon}
            loader = EpisodeLoader(Episodes(), num_workers=2, prefetch=2, seed=3)
            report["predicted_workers"] = loader.num_workers
            report["order"] = [_idx(next(loader)) for _ in range(2 * N_EPISODES)]
            report["backend"], report["num_workers"] = loader.backend, loader.num_workers
            report["children"] = len(psutil.Process().children(recursive=True))
            with EpisodeLoader(Episodes(), num_workers=2, seed=4) as second:
                report["second"] = [_idx(next(second)) for _ in range(3)]
            loader.close()
            report["warnings"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        q.put(("ok", report))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_daemonic_process_falls_back_to_thread() -> None:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_daemonic_child, args=(q,), daemon=True)
    proc.start()
    try:
        status, report = q.get(timeout=60)
    finally:
        proc.join(timeout=30)
    assert status == "ok", report
    assert report["daemon"] is True
    assert report["predicted_workers"] == 0
    assert report["backend"] == "thread" and report["num_workers"] == 0
    assert report["children"] == 0
    assert report["order"] == _stream(3, 2 * N_EPISODES)
    assert report["second"] == _stream(4, 3)
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "daemon_workers=False" in report["warnings"][0]
    assert "ManagedParallelEnv" in report["warnings"][0]
    assert proc.exitcode == 0


# ------------------------------------------------------------------------ thread prefetcher
def test_thread_prefetcher_order_errors_and_close() -> None:
    with ThreadPrefetcher(lambda k: k * 10, keys=range(5), prefetch=2) as pf:
        assert list(pf) == [0, 10, 20, 30, 40]
        with pytest.raises(StopIteration):
            next(pf)
    with ThreadPrefetcher(Episodes(3)) as pf:
        assert [_idx(e) for e in pf] == [0, 1, 2]

    def load(k: int) -> int:
        if k == 2:
            raise ValueError("bad episode")
        return k

    with ThreadPrefetcher(load, keys=range(5), prefetch=1) as pf:
        assert [next(pf), next(pf)] == [0, 1]
        with pytest.raises(ValueError, match="bad episode"):
            next(pf)
        with pytest.raises(RuntimeError):
            next(pf)

    calls: list[int] = []

    def slow_count(k: int) -> int:
        calls.append(k)
        return k

    name = "test-prefetch-blocked"
    pf2 = ThreadPrefetcher(slow_count, keys=itertools.count(), prefetch=1, name=name)
    assert next(pf2) == 0
    # Queue full (1 item) plus one loaded item waiting to be put: the producer is blocked.
    wait_until(lambda: len(calls) >= 3, "the producer filled the queue and loaded one more item")
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.daemon
    pf2.close()
    pf2.close()
    assert not thread.is_alive() and pf2.closed and not pf2.started
    assert len(calls) <= 4  # bounded read-ahead
    with pytest.raises(RuntimeError):
        next(pf2)


# ----------------------------------------------------------------------------------- memmap
def _write_raw(tmp_path: Path, n: int, start: int = 0) -> list[Path]:
    paths = []
    for i in range(start, start + n):
        path = tmp_path / "raw" / f"episode_{i}.pt"
        path.parent.mkdir(exist_ok=True)
        torch.save(
            {
                "obs": torch.randn(T_STEPS, 3),
                "action": torch.randint(0, 4, (T_STEPS,)),
                "next": {"reward": torch.randn(T_STEPS, 1)},
            },
            path,
        )
        paths.append(path)
    return paths


def test_memmap_round_trip_skip_and_redo(tmp_path: Path) -> None:
    paths = _write_raw(tmp_path, 3)
    out = tmp_path / "memmap"
    calls: list[Path] = []

    def parse(path: Path) -> dict[str, Any]:
        calls.append(path)
        data: dict[str, Any] = torch.load(path)
        return data

    dataset = memmap_episodes(paths, parse, out)
    assert isinstance(dataset, MemmapEpisodeDataset) and len(dataset) == 3
    assert calls == paths

    def check(ds: MemmapEpisodeDataset, paths: list[Path] = paths) -> None:
        for i, path in enumerate(paths):
            raw = torch.load(path)
            episode = ds[i]
            assert episode.batch_size == torch.Size([T_STEPS])
            assert torch.equal(episode["obs"], raw["obs"])
            assert torch.equal(episode["action"], raw["action"])
            assert torch.equal(episode["next", "reward"], raw["next"]["reward"])

    check(dataset)
    assert all(d.name.startswith(p.stem + "-") for d, p in zip(dataset.dirs, paths, strict=True))

    # Re-running converts nothing.
    again = memmap_episodes(paths, parse, out)
    assert len(calls) == 3 and again.dirs == dataset.dirs
    check(again)

    # Leftovers of an interrupted run: a temp dir, and an output dir without completion marker.
    stale = out / f".{dataset.dirs[1].name}.tmp-{os.getpid()}-deadbeef"
    stale.mkdir()
    (stale / "junk").write_text("partial")
    for marker in dataset.dirs[1].glob(".*complete*"):
        marker.unlink()
    extra = _write_raw(tmp_path, 1, start=3)
    calls.clear()
    redone = memmap_episodes(paths + extra, parse, out)
    assert calls == [paths[1], extra[0]]
    assert not stale.exists()
    check(redone, paths + extra)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_memmap_parse_errors_leave_nothing(tmp_path: Path) -> None:
    paths = _write_raw(tmp_path, 2)
    out = tmp_path / "memmap"

    def broken(path: Path) -> dict[str, Any]:
        raise OSError("cannot parse")

    with pytest.raises(OSError, match="cannot parse"):
        memmap_episodes(paths, broken, out)
    with pytest.raises(TypeError):
        memmap_episodes(paths, lambda p: [1, 2, 3], out)
    with pytest.raises(ValueError):
        memmap_episodes(paths, lambda p: {"x": torch.tensor(1.0)}, out)
    assert list(out.iterdir()) == []

    # A TensorDict without batch size gets the leading time dimension.
    dataset = memmap_episodes(
        paths[:1], lambda p: TensorDict({"obs": torch.arange(float(T_STEPS))}, batch_size=[]), out
    )
    assert dataset[0].batch_size == torch.Size([T_STEPS])
    assert torch.equal(dataset[-1]["obs"], torch.arange(float(T_STEPS)))


@pytest.mark.parametrize("worker_nice", [DEFAULT_WORKER_NICE, None])
def test_loader_workers_yield_to_stepping(worker_nice: int | None) -> None:
    """By default the loader's workers run at a lower priority (higher niceness) than the
    env worker, so that parsing ahead never delays a step; ``worker_nice=None`` keeps it."""
    baseline = _children()
    mine = psutil.Process().nice()
    with EpisodeLoader(
        Episodes(), num_workers=2, seed=0, multiprocessing_context=FORK, worker_nice=worker_nice
    ) as loader:
        next(loader)
        workers = [psutil.Process(pid) for pid in _children() - baseline]
        assert len(workers) == 2
        expected = mine if worker_nice is None else min(19, mine + worker_nice)
        wait_until(
            lambda: all(w.nice() == expected for w in workers), f"the loader's workers run at nice {expected}"
        )
    wait_until(lambda: not (_children() - baseline), "the loader's workers exited")


def test_worker_nice_cannot_raise_priority() -> None:
    with pytest.raises(ValueError, match="worker_nice"):
        EpisodeLoader(Episodes(), worker_nice=-5)
