"""Recycling workers at episode boundaries (``recycle_every``, ``recycle_memory``).

A recycled slot's next episode runs in a fresh worker started ahead of time; the old worker's
env is closed (it records "closed" in ``pid_dir``) and the worker exits; nothing is marked.
ToyEnv episodes are 5 steps; each step observes ``obs + 1`` of the one before, and a fresh
env's episode ``e`` starts at ``arange(4) + 100 * e``: the data shows where an episode began.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import start_kwargs
from tests.envs import OBS, make_env, make_set_state_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, _platform
from torchrl_ext._policy import parse_bytes

STARTS = [pytest.param("preloaded", marks=pytest.mark.compat), pytest.param("fork", marks=pytest.mark.compat)]
FIRST_OBS = torch.arange(OBS, dtype=torch.float32)


def _closed_pids(pid_dir: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in pid_dir.glob("closed-*")}


def _steps(env: ManagedParallelEnv, td: Any, n: int) -> tuple[list[Any], Any]:
    out = []
    for _ in range(n):
        step, td = env.step_and_maybe_reset(env.rand_action(td))
        out.append(step.clone())
    return out, td


def _assert_consistent(steps: list[Any]) -> None:
    """Every transition is a real one: ``next`` follows its root by one step, nothing marked."""
    for step in steps:
        assert torch.equal(step["next", "observation"], step["observation"] + 1)
        assert not step["next", "worker_restarted"].any()


@pytest.mark.parametrize("method", [*STARTS, "forkserver"])  # not spawn: conftest.NOT_SPAWNED
def test_recycle_every_runs_each_worker_for_that_many_episodes(method: str, tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path)),
        daemon_workers=False,
        recycle_every=2,
        max_restarts=1,  # only for the worker_restarted entry: nothing may be marked
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        first = env.worker_pids
        steps, td = _steps(env, td, 30)  # 6 episodes per slot: 2 workers each replaced
        _assert_consistent(steps)
        records = env.restarts
        assert len(records) >= 4 and all(r.cause == "episodes" and r.recycled for r in records)
        for slot in (0, 1):
            chain = [r for r in records if r.slot == slot]
            assert chain[0].old_pid == first[slot]
            assert all(a.new_pid == b.old_pid for a, b in itertools.pairwise(chain))
        old = {r.old_pid for r in records}
        wait_until(
            lambda: not any(psutil.pid_exists(p) and _running(p) for p in old), "recycled workers gone"
        )
        assert old <= _closed_pids(tmp_path)  # each one closed its env: a graceful end
        stats = env.stats(workers="both")
        assert stats["recycles"] == stats["recycles_episodes"] == len(records)
        assert stats["restarts"] == 0 and stats["deaths"] == 0
    finally:
        env.close()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("method", STARTS)
def test_a_recycled_slot_starts_its_episode_in_the_fresh_env(method: str) -> None:
    """recycle_every=1: every episode runs in a new worker, so every episode is a fresh env's
    first (``FIRST_OBS`` after each reset), with step_and_maybe_reset and with env.reset()."""
    env = ManagedParallelEnv(2, make_env, daemon_workers=False, recycle_every=1, **start_kwargs(method))
    try:
        td = env.reset()
        assert torch.equal(td["observation"][0], FIRST_OBS)
        steps, td = _steps(env, td, 5)  # the episode ends: the next root is a new worker's reset
        assert steps[-1]["next", "done"].all()
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))
        before = env.worker_pids
        td = env.reset()  # an explicit reset of both: each goes to a standby
        after = env.worker_pids
        assert set(before).isdisjoint(after)
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))
        assert {r.command for r in env.restarts} == {"step_and_maybe_reset", "reset"}
    finally:
        env.close()


def _resets(pid_dir: Path) -> dict[int, int]:
    """Per worker pid, how many resets its env has run (``record_resets``)."""
    counts: dict[int, int] = {}
    for path in pid_dir.glob("reset*-*"):
        name, pid, _same = path.name.split("-")
        counts[int(pid)] = max(counts.get(int(pid), 0), int(name.removeprefix("reset")))
    return counts


def _resets_ahead(env: ManagedParallelEnv, pid_dir: Path, first: set[int], count: int) -> dict[int, int]:
    """Once ``count`` workers other than ``first`` have reset their env (polled, with a call to
    the env each time: the recycler works between calls), their reset counts by pid."""

    def found() -> dict[int, int]:
        env.state_dict()  # any call
        return {pid: n for pid, n in _resets(pid_dir).items() if pid not in first}

    wait_until(lambda: len(found()) >= count, f"{count} standby(s) reset their env ahead")
    return found()


@pytest.mark.parametrize("method", STARTS)
def test_a_standby_resets_its_env_ahead_and_its_turn_uses_that_reset(method: str, tmp_path: Path) -> None:
    """NOTE [prepared reset]: a ready standby resets its env between calls, before its turn; the
    slot's plain reset then returns that reset (the fresh env's first episode) without resetting
    the env again. A reset with kwargs gets the env's own reset with them, after the prepared one."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path), record_resets=True),
        daemon_workers=False,
        recycle_every=1,
        max_restarts=1,  # only for the worker_restarted entry: nothing may be marked
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        first = set(env.worker_pids)
        ahead = _resets_ahead(env, tmp_path, first, 2)
        assert list(ahead.values()) == [1, 1], ahead
        steps, td = _steps(env, td, 5)  # both episodes end: the standbys take the slots
        _assert_consistent(steps)
        assert set(env.worker_pids) == set(ahead)
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))  # their envs' first episode
        assert {pid: _resets(tmp_path)[pid] for pid in ahead} == ahead  # published, not reset again
        # Due again: the next standbys reset ahead too; a reset with kwargs is their second.
        _resets_ahead(env, tmp_path, first, 4)
        td = env.reset(note="with kwargs")
        assert set(env.worker_pids).isdisjoint(ahead)
        assert all(_resets(tmp_path)[pid] == 2 for pid in env.worker_pids)
        assert torch.equal(td["observation"], (FIRST_OBS + 100).expand(2, OBS))
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_a_standby_started_by_the_call_of_its_turn_still_resets_ahead(method: str, tmp_path: Path) -> None:
    """A standby started by the very call that is its slot's boundary (it had no time to get
    ready) is built and reset ahead all the same before it gets the slot's reset: a reset with
    kwargs is its env's second, as for a standby ready in time (data never depends on timing)."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path), record_resets=True),
        daemon_workers=False,
        recycle_every=1,
        **start_kwargs(method),
    )
    try:
        env.reset()  # both slots are due from now on
        first = set(env.worker_pids)
        td = env.reset(note="with kwargs")  # starts the standbys, then gives them the slots
        assert set(env.worker_pids).isdisjoint(first)
        assert all(_resets(tmp_path)[pid] == 2 for pid in env.worker_pids)
        assert torch.equal(td["observation"], (FIRST_OBS + 100).expand(2, OBS))
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_a_plain_reset_uses_the_prepared_one_for_an_env_that_supports_set_state(
    method: str, tmp_path: Path
) -> None:
    """TorchRL >= 0.14 passes ``set_state=False`` to the workers' resets of an env that supports
    it: still a plain reset, which publishes the prepared one (the env is reset once)."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_set_state_env, pid_dir=str(tmp_path), record_resets=True),
        daemon_workers=False,
        recycle_every=1,
        **start_kwargs(method),
    )
    try:
        env.reset()
        ahead = _resets_ahead(env, tmp_path, set(env.worker_pids), 2)
        td = env.reset()  # both slots are due: their standbys take them
        assert set(env.worker_pids) == set(ahead)
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))
        assert {pid: _resets(tmp_path)[pid] for pid in ahead} == ahead == dict.fromkeys(ahead, 1)
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_an_env_reopened_after_close_recycles_afresh(method: str, tmp_path: Path) -> None:
    """Closed with its standbys reset ahead, the env starts again at its next call (as upstream
    does): new workers, recycling from the start, every transition a real one."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path), record_resets=True),
        daemon_workers=False,
        recycle_every=1,
        max_restarts=1,  # only for the worker_restarted entry: nothing may be marked
        **start_kwargs(method),
    )
    try:
        env.reset()
        _resets_ahead(env, tmp_path, set(env.worker_pids), 2)
        env.close()
        td = env.reset()  # a new start
        reopened = set(env.worker_pids)
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))
        steps, td = _steps(env, td, 5)  # the episodes end: each slot is recycled
        _assert_consistent(steps)
        assert set(env.worker_pids).isdisjoint(reopened)
        assert torch.equal(td["observation"], FIRST_OBS.expand(2, OBS))
    finally:
        env.close(raise_if_closed=False)


def _tree_memory(pid: int, measure: str) -> int:
    """Worker ``pid``'s tree (it and its descendants) as psutil reads it: ``"uss"`` (what no other
    process maps, per process) or ``"rss"``."""
    proc = psutil.Process(pid)
    total = 0
    for member in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a DataLoader worker that just ended
            info = member.memory_full_info() if measure == "uss" else member.memory_info()
            total += getattr(info, measure)
    return total


#: The warning of an env whose recycle_memory counts RSS (no smaps_rollup, as on macOS).
RSS_WARNING = "recycle_memory counts each worker tree's resident memory (RSS) here"


@pytest.mark.parametrize("measure", ["uss", "rss"])
@pytest.mark.parametrize("method", STARTS)
def test_recycle_memory_replaces_a_growing_worker_before_its_tree_passes_the_cap(
    method: str, measure: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``recycle_memory`` counts the tree's unique memory (USS); where ``smaps_rollup`` cannot be
    read ("rss": as on macOS), its RSS, with one warning."""
    if measure == "rss":
        monkeypatch.setattr(_platform, "has_smaps_rollup", lambda: False)
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    grow = 16  # MiB per reset
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"grow_mb_per_reset": grow}],
        daemon_workers=False,
        max_restarts=1,
        **start_kwargs(method),
    )
    # The cap: the grower's tree now, plus 5 episodes' growth.
    probe = env.reset()
    assert probe is not None
    base = _tree_memory(env.worker_pids[1], measure)
    env.close()
    cap = base + 5 * (grow << 20)
    env = ManagedParallelEnv(
        2,
        make_env,
        create_env_kwargs=[{}, {"grow_mb_per_reset": grow}],
        daemon_workers=False,
        max_restarts=1,
        recycle_memory=cap,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        peak = 0
        for _ in range(30):  # 150 steps: 30 episodes, six caps' worth of growth
            steps, td = _steps(env, td, 5)
            _assert_consistent(steps)
            peak = max(peak, _tree_memory(env.worker_pids[1], measure))
        assert env.restarts and all(r.cause == "memory" and r.slot == 1 for r in env.restarts)
        assert peak <= cap + ((grow + 1) << 20)  # under the cap, plus one episode's growth
        assert env.stats()["recycles_memory"] == len(env.restarts)
        assert caplog.text.count(RSS_WARNING) == (measure == "rss")
    finally:
        env.close()


def test_a_full_collection_in_a_preloaded_worker_leaves_the_server_pages_shared() -> None:
    """NOTE [frozen preload] (``_forkserver``): a full collection in a worker forked from the
    preloaded server scans none of the objects it inherited, so it copies none of the pages it
    shares with the server into its own (on TorchRL 0.15 one ran within ~80 toy steps and
    doubled as many of a healthy worker's pages into its USS; ``recycle_memory`` recycled it).
    The preloaded path only: a "fork" worker inherits its owner's heap, the user's to freeze."""
    env = ManagedParallelEnv(1, functools.partial(make_env, collect_from_reset=3), daemon_workers=False)
    try:
        env.reset()
        env.reset()  # two resets, no collection
        pid = env.worker_pids[0]
        before = _tree_memory(pid, "uss")
        shared = _tree_memory(pid, "rss") - before  # what it maps that others map too
        env.reset()
        env.reset()  # two full collections
        assert env.worker_pids[0] == pid
        assert _tree_memory(pid, "uss") - before < shared // 8, (before >> 20, shared >> 20)
    finally:
        env.close()


#: MiB each worker of the DataLoader test holds of its own (a simulator's state).
HOLD_MB = 64


@pytest.mark.parametrize("method", STARTS)
def test_recycle_memory_recycles_only_the_leaking_worker_of_an_env_with_dataloader_resets(
    method: str,
) -> None:
    """Issue 30: 4 workers, each holding 64 MiB and running a ``DataLoader(num_workers=4)`` in
    every reset, slot 3 keeping 64 MiB more at every reset; ``recycle_memory`` = 1.5x a healthy
    tree's USS between two calls. During a reset a healthy tree's RSS is several times the cap
    (each DataLoader worker maps torch and its parent's pages: RSS counts them once per process);
    what it holds of its own stays under it: only slot 3 is recycled, again and again."""
    factory = functools.partial(make_env, loader="per_reset", dl_workers=4, hold_mb=HOLD_MB)
    probe = ManagedParallelEnv(4, factory, daemon_workers=False, **start_kwargs(method))
    try:
        td = probe.reset()
        _steps(probe, td, 5)  # an episode, and the reset after it
        steady = max(_tree_memory(pid, "uss") for pid in probe.worker_pids)
        between = min(_tree_memory(pid, "rss") for pid in probe.worker_pids)
    finally:
        probe.close()
    cap = int(1.5 * steady)
    assert steady >= HOLD_MB << 20 and between > cap  # the RSS is over it even between resets
    env = ManagedParallelEnv(
        4,
        factory,
        create_env_kwargs=[{}, {}, {}, {"grow_mb_per_reset": 64}],
        daemon_workers=False,
        max_restarts=1,  # only for the worker_restarted entry: nothing may be marked
        recycle_memory=cap,
        **start_kwargs(method),
    )
    try:
        td = env.reset()
        healthy = env.worker_pids[:3]
        for _ in range(10):  # 10 episodes: 640 MiB of growth in slot 3
            steps, td = _steps(env, td, 5)
            _assert_consistent(steps)
        records = env.restarts
        assert len(records) >= 2 and all(r.slot == 3 and r.cause == "memory" for r in records), records
        assert env.worker_pids[:3] == healthy
        stats = env.stats(workers="both")
        assert stats["recycles_memory"] == stats["recycles"] == len(records) and stats["restarts"] == 0
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_close_with_a_standby_and_a_recycled_worker_leaves_nothing(method: str, tmp_path: Path) -> None:
    # recycle_every=1: after each boundary a standby is started for the next; close meanwhile.
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, pid_dir=str(tmp_path)),
        daemon_workers=False,
        recycle_every=1,
        **start_kwargs(method),
    )
    td = env.reset()
    _, td = _steps(env, td, 6)
    env.close()
    report = env.supervision_report
    assert report is not None and all(w.outcome == "graceful" for w in report.workers)


