"""Process-wide hooks: signal handlers installed once, chained, restored; the inherited tag."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv
from torchrl_ext._identity import start_time
from torchrl_ext._lifecycle import HANDLED_SIGNALS, _handle_signal
from torchrl_ext._tag import read_tag


@pytest.fixture
def default_signal_dispositions() -> Iterator[None]:
    """Signals not ignored, whatever started the test run (``nohup``, a background job):
    an ignored signal stays ignored by design (see the next test)."""
    previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    for sig, handler in previous.items():
        if handler is signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.compat
def test_handlers_installed_while_open_and_restored_after(default_signal_dispositions: None) -> None:
    before = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    env = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    env2 = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    try:
        env.reset()
        env2.reset()
        assert all(signal.getsignal(sig) is _handle_signal for sig in HANDLED_SIGNALS)
        env.close()
        assert all(signal.getsignal(sig) is _handle_signal for sig in HANDLED_SIGNALS), "env2 is still open"
    finally:
        env.close(raise_if_closed=False)
        env2.close(raise_if_closed=False)
    assert {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS} == before


@pytest.mark.compat
def test_opt_out_and_ignored_signals_stay_ignored() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        env = ManagedParallelEnv(
            1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork", handle_signals=False
        )
        env.reset()
        assert signal.getsignal(signal.SIGTERM) is not _handle_signal
        env.close()
        env = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
        env.reset()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is _handle_signal
        env.close()
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.compat
def test_every_descendant_inherits_the_owner_tag(tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, subprocess_kind="setsid", pid_dir=str(tmp_path)),
        daemon_workers=False,
        mp_start_method="fork",
    )
    try:
        env.reset()
        sims = [int(p.read_text()) for p in tmp_path.glob("sim-*")]
        assert len(sims) == 2
        me = psutil.Process()
        for pid in sims:
            tag, worker = read_tag(psutil.Process(pid))
            assert tag is not None and tag.owner_pid == me.pid
            assert abs(tag.owner_create_time - start_time(me)) < 1e-3
            assert worker in {"0", "1"}
        for pid in env.worker_pids:
            assert os.getpgid(pid) == pid
    finally:
        env.close()


@pytest.mark.compat
def test_package_import_starts_nothing() -> None:
    code = (
        "import psutil, threading, torchrl_ext, torchrl_ext.data\n"
        "assert not psutil.Process().children(), psutil.Process().children()\n"
        "print(threading.active_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "1"


def test_subreaper_only_while_envs_are_open() -> None:
    """Orphans of unrelated grandchildren are adopted only while a managed env is open."""
    from torchrl_ext import _platform

    if not _platform.has_prctl():
        pytest.skip("no prctl: no subreaper on this platform")
    assert not _platform.is_child_subreaper()
    env = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    env.reset()
    assert _platform.is_child_subreaper()
    env.close()
    assert not _platform.is_child_subreaper()
    out = subprocess.run(["sh", "-c", "sleep 5 & echo $!"], capture_output=True, text=True, check=True)
    orphan = psutil.Process(int(out.stdout))
    try:
        assert orphan.ppid() != os.getpid(), "an unrelated orphan was adopted after the last close"
    finally:
        orphan.kill()


def test_reaper_lingers_for_the_next_env_then_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """An env built right after another closed reuses the reaper (no new process); once no env
    is open it stops after the linger, or at once at exit."""
    from torchrl_ext import _reaper_client

    monkeypatch.setattr(_reaper_client, "LINGER", 60.0)  # longer than the test: only reuse counts
    fn = functools.partial(make_env)
    first = ManagedParallelEnv(1, fn, daemon_workers=False, mp_start_method="fork")
    first.reset()
    first.close()
    handle = _reaper_client._handle
    assert handle is not None and handle.proc.poll() is None, "lingering after the last close"
    second = ManagedParallelEnv(1, fn, daemon_workers=False, mp_start_method="fork")
    second.reset()
    assert _reaper_client._handle is handle, "the next env reuses it"
    second.close()
    _reaper_client.stop_now()  # what the exit hook does
    assert _reaper_client._handle is None and handle.proc.poll() is not None


def _zombie_children() -> list[tuple[int, str]]:
    """This process's children that have exited and are owed a ``wait()``."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append((child.pid, child.name()))
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("start_from", ["main thread, 2 cycles", "short-lived thread"])
def test_close_under_spawn_leaves_no_defunct_descendant(start_from: str) -> None:
    """Spawned workers whose resets build a ``DataLoader`` with spawned workers of its own (no
    ``multiprocessing_context``): when ``close()`` returns, the main process (the child
    subreaper the orphans of a worker go to) owes no ``wait()`` to any of them."""
    import threading

    assert not _zombie_children(), "zombie children before the test"
    fn = functools.partial(make_env, loader="per_reset")

    def cycle() -> None:
        env = ManagedParallelEnv(2, fn, daemon_workers=False, mp_start_method="spawn", shutdown_timeout=30.0)
        try:
            env.rollout(2)
        finally:
            env.close()
        left = _zombie_children()
        assert not left, f"defunct descendants owed a wait() after close(): {left}"

    if start_from == "short-lived thread":
        errors: list[BaseException] = []

        def run() -> None:
            try:
                cycle()
            except BaseException as err:  # re-raised in the test's thread
                errors.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
    else:
        for _ in range(2):
            cycle()
