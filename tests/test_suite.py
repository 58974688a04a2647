"""The suite's own options: ``--skip-start-method`` (tests/conftest.py), which the Makefile's
TorchRL 0.15 suite uses to leave the spawn cases to the main suite."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, child_env


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