@pytest.mark.parametrize("method", STARTS)
def test_a_standby_that_dies_while_it_builds_its_env_leaves_the_old_worker_running(
    method: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flag = tmp_path / "arm"
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, die_in_init_if=str(flag), die_flag=str(tmp_path / "died")),
        daemon_workers=False,
        recycle_every=1,
        **start_kwargs(method),
    )
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    try:
        td = env.reset()
        flag.touch()  # the next worker built dies in its factory, once
        steps, td = _steps(env, td, 15)
        _assert_consistent_plain(steps)
        # The warning says which phase failed and how: the factory SIGKILLed itself.
        assert "exited with exit code SIGKILL(-9) before it could build its env" in caplog.text
        assert env.restarts  # the next standby worked
        assert env.stats()["deaths"] == 0
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_a_standby_that_dies_in_its_prepared_reset_leaves_the_old_worker_running(
    method: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NOTE [prepared reset]: a standby SIGKILLed while it resets its env ahead is dropped with
    a warning; the old worker keeps its slot and resets its env itself; nothing is lost."""
    flag = tmp_path / "died"
    flag.touch()  # disarmed while the first workers reset
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, die_once_at_reset=1, die_flag=str(flag), pid_dir=str(tmp_path)),
        daemon_workers=False,
        recycle_every=1,
        **start_kwargs(method),
    )
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    try:
        td = env.reset()
        first = set(env.worker_pids)
        flag.unlink()  # armed: the next env's first reset (a standby's, ahead) dies, once

        _await_drop(
            env,
            caplog,
            "exited with exit code SIGKILL(-9) before it could reset its env ahead",
            "a standby killed in its prepared reset is dropped",
        )
        assert int(flag.read_text()) not in first  # it was a standby that died
        _assert_the_old_workers_go_on(env, td, first)
    finally:
        env.close()


@pytest.mark.parametrize("method", STARTS)
def test_a_standby_that_does_not_build_its_env_within_start_timeout_is_dropped(
    method: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``start_timeout`` bounds a standby's env construction too: one whose factory hangs is
    killed at the limit, with a warning that names it; the old worker keeps its slot, the next
    standby is started afresh, and nothing is lost."""
    gate = str(tmp_path / "gate")  # never created: a factory held at it hangs
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, init_gate=gate, pid_dir=str(tmp_path)),
        daemon_workers=False,
        recycle_every=1,
        start_timeout=3.0,
        **start_kwargs(method),
    )
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    try:
        td = env.reset()
        first = set(env.worker_pids)
        Path(gate + ".once").touch()  # the next worker built hangs in its factory, once

        _await_drop(
            env,
            caplog,
            "did not build its env within start_timeout=3s",
            "a standby hung in its factory is dropped at start_timeout",
        )
        hung = [int(f.read_text()) for f in tmp_path.glob("building-*")]
        assert len(hung) == 1 and hung[0] not in first  # it was a standby that hung
        assert not _running(hung[0])  # killed (and reaped) when it was dropped
        _assert_the_old_workers_go_on(env, td, first)
    finally:
        env.close()


