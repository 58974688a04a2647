"""Shared fixtures. The autouse ``no_leaks`` fixture fails any test that leaves a process behind."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

# wait_until lives in tests/polling.py; imported here too, so `from tests.conftest import
# wait_until` keeps working.
from tests.polling import WaitTimeout, wait_until

ROOT = Path(__file__).resolve().parent.parent
SESSION_VAR = "TORCHRL_EXT_TEST_SESSION"
os.environ.setdefault(SESSION_VAR, uuid.uuid4().hex)
SESSION = os.environ[SESSION_VAR]

#: Long-lived helpers multiprocessing starts once per test process; not leaks.
_PERSISTENT_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "resource_tracker")

START_METHODS = ["fork", "forkserver", "spawn"]
#: The three start methods and the default path: forks of the preloaded server (no
#: ``mp_start_method``; see torchrl_ext/_forkserver.py).
WORKER_STARTS = [*START_METHODS, "preloaded"]
#: The starts of a test whose outcome does not depend on how a worker process is created
#: (restart and recycling policy, close escalation, errors through the pipe, stacks, sweep):
#: there spawn differs from forkserver only in importing torch in each worker (about 4 s per
#: worker on 2 cores); both give the worker a fresh process and a pickled factory. Spawn stays
#: where creation can change the outcome: pickling, ``__main__``, bootstrap, thread counts,
#: leaks, exits, and the contract suite. See docs/design.md, "Start paths in the suite".
NOT_SPAWNED = [m for m in WORKER_STARTS if m != "spawn"]


#: Why a run may leave a start method out (``--skip-start-method``): the Makefile's TorchRL 0.15
#: suite leaves spawn to the main suite (see the Makefile's ``test-torchrl015``).
SKIP_START_OPTION = "--skip-start-method"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        SKIP_START_OPTION,
        action="append",
        default=[],
        choices=[*WORKER_STARTS, "default"],
        help="deselect every test case that has this start method as a parameter (repeatable)",
    )


def _skipped_start(item: pytest.Item, methods: set[str]) -> str | None:
    """The start method of ``methods`` that one of ``item``'s parameters is, if any."""
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return next((v for v in values if isinstance(v, str) and v in methods), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    methods = set(config.getoption(SKIP_START_OPTION.lstrip("-").replace("-", "_")))
    if not methods:
        return
    dropped = [item for item in items if _skipped_start(item, methods)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _skipped_start(item, methods)]
    config.stash[_SKIPPED_STARTS] = len(dropped)


_SKIPPED_STARTS = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say what ``--skip-start-method`` left out, where ``.ci/run`` collects what a run did not
    prove (lines starting with ``DESELECTED``)."""
    methods = sorted(config.getoption(SKIP_START_OPTION.lstrip("-").replace("-", "_")))
    if methods:
        terminalreporter.write_line(
            f"DESELECTED {config.stash.get(_SKIPPED_STARTS, 0)} cases whose start method is "
            f"{' or '.join(methods)} ({SKIP_START_OPTION})"
        )


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child interpreter that imports ``tests`` and the
    package from the checkout (the repository root first on ``PYTHONPATH``), plus ``extra``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def start_kwargs(method: str) -> dict[str, Any]:
    """``ManagedParallelEnv`` kwargs that start workers by ``method`` (one of WORKER_STARTS)."""
    return {} if method == "preloaded" else {"mp_start_method": method}


def _key(proc: psutil.Process) -> tuple[int, float] | None:
    from torchrl_ext._identity import key_of  # the library's identity: no clock step moves it

    return key_of(proc)


def _is_helper(proc: psutil.Process) -> bool:
    """multiprocessing's own helpers and our preloaded fork server, which live as long as
    this process (the session fixture stops the server); never their children (a forked
    child shows its server's command line)."""
    from torchrl_ext import _forkserver

    key = _key(proc)
    if key is not None and key == _forkserver.server_key():
        return True
    try:
        cmd = " ".join(proc.cmdline())
        parent = proc.ppid()
    except psutil.Error:
        return False
    return parent == os.getpid() and any(h in cmd for h in _PERSISTENT_HELPERS)


@pytest.fixture(autouse=True)
def reaper_stops_at_last_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reaper normally lingers 2 s after the last env closed (so that the next env reuses
    it); the leak fixture would wait that out after every test. Its own test sets it back."""
    from torchrl_ext import _reaper_client

    monkeypatch.setattr(_reaper_client, "LINGER", 0.0)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the preloaded fork server once collection is done, outside any test: pytest's
    faulthandler arms a watchdog thread during each test (``faulthandler_timeout``), and a
    process with a second thread cannot fork its server (NOTE [zygote]). Here the process is
    single-threaded, so the in-process tests on the default path use a zygote, as a program
    that calls ``torchrl_ext.start_fork_server()`` early does. The interpreter server stays
    tested in child interpreters (``interpreter``, TORCHRL_EXT_ZYGOTE=0) and tests/test_zygote.py."""
    if os.environ.get("TORCHRL_EXT_ZYGOTE") == "0" or not session.items or session.config.option.collectonly:
        return
    import torchrl_ext

    torchrl_ext.start_fork_server()


@pytest.fixture(scope="session", autouse=True)
def preloaded_server_ends() -> Iterator[None]:
    """The preloaded fork server outlives single tests (it is started once per process, as
    multiprocessing's own); at the end of the session it must stop and leave nothing."""
    yield
    from torchrl_ext import _forkserver

    key = _forkserver.server_key()
    _forkserver.stop()
    if key is not None:
        wait_until(lambda: not pid_alive(key[0]), "the preloaded fork server stopped", timeout=10)


def _tagged_strangers(before: set[tuple[int, float]]) -> list[psutil.Process]:
    """Processes anywhere on the machine that carry our session or one of our env tags."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        owner = env.get("TORCHRL_EXT_OWNER", "")
        ours = env.get(SESSION_VAR) == SESSION or owner.startswith(f"{me}:")
        if ours and _key(proc) not in before and not _is_helper(proc):
            found.append(proc)
    return found


def process_keys() -> set[tuple[int, float]]:
    """The ``before`` that ``leftovers`` compares against: this process's descendants and the
    tagged processes elsewhere, now. Tagged processes that are not descendants include the
    shell that started pytest wherever the tag is exported to it (``make test-torchrl015``'s
    recipe runs pytest under ``sh -c``): a baseline of descendants only counts it as a leak."""
    keys = {k for k in (_key(p) for p in psutil.Process().children(recursive=True)) if k is not None}
    return keys | {k for k in (_key(p) for p in _tagged_strangers(set())) if k is not None}


def _late_reaper(proc: psutil.Process, before: set[tuple[int, float]]) -> bool:
    """The reaper of a shim that is in ``before``: the reaper script forks the reaper only
    after its imports, which on a loaded machine can end after the next test took its
    baseline (a module-scoped env's reaper then appeared as that test's leak). The reaper
    ends with its shim, which the baseline already holds; see torchrl_ext/_reaper.py."""
    from torchrl_ext import _reaper_client

    handle = _reaper_client._handle
    if handle is None:
        return False
    try:
        parent = proc.parent()
    except psutil.Error:
        return False
    return parent is not None and parent.pid == handle.pid and _key(parent) in before


def leftovers(before: set[tuple[int, float]]) -> tuple[list[psutil.Process], list[psutil.Process]]:
    me = psutil.Process()
    live, zombies = [], []
    for proc in me.children(recursive=True):
        if _key(proc) in before or _is_helper(proc) or _late_reaper(proc, before):
            continue
        try:
            status = proc.status()
        except psutil.Error:
            continue
        (zombies if status == psutil.STATUS_ZOMBIE else live).append(proc)
    for proc in _tagged_strangers(before):
        if proc not in live:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    live.append(proc)
            except psutil.Error:
                continue
    return live, zombies


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for proc in procs:
        try:
            out.append(
                f"pid {proc.pid} ppid {proc.ppid()} {proc.status()} {' '.join(proc.cmdline())[:120]!r}"
            )
        except psutil.Error:
            out.append(f"pid {proc.pid} (gone)")
    return "; ".join(out)


def _runtime_dirs() -> set[Path]:
    """The library's per-owner runtime directories (reaper FIFO, reports, done FIFOs) that
    should be gone: this process's own, and those of owners that have exited (their reaper
    removes them). Directories of other live processes on the machine are not counted."""
    me = os.getpid()
    found = set()
    for path in Path(tempfile.gettempdir()).glob("torchrl_ext-[0-9]*-*"):
        owner = int(path.name.split("-")[1])
        if owner == me or not _owner_alive(owner, path):
            found.add(path)
    return found


def _owner_alive(pid: int, runtime_dir: Path) -> bool:
    """Whether the owner of ``runtime_dir`` lives: a process ``pid`` that was born before the
    directory last changed. One born after it holds a dead owner's reused pid: counting it as
    the owner hid the dead owner's directory from the test that left it and blamed a later one."""
    try:
        changed = runtime_dir.stat().st_mtime
        return psutil.Process(pid).create_time() <= changed + 1.0
    except (OSError, psutil.Error):
        return False


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it leaves a live descendant, a zombie child, a tagged process or a
    runtime directory (``$TMPDIR/torchrl_ext-<owner pid>-*``) of an owner it started."""
    before = process_keys()
    dirs_before = _runtime_dirs()
    yield
    found: dict[str, Any] = {}

    def clean() -> bool:
        found["live"], found["zombies"] = leftovers(before)
        found["dirs"] = _runtime_dirs() - dirs_before
        return not found["live"] and not found["zombies"] and not found["dirs"]

    try:
        wait_until(clean, "every process and runtime directory of the test is gone", timeout=10.0)
        return
    except WaitTimeout:
        pass
    live, zombies, new_dirs = found["live"], found["zombies"], found["dirs"]
    for path in new_dirs:
        shutil.rmtree(path, ignore_errors=True)
    if not live and not zombies:
        pytest.fail(f"test left runtime directories: {sorted(map(str, new_dirs))}")
    message = f"test leaked processes: live=[{_describe(live)}] zombies=[{_describe(zombies)}]"
    for proc in live:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(live, timeout=5)
    for proc in zombies + live:
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    pytest.fail(message)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` and every descendant, and wait up to ``timeout`` s for them."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_table() -> dict[int, str]:
    """This process's open descriptors and what each refers to (``readlink``)."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return table


def fd_growth(before: dict[int, str]) -> str:
    """What is open now that was not in ``before`` (for an assertion's message), and which
    threads run: a descriptor held by a thread that outlived its owner shows with the thread."""
    now = fd_table()
    new = {fd: target for fd, target in now.items() if before.get(fd) != target}
    threads = sorted(t.name for t in threading.enumerate())
    return f"{len(before)} -> {len(now)} descriptors; new: {new}; threads: {threads}"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture
def restore_start_method() -> Iterator[None]:
    """Multi-collectors set the process-wide start method when it is unset; unset it again."""
    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)


