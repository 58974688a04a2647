"""The suite's own machinery (tests/conftest.py): ``--skip-start-method``, which the Makefile's
TorchRL 0.15 suite uses to leave the spawn cases to the main suite, and the leak fixture's rules."""

from __future__ import annotations

import subprocess
import sys

import psutil

from tests.conftest import ROOT, child_env, leftovers, process_keys
from tests.polling import wait_until
from torchrl_ext._identity import key_of


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_skip_start_method_deselects_exactly_the_cases_of_that_method() -> None:
    target = "tests/test_keywords.py::test_misspelt_keyword_raises_torchrl_type_error"
    full = _collect(target)
    assert full.returncode == 0, full.stdout + full.stderr
    every = {line for line in full.stdout.splitlines() if line.startswith(target)}
    spawned = {case for case in every if case.endswith("-spawn]")}
    assert spawned and spawned != every, every

    proc = _collect("--skip-start-method", "spawn", target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = {line for line in proc.stdout.splitlines() if line.startswith(target)}
    assert kept == every - spawned
    assert f"DESELECTED {len(spawned)} cases whose start method is spawn" in proc.stdout


def test_an_unknown_start_method_is_refused() -> None:
    proc = _collect("--skip-start-method", "spwan", "tests/test_keywords.py")
    assert proc.returncode != 0
    assert "spwan" in proc.stderr


def test_a_reaper_forked_after_the_baseline_by_an_earlier_shim_is_not_a_leftover() -> None:
    """The leak fixture's one exception for late processes: the reaper its shim (in the
    baseline) forked afterwards. A child of any other process in the baseline still counts."""
    from torchrl_ext import _reaper_client

    _reaper_client.acquire()
    other = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'input()'])"],
        stdin=subprocess.PIPE,
    )
    try:
        shim = psutil.Process(_reaper_client._handle.pid)  # type: ignore[union-attr]
        parent = psutil.Process(other.pid)
        wait_until(lambda: shim.children() and parent.children(), "both forked")
        reaper, unrelated = shim.children()[0], parent.children()[0]
        before = process_keys() - {key_of(reaper), key_of(unrelated)}  # as if both came after it
        live, zombies = leftovers(before)
        assert [p.pid for p in live] == [unrelated.pid] and not zombies
    finally:
        other.communicate(b"\n", timeout=60)
        _reaper_client.release()
