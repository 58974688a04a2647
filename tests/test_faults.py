"""Fault supervision in the main process: worker deaths, env exceptions, no zombies."""

from __future__ import annotations

import functools
import gc
import multiprocessing.connection
import multiprocessing.synchronize
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import pytest
from torch.utils.data import DataLoader, Dataset

from tests.conftest import ROOT, child_env, fd_growth, fd_table, pid_alive, shm_entries, start_kwargs
from tests.envs import make_env
from tests.polling import WaitTimeout, wait_until
from torchrl_ext import ManagedParallelEnv, RemoteTraceback, WorkerDiedError


def _mapped_by_strangers(names: set[str]) -> set[str]:
    """Those of ``names`` (``/dev/shm`` entries) that a process outside this test's tree has
    mapped: another program's (other test runs on the machine), not ours."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    found = set()
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                maps = fh.read()
        except OSError:
            continue
        found |= {name for name in names if f"/dev/shm/{name}" in maps}
    return found


def semaphore_entries(obj: object, depth: int = 3) -> set[str]:
    """The /dev/shm entries (``sem.mp-*``) of the multiprocessing semaphores ``obj`` holds: a
    ``Lock``/``Semaphore`` itself, or those inside an ``Event``/``Condition`` (their attributes,
    ``depth`` levels down). Under fork a semaphore is unlinked at once and has none."""
    if isinstance(obj, multiprocessing.synchronize.SemLock):
        name = getattr(getattr(obj, "_semlock", None), "name", None)
        return {f"sem.{name.lstrip('/')}"} if name else set()
    if depth == 0 or not hasattr(obj, "__dict__"):
        return set()
    return {entry for value in vars(obj).values() for entry in semaphore_entries(value, depth - 1)}


def assert_no_shm_growth(before: set[str], cycles: int, in_use: Iterable[object] = ()) -> None:
    """No /dev/shm entry of ours is left after ``cycles`` cycles: not one, named semaphores
    (``sem.mp-*``) included, except those of ``in_use`` (objects still live, e.g. the events of
    an open env's current workers; see :func:`semaphore_entries`). The directory is machine-wide,
    and other programs (other test runs) create entries all the time: those another process maps
    are not ours, and an entry that is gone within the grace below was no leak. Whatever else is
    new at the deadline fails the test."""
    held = {entry for obj in in_use for entry in semaphore_entries(obj)}
    seen: dict[str, set[str]] = {}

    def no_growth() -> bool:
        new = shm_entries() - before - held
        seen["new"] = new - _mapped_by_strangers(new)
        return not seen["new"]

    try:
        wait_until(no_growth, "no /dev/shm entry of ours left", timeout=30)
    except WaitTimeout:
        raise AssertionError(
            f"/dev/shm entries left after {cycles} cycles: {sorted(seen['new'])} (in use: {sorted(held)});"
            f" {_who_holds(seen['new'])}"
        ) from None


def _who_holds(entries: set[str]) -> str:
    """For a failure message: which live objects of this process still hold the semaphores of
    ``entries`` (the referrer chain's types), and how many of them only a garbage collection
    (a reference cycle) frees."""
    holders: list[str] = []
    objects = gc.get_objects()
    for obj in objects:
        if issubclass(type(obj), multiprocessing.synchronize.SemLock) and semaphore_entries(obj) & entries:
            chain: list[str] = []
            current: object = obj
            for _ in range(4):
                refs = [
                    r
                    for r in gc.get_referrers(current)
                    if r is not objects and r is not holders and type(r).__name__ != "frame"
                ]
                if not refs:
                    break
                current = refs[0]
                del refs  # not a referrer of the next one
                chain.append(type(current).__name__)
            holders.append(" <- ".join(chain) or "no referrer")
    del objects
    gc.collect()
    freed = len(entries - shm_entries())
    held_by = sorted(set(holders))[:5]
    return f"{len(holders)} live semaphore(s) hold them ({held_by}); gc.collect() freed {freed}"


@pytest.mark.parametrize(
    "method",
    # On TorchRL 0.10.1 under fork only: under spawn and forkserver, each worker's 2 DataLoader
    # workers are spawned too (a torch import each), which the compat run cannot afford.
    [pytest.param("fork", marks=pytest.mark.compat), "forkserver"],  # not spawn: conftest.NOT_SPAWNED
)
def test_sigkilled_worker_raises_worker_died_error(method: str, tmp_path: Path) -> None:
    env = ManagedParallelEnv(
        2,
        functools.partial(
            make_env, loader="persistent", subprocess_kind="setsid", pid_dir=str(tmp_path), step_sleep=0.05
        ),
        daemon_workers=False,
        mp_start_method=method,
        shutdown_timeout=60.0,  # the survivor's close may take a while on a loaded machine
    )
    try:
        env.rollout(2)
        victim = env.worker_pids[1]
        victim_children = [
            int(p.read_text()) for p in tmp_path.glob(f"*-{victim}-*") if not p.name.startswith("stepping")
        ]
        assert len(victim_children) == 3
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            env.rollout(50)
        err = info.value
        assert isinstance(err, RuntimeError)
        assert (err.worker_index, err.pid, err.exitcode) == (1, victim, -9)
        assert "SIGKILL(-9)" in str(err) and "out of memory" in str(err)
        assert err.last_command is not None
        # The dead worker's tree is gone at once, before close().
        assert not [p for p in victim_children if pid_alive(p)]
        # The same error again on the next call, fast and clear.
        with pytest.raises(WorkerDiedError):
            env.reset()
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_worker_died_error_pickles() -> None:
    err = WorkerDiedError(3, 1234, -7, "step")
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == str(err) and clone.worker_index == 3 and "SIGBUS(-7)" in str(clone)


_RAISE_IN = {
    "init_in_worker": (ValueError, "building"),
    "reset": (KeyError, "'reset'"),
    "step": (ZeroDivisionError, "step"),
}


@pytest.mark.compat
@pytest.mark.parametrize(
    ("raise_in", "exc_type", "when", "method"),
    # Every site under fork. Under spawn (TorchRL's default), a failure while the worker
    # starts and one in its command loop ("reset" fails in the same loop as "step"); under
    # forkserver, the command loop. (Each case costs a spawned env start.)
    [(site, *_RAISE_IN[site], "fork") for site in _RAISE_IN]
    + [(site, *_RAISE_IN[site], "spawn") for site in ("init_in_worker", "step")]
    + [("step", *_RAISE_IN["step"], "forkserver")],
)
def test_env_exceptions_keep_their_type(
    raise_in: str, exc_type: type[BaseException], when: str, method: str
) -> None:
    fns = [functools.partial(make_env), functools.partial(make_env, raise_in=raise_in)]
    env = ManagedParallelEnv(2, fns, daemon_workers=False, mp_start_method=method)
    try:
        with pytest.raises(exc_type) as info:
            env.rollout(3)
        err = info.value
        assert getattr(err, "worker_index", None) == 1
        assert isinstance(err.__cause__, RemoteTraceback)
        assert "boom" in err.__cause__.tb
        assert when in "".join(getattr(err, "__notes__", []))
    finally:
        # A worker that failed while starting leaves the env closed, as upstream's does.
        env.close(raise_if_closed=False)


# A program that does not catch the env's error (both workers raise in reset), or whose env
# restarts the slot whose step raised; argv: start path, "raise" or "restart".
_UNCAUGHT_ENV_ERROR = """
import sys
from tests.conftest import start_kwargs
from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv

method, mode = sys.argv[1], sys.argv[2]
if mode == "raise":
    env = ManagedParallelEnv(2, make_env, create_env_kwargs={"raise_in": "reset"},
                             daemon_workers=False, **start_kwargs(method))
    env.reset()
env = ManagedParallelEnv(2, make_env, create_env_kwargs=[{}, {"raise_in": "step"}], daemon_workers=False,
                         max_restarts=1, restart_on_error=True, **start_kwargs(method))
td = env.reset()
env.step_and_maybe_reset(env.rand_action(td))
assert len(env.restarts) == 1
env.close()
"""

#: The name ``multiprocessing`` gives a worker of each start path (``<name>-<counter>``).
_PROCESS_NAMES = {
    "spawn": "SpawnProcess",
    "fork": "ForkProcess",
    "forkserver": "ForkServerProcess",
    "preloaded": "ForkServerProcess",
}


@pytest.mark.parametrize(
    ("method", "mode"),
    [
        pytest.param("fork", "raise", marks=pytest.mark.compat),
        ("spawn", "raise"),
        ("forkserver", "raise"),
        ("preloaded", "raise"),
        pytest.param("fork", "restart", marks=pytest.mark.compat),
        ("preloaded", "restart"),
    ],
)
def test_an_env_error_shows_one_traceback_under_the_workers_name(method: str, mode: str) -> None:
    """The worker's traceback is shown once, under the worker's process name as upstream's
    workers print it: as the cause of the error the main process raises (not also printed by
    the worker), or, for an error the env restarted the slot for, by the worker itself."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNCAUGHT_ENV_ERROR, method, mode],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = proc.stderr
    name = _PROCESS_NAMES[method]
    raised = (
        'raise KeyError("boom in reset")' if mode == "raise" else 'raise ZeroDivisionError("boom in step")'
    )
    assert proc.returncode == (1 if mode == "raise" else 0), err
    assert err.count(raised) == 1, err
    assert err.count("Process ") == 1 and f"Process {name}-" in err, err
    if mode == "raise":  # the main process's error: its cause is that one traceback
        assert err.count("Traceback (most recent call last)") == 2, err
        assert 'RemoteTraceback: \n"""\nProcess ' in err, err
        assert err.rstrip().endswith("while handling 'reset'."), err


@pytest.mark.compat
def test_spec_reading_env_error_keeps_its_type() -> None:
    with pytest.raises(ValueError, match="boom") as info:
        ManagedParallelEnv(
            2, functools.partial(make_env, raise_in="init"), daemon_workers=False, mp_start_method="fork"
        )
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "read its specs" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.compat
def test_spec_reading_env_cannot_leak_children(tmp_path: Path) -> None:
    """The env TorchRL builds to read specs runs supervised: what it leaves running is killed."""
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, leak_in_init=True, pid_dir=str(tmp_path)),
        daemon_workers=False,
        mp_start_method="fork",
    )
    leaked_by_spec_env = [int(p.read_text()) for p in tmp_path.glob("leak-*")]
    assert len(leaked_by_spec_env) == 1
    assert not [pid for pid in leaked_by_spec_env if pid_alive(pid)]
    env.rollout(2)
    in_workers = [int(p.read_text()) for p in tmp_path.glob("leak-*")]
    assert len(in_workers) == 3
    env.close()
    # A worker ends what its env left running before it exits: a graceful close, nothing left.
    report = env.supervision_report
    assert report is not None and report.clean, str(report)
    assert not [pid for pid in in_workers if pid_alive(pid)]