@pytest.fixture
def make_env_fn() -> Any:
    from tests.envs import make_env

    def factory(**kwargs: Any) -> Any:
        return functools.partial(make_env, **kwargs)

    return factory


# --------------------------------------------------------------------------- child interpreters
@dataclass
class ScenarioResult:
    returncode: int
    survivors: list[dict[str, Any]]
    leaked: list[dict[str, Any]]
    stdout: str
    stderr: str
    seen_before_death: list[dict[str, Any]]
    #: pid -> exit code (negative: the signal) of each process the harness reaped.
    exit_codes: dict[int, int]

    @property
    def slowest_exit(self) -> float:
        return max((float(s.get("last_seen_after", 0.0)) for s in self.survivors), default=0.0)


class Scenario:
    """Runs ``python -m tests.scenarios NAME ...`` under ``tests/harness.py`` with a hard timeout."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.proc: subprocess.Popen[str] | None = None
        self.ready_file = tmp_path / "ready.json"
        self.out = tmp_path / "harness.json"

    def start(
        self,
        name: str,
        *args: str,
        linger: float = 10.0,
        module: str = "tests.scenarios",
        env_vars: dict[str, str] | None = None,
        script: Path | None = None,
    ) -> None:
        """Run ``python -m module NAME ...``, or ``python script NAME ...`` (a ``__main__``
        with a path, as a user's program)."""
        env = child_env(**(env_vars or {}))
        program = [str(script)] if script is not None else ["-m", module]
        cmd = [
            sys.executable,
            str(ROOT / "tests" / "harness.py"),
            str(self.out),
            str(linger),
            "--",
            sys.executable,
            *program,
            name,
            "--ready",
            str(self.ready_file),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        assert self.proc is not None
        proc = self.proc

        def ready() -> dict[str, Any] | None:
            if self.ready_file.exists():
                try:
                    return json.loads(self.ready_file.read_text())  # type: ignore[no-any-return]
                except ValueError:
                    pass  # written by os.replace; a partial write cannot be seen, but be safe
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"scenario ended before ready (rc {proc.returncode}):\n{out}\n{err}")
            return None

        try:
            return wait_until(ready, "the scenario wrote its ready file", timeout=timeout)
        except WaitTimeout:
            self.kill()
            out, err = proc.communicate()
            raise AssertionError(
                f"scenario never became ready in {timeout:g} s:\n{out}\n{err[-4000:]}"
            ) from None

    def wait_seen(self, pids: Iterable[int], timeout: float = 60.0) -> None:
        """Wait until the harness has seen every process of ``pids`` among the scenario's
        descendants (it looks every 20 ms): a test that kills the scenario's main process right
        after its processes announced themselves could otherwise kill it before the harness
        saw the newest, and ``seen_before_death`` would lack it."""
        wanted = set(pids)
        seen_file = Path(f"{self.out}.seen")

        def seen_all() -> bool:
            try:
                return wanted <= set(json.loads(seen_file.read_text()))
            except (OSError, ValueError):
                return False

        wait_until(seen_all, f"the harness saw processes {sorted(wanted)}", timeout=timeout)

    def finish(self, timeout: float = 120.0) -> ScenarioResult:
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"scenario hung (hard timeout {timeout}s):\n{out}\n{err}") from None
        data = json.loads(self.out.read_text())
        return ScenarioResult(
            data["returncode"],
            data["survivors"],
            data["leaked"],
            out,
            err,
            data.get("seen_before_death", []),
            {int(pid): int(code) for pid, code in data.get("exit_codes", {}).items()},
        )

    def kill(self) -> None:
        if self.proc is None:
            return
        kill_tree(self.proc.pid, timeout=5.0)
        self.proc.wait()


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Scenario]:
    s = Scenario(tmp_path)
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.kill()