def _await_drop(env: ManagedParallelEnv, caplog: pytest.LogCaptureFixture, phrase: str, what: str) -> None:
    """Call the env (any call: the recycler works between calls) until a dropped standby's
    warning with ``phrase`` is logged."""

    def logged() -> bool:
        env.state_dict()
        return phrase in caplog.text

    wait_until(logged, what)


def _assert_the_old_workers_go_on(env: ManagedParallelEnv, td: Any, first: set[int]) -> None:
    """After a standby was dropped: the old workers keep their slots, every transition is a
    real one, the next standbys take over, and no death is counted."""
    assert set(env.worker_pids) == first
    steps, _ = _steps(env, td, 15)
    _assert_consistent_plain(steps)
    assert env.restarts and all(r.recycled for r in env.restarts)
    assert env.stats()["deaths"] == 0


def _assert_consistent_plain(steps: list[Any]) -> None:
    for step in steps:
        assert torch.equal(step["next", "observation"], step["observation"] + 1)


def test_a_worker_lost_while_due_is_restarted_and_recycling_starts_over(tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2, make_env, daemon_workers=False, recycle_every=3, max_restarts=2, mp_start_method="fork"
    )
    try:
        td = env.reset()
        _, td = _steps(env, td, 10)  # 3rd episode: due, a standby waits
        os.kill(env.worker_pids[1], signal.SIGKILL)
        wait_until(lambda: env.stats()["deaths"] == 1, "the death seen")
        steps, td = _steps(env, td, 20)
        lost = [r for r in env.restarts if not r.recycled]
        assert len(lost) == 1 and lost[0].slot == 1
        assert sum(bool(s["next", "worker_restarted"][1]) for s in steps) == 1
    finally:
        env.close()


@pytest.mark.parametrize(
    ("value", "expected"), [("4GiB", 4 << 30), ("512 MiB", 512 << 20), ("2GB", 2 * 10**9), (1024, 1024)]
)
def test_recycle_memory_takes_bytes_or_a_size(value: Any, expected: int) -> None:
    assert parse_bytes(value, "recycle_memory") == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recycle_memory": "lots"}, "is not a size"),
        ({"recycle_memory": 0}, "must be positive"),
        ({"recycle_every": 0}, "recycle_every must be None or an int >= 1"),
        ({"recycle_memory": "1GiB", "collect_stats": False}, "recycle_memory needs the memory"),
    ],
)
def test_recycling_options_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ManagedParallelEnv(2, make_env, **kwargs)