def _factory_holding_a_lock() -> Callable[..., Any]:
    """A closure over a lock: cloudpickle (what TorchRL sends a factory with) cannot pickle it."""
    lock = threading.Lock()

    def factory(**kwargs: Any) -> Any:
        with lock:
            return make_env(**kwargs)

    return factory


@pytest.mark.parametrize("where", ["spec reading", "worker"])
@pytest.mark.parametrize("method", ["spawn", "forkserver", "preloaded"])
def test_unpicklable_factory_error_names_it_and_the_fix(method: str, where: str) -> None:
    """Every start but fork pickles the factory: pickling's own error (same type, same message)
    with a note naming the factory, the process it was for, and the ways out."""
    factory = _factory_holding_a_lock()
    with pytest.raises(TypeError) as info:
        if where == "spec reading":
            ManagedParallelEnv(2, factory, daemon_workers=False, **start_kwargs(method))
        else:  # the specs are read in this process: the workers' start pickles it
            env = ManagedParallelEnv(
                2,
                [functools.partial(make_env), factory],
                daemon_workers=False,
                metadata_in_subprocess=False,
                **start_kwargs(method),
            )
            try:
                env.reset()
            finally:
                env.close(raise_if_closed=False)
    err = info.value
    assert str(err) == "cannot pickle '_thread.lock' object"
    note = "".join(getattr(err, "__notes__", []))
    assert "the env factory tests.test_faults._factory_holding_a_lock.<locals>.factory of " in note, note
    assert ("read its specs" if where == "spec reading" else "of worker 1 cannot be pickled") in note, note
    started = "the preloaded fork server" if method == "preloaded" else f"mp_start_method={method!r}"
    assert f"starting it with {started}" in note, note
    assert "module-level function" in note and "mp_start_method='fork', which pickles nothing" in note


