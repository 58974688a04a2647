"""NOTE [zygote] (``_forkserver``) and NOTE [fork-safe now] (``_platform``): the preloaded fork
server is a fork of the main process when that is provably safe at its start, and a new
interpreter, with one logged line naming the reason, when it is not. Each case runs
tests/zygote_script.py in a fresh interpreter (the server is one per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, child_env
from torchrl_ext import _platform

#: The line the fallback logs, before its reason.
FALLBACK = "the preloaded fork server starts as a new interpreter"


def _run(mode: str, tmp_path: Path, **env: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the script in ``mode``; its result and what each worker saw."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "zygote_script.py"), mode, str(tmp_path)],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    # Written once: no fork of the main process wrote its buffered output again.
    assert proc.stdout.count("printed once by the main process") == 1, proc.stdout
    workers = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("worker-*.json"))]
    return result, workers


def _fallback_lines(result: dict[str, Any]) -> list[str]:
    return [line for line in result["log"] if line.startswith(FALLBACK)]


@pytest.mark.parametrize("mode", ["plain", "early"])
def test_a_single_threaded_main_process_forks_its_server(mode: str, tmp_path: Path) -> None:
    """The default start in a fresh program: the server is a zygote, shown in ``stats()``; its
    workers draw distinct random numbers, and the main process's pipe is not held by them."""
    result, workers = _run(mode, tmp_path)
    assert result["start_method"] == "preloaded", result  # the default path
    assert result["kind"] == "zygote" and result["fallback"] is None, result
    assert result["server_zygote"] == 1
    assert not _fallback_lines(result)
    if mode == "early":
        assert result["early"] == "zygote"
    assert result["pipe_eof"], "a fork of the main process kept its pipe open"
    in_workers = [w for w in workers if w["pid"] in result["workers"]]
    assert len(in_workers) == 3, workers
    for source in ("torch", "numpy"):
        assert len({w[source] for w in in_workers}) == 3, (source, in_workers)
    # A fork: the worker has the main module itself, not a re-import of the script.
    assert {w["main"] for w in in_workers} == {str(ROOT / "tests" / "zygote_script.py")}


def test_the_zygote_drops_the_main_processs_handlers(tmp_path: Path) -> None:
    """The owner's Python signal handlers and exit handlers stay with the owner."""
    result, workers = _run("handlers", tmp_path)
    assert result["start_method"] == "preloaded" and result["kind"] == "zygote", result
    in_workers = [w for w in workers if w["pid"] in result["workers"]]
    assert in_workers and all("lambda" not in w["sigusr1"] for w in in_workers), in_workers
    # The workers' own SIGTERM handler is the library's worker handler, not the owner's lambda.
    assert all("lambda" not in w["sigterm"] for w in in_workers), in_workers
    ran = {int(p.name.split("-")[1]) for p in tmp_path.glob("atexit-*")}
    assert result["server_pid"] not in ran and not ran & set(result["workers"]), ran


@pytest.mark.parametrize(
    ("mode", "env", "reason"),
    [
        ("thread", {}, "other Python thread(s) run (user-thread)"),
        ("openmp", {}, "native thread(s) run besides this one"),
        ("plain", {_platform.ZYGOTE_VAR: "0"}, f"{_platform.ZYGOTE_VAR}=0 is set"),
        pytest.param(
            "cuda",
            {},
            "CUDA is initialised",
            marks=pytest.mark.skipif(
                not __import__("torch").cuda.is_available(), reason="needs a CUDA device"
            ),
        ),
    ],
)
def test_an_unsafe_main_process_falls_back_with_one_line(
    mode: str, env: dict[str, str], reason: str, tmp_path: Path
) -> None:
    """Each fork-safety check, made to fail: the server is a new interpreter, and one logged
    line names the reason; the env works as before."""
    result, workers = _run(mode, tmp_path, **env)
    assert result["start_method"] == "preloaded" and result["kind"] == "interpreter", result
    assert reason in result["fallback"], result
    assert result["server_zygote"] == 0
    lines = _fallback_lines(result)
    assert len(lines) == 1 and reason in lines[0], result["log"]
    assert len([w for w in workers if w["pid"] in result["workers"]]) == 3


def test_a_zygote_that_fails_before_its_report_falls_back_with_one_line(tmp_path: Path) -> None:
    """A zygote that dies before it reports its preload (not an import error: a crash of its
    own, injected) does not fail the start: the server is a new interpreter, one logged line
    names the reason, and the env works."""
    result, workers = _run("zygote_crash", tmp_path)
    assert result["start_method"] == "preloaded" and result["kind"] == "interpreter", result
    assert "the zygote failed before its preload report" in result["fallback"], result
    assert result["server_zygote"] == 0
    lines = _fallback_lines(result)
    assert len(lines) == 1 and "the zygote failed" in lines[0], result["log"]
    assert "start_fork_server" not in lines[0]  # no thread to blame
    assert len([w for w in workers if w["pid"] in result["workers"]]) == 3


def test_a_start_outside_the_main_thread_or_uncounted_threads_are_unsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked in this process: a start outside the main thread, and threads that cannot be
    counted (``/proc`` unreadable), are reasons too."""
    found: list[str | None] = []
    thread = threading.Thread(target=lambda: found.append(_platform.fork_unsafe_reason()))
    thread.start()
    thread.join()
    assert found == ["the start runs outside the main thread"]

    real = os.listdir

    def unreadable(path: Any = ".") -> list[str]:
        if path == "/proc/self/task":
            raise PermissionError(13, "Permission denied")
        return real(path)

    # Python threads are checked before the count: threads an earlier test left in this process
    # (multiprocessing's resource sharer serves for good once an fd was passed) are not seen here.
    monkeypatch.setattr(_platform.threading, "enumerate", lambda: [threading.current_thread()])
    monkeypatch.setattr(_platform.os, "listdir", unreadable)
    reason = _platform.fork_unsafe_reason()
    assert reason is not None and "cannot be counted" in reason, reason
