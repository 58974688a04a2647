"""The preloaded fork server, the default path (NOTE [preloaded fork server] in
``torchrl_ext/_forkserver.py``): what spawn gave for free stays true, the server is supervised
and replaced, a broken preload is named, and ``__main__`` factories work."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import Scenario, pid_alive, start_kwargs
from tests.envs import START_METHOD_CODES, make_env, make_probe_env
from tests.polling import wait_until
from torchrl_ext import ManagedParallelEnv, WorkerDiedError, _forkserver

ROOT = Path(__file__).resolve().parent.parent


def _first_observations(env: ManagedParallelEnv) -> torch.Tensor:
    try:
        return env.reset()["observation"]
    finally:
        env.close(raise_if_closed=False)


@pytest.mark.compat
@pytest.mark.parametrize("method", ["preloaded", pytest.param("spawn", marks=pytest.mark.compat)])
def test_unseeded_workers_draw_distinct_random_streams(method: str) -> None:
    """As under spawn: torch, numpy and ``random`` draw differently in every worker, and in the
    workers of a second env forked from the same server; CUDA is never initialised."""
    probe = functools.partial(make_probe_env)
    env = ManagedParallelEnv(3, probe, daemon_workers=False, **start_kwargs(method))
    assert env.start_method == method
    rows = [_first_observations(env)]
    if method == "preloaded":
        again = ManagedParallelEnv(3, probe, daemon_workers=False)
        rows.append(_first_observations(again))
    draws = torch.cat(rows)
    for column, source in enumerate(("torch", "numpy", "random")):
        values = draws[:, column].tolist()
        assert len(set(values)) == len(values), f"{source} draws repeat across workers: {values}"
    # What a DataLoader built in the worker would use: fork from the preloaded server (no
    # torch import per DataLoader worker), TorchRL's global spawn otherwise.
    expected = START_METHOD_CODES["fork" if method == "preloaded" else "spawn"]
    assert draws[:, 3].tolist() == [expected] * len(draws), "0 would mean CUDA was initialised"


def test_child_start_method_overrides_the_workers_default() -> None:
    probe = functools.partial(make_probe_env)
    env = ManagedParallelEnv(1, probe, daemon_workers=False, child_start_method="spawn")
    assert env.start_method == "preloaded"
    assert _first_observations(env)[0, 3].item() == START_METHOD_CODES["spawn"]
    with pytest.raises(ValueError, match="child_start_method='thread'"):
        ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False, child_start_method="thread")


def test_explicit_choices_win_over_the_server() -> None:
    """An explicit start method, ``preload=False`` or daemonic workers: no server involved."""
    fn = functools.partial(make_env)
    for kwargs in ({"mp_start_method": "fork"}, {"preload": False}, {"daemon_workers": True}):
        env = ManagedParallelEnv(1, fn, **({"daemon_workers": False} | kwargs))  # type: ignore[arg-type]
        assert env.start_method != "preloaded", kwargs
        assert env._mp_start_method == kwargs.get("mp_start_method")


def test_server_is_tagged_grouped_and_shared() -> None:
    fn = functools.partial(make_env)
    env = ManagedParallelEnv(2, fn, daemon_workers=False)
    other = ManagedParallelEnv(1, fn, daemon_workers=False)
    assert env.start_method == other.start_method == "preloaded"
    try:
        env.reset()
        other.reset()
        key = _forkserver.server_key()
        assert key is not None
        server = psutil.Process(key[0])
        tag = server.environ()["TORCHRL_EXT_OWNER"]
        assert tag.startswith(f"{os.getpid()}:") and tag.endswith(".forkserver"), tag
        assert os.getpgid(server.pid) == server.pid, "the server leads its own process group"
        assert server.ppid() == os.getpid()
        for pid in env.worker_pids + other.worker_pids:
            assert psutil.Process(pid).ppid() == server.pid, "every worker is a fork of the one server"
        assert env._mp_start_method is None, "TorchRL's attribute stays as the user left it"
    finally:
        env.close(raise_if_closed=False)
        other.close(raise_if_closed=False)


def test_dead_server_is_replaced_and_its_workers_reported(caplog: pytest.LogCaptureFixture) -> None:
    fn = functools.partial(make_env)
    env = ManagedParallelEnv(2, fn, daemon_workers=False, shutdown_timeout=5.0)
    assert env.start_method == "preloaded"
    try:
        env.reset()
        key = _forkserver.server_key()
        assert key is not None
        os.kill(key[0], signal.SIGKILL)  # its workers die with it (parent-death signal)
        wait_until(lambda: not any(pid_alive(p) for p in env.worker_pids), "the workers died with the server")
        with pytest.raises(WorkerDiedError):
            env.rollout(3)
    finally:
        env.close(raise_if_closed=False)
    caplog.set_level(logging.WARNING, logger="torchrl_ext")
    again = ManagedParallelEnv(1, fn, daemon_workers=False)
    try:
        assert again.reset()["observation"].shape == (1, 4)
    finally:
        again.close()
    replacement = _forkserver.server_key()
    assert replacement is not None and replacement != key
    assert any("fork server" in r.getMessage() and "exited" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("tests.no_such_module", "No module named 'tests.no_such_module'"),
        ("tests.preload_raises", "refuses"),
        # Dies without a report: the error says how, and names no module.
        ("tests.preload_exits", "exited with code 5 before importing"),
    ],
)
def test_broken_preload_names_the_module(scenario: Scenario, module: str, says: str) -> None:
    scenario.start("preload_error", "--method", "preloaded", "--preload", module, linger=5.0)
    ready = scenario.wait_ready(timeout=180)
    result = scenario.finish()
    assert result.returncode == 0, result.stderr
    assert not result.leaked
    assert says in ready["error"], ready["error"]
    if module != "tests.preload_exits":
        assert ready["module"] == module
        assert f"could not import {module!r}" in ready["error"], ready["error"]
    assert "mp_start_method='spawn'" in ready["error"], "the error says how to go without the server"


def test_main_defined_factories_work_and_exit_is_quiet(scenario: Scenario) -> None:
    """A function and a lambda defined in a script's ``__main__``, one env holding persistent
    DataLoader workers, the other building a DataLoader per reset; the second env is left
    open. Everything ends at exit, gracefully and without a resource_tracker warning."""
    scenario.start("preloaded", script=ROOT / "tests" / "main_factory_script.py", linger=5.0)
    ready = scenario.wait_ready(timeout=180)
    result = scenario.finish()
    assert result.returncode == 0, result.stderr
    assert ready["function"] == {"start_method": "preloaded", "steps": 3}
    assert ready["lambda"] == {"start_method": "preloaded", "steps": 3}
    assert ready["report"] == ["graceful", "graceful"]
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, result.stderr
    assert not result.leaked
    others = [s for s in result.survivors if "multiprocessing.resource_tracker" not in s["cmdline"]]
    assert not others, "the exit hook closed the env and stopped the fork server"


@pytest.mark.parametrize("kind", ["interpreter", "zygote"])
def test_unguarded_script_gets_the_main_guard_hint(scenario: Scenario, kind: str) -> None:
    """The interpreter server imports a script's ``__main__`` once, as spawn imports it in every
    worker: a script that builds an env at import fails at once with the fix, instead of
    recursing. A zygote is a fork of the script's process (NOTE [zygote]): as under fork, it
    imports nothing again, and the script runs."""
    env_vars = {"TORCHRL_EXT_ZYGOTE": "0"} if kind == "interpreter" else None
    scenario.start("preloaded", script=ROOT / "tests" / "unguarded_script.py", linger=5.0, env_vars=env_vars)
    result = scenario.finish(timeout=180)
    assert not result.leaked
    if kind == "zygote":
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1, result.stderr
    assert "PreloadError" in result.stderr and 'if __name__ == "__main__":' in result.stderr, result.stderr


# --------------------------------------------------------------------------- NOTE [authenticated server]
def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (what it sent before is read and dropped)."""
    try:
        while True:
            if not sock.recv(4096, socket.MSG_DONTWAIT):
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_unauthenticated_connections_fork_nothing_and_the_server_serves_on() -> None:
    """A client that sends a fork request without answering the challenge, and one that
    answers with a wrong key, get no process; the same server then forks real workers."""
    fn = functools.partial(make_env)
    env = ManagedParallelEnv(1, fn, daemon_workers=False)
    assert env.start_method == "preloaded"
    try:
        env.reset()
        key = _forkserver.server_key()
        address = _forkserver._SERVER.address
        assert key is not None and address is not None
        server = psutil.Process(key[0])
        children = {c.pid for c in server.children()}
        # CPython's own client: the fds at once, no answer to the challenge.
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)
            alive_r, alive_w = os.pipe()
            try:
                status_r, data_w = _forkserver.request_fork(client, alive_r, [])
            finally:
                os.close(alive_r)
                os.close(alive_w)
            client.shutdown(socket.SHUT_WR)
            try:
                wait_until(lambda: _closed_by_peer(client), "the server closed the connection")
                wait_until(lambda: select.select([status_r], [], [], 0)[0], "the request's pipe ended")
                assert os.read(status_r, 8) == b"", "the server sent a pid: it forked a process"
            finally:
                os.close(status_r)
                os.close(data_w)
        # A wrong key.
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)
            with pytest.raises(multiprocessing.AuthenticationError, match="refused"):
                _forkserver._authenticate(client, os.urandom(32))
        assert {c.pid for c in server.children()} == children, "no process was forked"
        other = ManagedParallelEnv(2, fn, daemon_workers=False)
        try:
            assert other.reset()["observation"].shape == (2, 4)
            assert _forkserver.server_key() == key, "the same server goes on serving"
            for pid in other.worker_pids:
                assert psutil.Process(pid).ppid() == server.pid
        finally:
            other.close(raise_if_closed=False)
    finally:
        env.close(raise_if_closed=False)


