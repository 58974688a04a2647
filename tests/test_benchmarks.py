"""Every benchmark script still starts: its imports resolve and its arguments parse (``--help``).

A benchmark is run by hand, rarely; one whose import broke (a name that moved to another module)
would otherwise go unnoticed until the day its figures are needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: The scripts a user runs (the others are modules they import).
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_the_scripts_are_found() -> None:
    assert {"overhead.py", "restart.py", "restart_policy.py", "heavy_reset.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_starts(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        env=child_env(),
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