@pytest.mark.compat
def test_unpicklable_factory_works_under_fork() -> None:
    """Fork pickles nothing: the factory that no other start can send works, as upstream's (the
    env that reads the specs in a helper process included)."""
    env = ManagedParallelEnv(2, _factory_holding_a_lock(), daemon_workers=False, mp_start_method="fork")
    try:
        assert env.rollout(3).shape == (2, 3)
    finally:
        env.close()


def test_no_zombies_fds_or_shm_after_repeated_worker_deaths() -> None:
    fn = functools.partial(make_env, loader="persistent")

    def cycle() -> None:
        env = ManagedParallelEnv(2, fn, daemon_workers=False, mp_start_method="fork", shutdown_timeout=2.0)
        env.rollout(2)
        os.kill(env.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            env.rollout(5)
        env.close()

    cycle()  # warm-up: lazily created helpers (resource tracker, thread pools) exist from here on
    gc.collect()  # envs sit in reference cycles (upstream's too): collect before counting
    fds, shm = fd_table(), shm_entries()
    me = psutil.Process()
    for _ in range(20):
        cycle()
    gc.collect()
    assert len(fd_table()) <= len(fds), fd_growth(fds)
    assert_no_shm_growth(shm, cycles=20)
    zombies = [c for c in me.children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    assert not zombies


@pytest.mark.compat
def test_create_rollout_close_cycles_leak_nothing() -> None:
    fn = functools.partial(make_env, loader="per_reset")

    def cycle() -> None:
        env = ManagedParallelEnv(2, fn, daemon_workers=False, mp_start_method="fork")
        env.rollout(6)
        env.close()

    cycle()
    gc.collect()
    fds, shm = fd_table(), shm_entries()
    threads = threading.active_count()
    # What lives as long as this process (multiprocessing's helpers, the preloaded server a
    # session starts at collection, and what serves it) was there before the cycles.
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    for _ in range(20):
        cycle()
    gc.collect()
    assert len(fd_table()) <= len(fds), fd_growth(fds)
    assert_no_shm_growth(shm, cycles=20)
    assert threading.active_count() <= threads
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in children]
    assert not left or all(
        "forkserver" in " ".join(c.cmdline()) or "resource_tracker" in " ".join(c.cmdline()) for c in left
    ), left


class _CrashingDataset(Dataset):  # type: ignore[type-arg]
    """Its worker dies on the first item, before it has sent anything.

    Items are plain ints: a tensor sent before the crash would be shared through the dying
    worker's fd server, and receiving it races the death (ConnectionResetError instead of torch's
    report; seen once in CI).
    """

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        os._exit(17)


def _crash_message(loader: DataLoader) -> str:  # type: ignore[type-arg]
    it = iter(loader)
    try:
        list(it)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    finally:
        it._shutdown_workers()  # type: ignore[attr-defined]  # reap now, not whenever GC runs
        del it
        gc.collect()
    return message


@pytest.mark.compat
def test_main_process_dataloader_keeps_its_own_crash_report() -> None:
    """Our supervision never reaps someone else's child: torch still sees its worker die."""
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    try:
        env.rollout(2)
        message = _crash_message(DataLoader(_CrashingDataset(), batch_size=None, num_workers=1))
        assert "exited unexpectedly" in message or "exit code 17" in message, message
        env.rollout(2)
    finally:
        env.close()


@pytest.mark.parametrize(
    "method",
    [pytest.param("fork", marks=pytest.mark.compat), "forkserver", "spawn"],  # 0.10.1: fork only
)
def test_env_started_from_a_short_lived_thread_keeps_working(method: str) -> None:
    """The parent-death signal fires when the *thread* that started a process ends: workers
    started from a thread that then ends must keep running, under every start method."""
    holder: dict[str, ManagedParallelEnv] = {}

    def start() -> None:
        holder["env"] = ManagedParallelEnv(
            2, functools.partial(make_env), daemon_workers=False, mp_start_method=method
        )
        holder["env"].reset()

    t = threading.Thread(target=start)
    t.start()
    t.join()
    env = holder["env"]
    try:
        assert env.worker_pids, "the thread started the workers"
        # The kernel thread is gone too (join() returns a moment before): whatever its end
        # signals has been sent.
        wait_until(lambda: not os.path.exists(f"/proc/self/task/{t.native_id}"), "the thread has exited")
        out = env.rollout(4)
        assert out.shape[0] == 2
        assert all(pid_alive(p) for p in env.worker_pids)
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
def test_death_detected_without_pidfds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The macOS / old-kernel path: no pidfd, and the sentinel is held open by the dead
    worker's forked DataLoader workers; polling still notices the death."""
    from torchrl_ext import _platform

    monkeypatch.setattr(_platform, "open_pidfd", lambda pid: None)
    env = ManagedParallelEnv(
        2,
        functools.partial(make_env, loader="persistent", dl_context="fork", pid_dir=str(tmp_path)),
        daemon_workers=False,
        mp_start_method="fork",
    )
    try:
        env.rollout(2)
        victim = env.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            env.rollout(20)
        assert info.value.pid == victim and info.value.exitcode == -signal.SIGKILL
    finally:
        env.close()


def test_the_supervisors_exit_poll_sees_what_multiprocessing_wait_sees() -> None:
    """``WorkerSupervisor.poll`` asks which exit descriptors have an event with one ``poll``
    call (after every batched step): the same answer as ``multiprocessing.connection.wait``
    with no timeout, for a quiet pipe, one with data and one whose writer is gone."""
    from torchrl_ext._supervisor import _ready_now

    quiet, fed, hung = os.pipe(), os.pipe(), os.pipe()
    try:
        os.write(fed[1], b"x")
        os.close(hung[1])
        fds = [quiet[0], fed[0], hung[0]]
        assert sorted(_ready_now(fds)) == sorted(multiprocessing.connection.wait(fds, timeout=0))
        assert sorted(_ready_now(fds)) == sorted([fed[0], hung[0]])
        assert _ready_now([]) == []
    finally:
        for fd in (*quiet, *fed, hung[0]):
            os.close(fd)