class _ExitWith:
    """What a fork request runs: ``multiprocessing``'s child calls its ``_bootstrap`` and exits
    with the code it returns."""

    def __init__(self, code: int) -> None:
        self.code = code

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        return self.code


def test_one_admitted_connection_carries_every_fork_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [one connection]: the owner answers the challenge once per server, not once per
    worker; an admitted connection carries several requests, and one that hangs up leaves the
    server serving."""
    fn = functools.partial(make_env)
    first = ManagedParallelEnv(1, fn, daemon_workers=False)
    assert first.start_method == "preloaded"
    first.close(raise_if_closed=False)  # the server runs on
    key, address = _forkserver._SERVER._authkey, _forkserver._SERVER.address
    assert key is not None and address is not None and _forkserver._SERVER._client is not None
    answered: list[socket.socket] = []
    real = _forkserver._authenticate
    monkeypatch.setattr(_forkserver, "_authenticate", lambda c, k: (answered.append(c), real(c, k))[1])
    env = ManagedParallelEnv(3, fn, daemon_workers=False)
    try:
        assert env.reset()["observation"].shape == (3, 4)
    finally:
        env.close(raise_if_closed=False)
    assert answered == [], "the workers were asked for over the connection already admitted"
    # A connection the server no longer serves is replaced, and answers the challenge again.
    kept = _forkserver._SERVER._client
    assert kept is not None
    kept.shutdown(socket.SHUT_RDWR)
    replaced = ManagedParallelEnv(1, fn, daemon_workers=False)
    try:
        assert replaced.reset()["observation"].shape == (1, 4)
    finally:
        replaced.close(raise_if_closed=False)
    assert len(answered) == 1 and _forkserver._SERVER._client is answered[0]
    server = _forkserver.server_key()
    assert server is not None
    # A second client, admitted, sends two requests on its connection; each gets a child that
    # runs what was sent to it (it exits with the code sent), then the client hangs up.
    alive_r, alive_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)
            real(client, key)
            for code in (5, 6):
                status_r, data_w = _forkserver.request_fork(client, alive_r, [])
                with open(data_w, "wb", closefd=True) as data:
                    data.write(pickle.dumps({}) + pickle.dumps(_ExitWith(code)))
                try:
                    wait_until(lambda r=status_r: select.select([r], [], [], 0)[0], "the server sent a pid")
                    assert multiprocessing.forkserver.read_signed(status_r) > 0
                    assert multiprocessing.forkserver.read_signed(status_r) == code
                finally:
                    os.close(status_r)
    finally:
        os.close(alive_r)
        os.close(alive_w)
    again = ManagedParallelEnv(2, fn, daemon_workers=False)
    try:
        assert again.reset()["observation"].shape == (2, 4)
        assert _forkserver.server_key() == server, "the same server goes on serving"
    finally:
        again.close(raise_if_closed=False)


def test_the_server_key_is_neither_on_its_command_line_nor_in_its_environment() -> None:
    env = ManagedParallelEnv(1, functools.partial(make_env), daemon_workers=False)
    assert env.start_method == "preloaded"
    try:
        env.reset()
        key, server = _forkserver._SERVER._authkey, _forkserver.server_key()
        assert key is not None and len(key) == 32 and server is not None
        for name in ("cmdline", "environ"):
            shown = Path(f"/proc/{server[0]}/{name}").read_bytes()
            assert shown, f"/proc/<pid>/{name} is readable"
            for form in (key, key.hex().encode(), key.hex().upper().encode(), repr(key).encode()):
                assert form not in shown, f"the server's key shows in its /proc/<pid>/{name}"
    finally:
        env.close(raise_if_closed=False)


def test_the_challenge_admits_the_key_only_and_logs_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    """Both ends of the handshake, in this process (the server's log goes nowhere by default)."""
    caplog.set_level(logging.DEBUG, logger="torchrl_ext")
    key = os.urandom(32)
    for client_key, admitted in ((key, True), (os.urandom(32), False), (None, False)):
        ours, theirs = socket.socketpair()
        errors: list[BaseException] = []

        def client(sock: socket.socket = theirs, k: bytes | None = client_key, out: list = errors) -> None:
            try:
                if k is None:
                    sock.close()  # connects and leaves without a word
                else:
                    _forkserver._authenticate(sock, k)
            except BaseException as exc:
                out.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        try:
            assert _forkserver._admit(ours, key) is admitted
        finally:
            ours.close()  # as the server's listener closes a refused connection
            thread.join(30)
            theirs.close()
        assert not thread.is_alive()
        if client_key is not None:
            assert bool(errors) is not admitted, errors
            assert all(isinstance(e, multiprocessing.AuthenticationError) for e in errors), errors
    refusals = [r for r in caplog.records if "failed to authenticate" in r.getMessage()]
    assert len(refusals) == 2 and all(r.levelno == logging.DEBUG for r in refusals)
