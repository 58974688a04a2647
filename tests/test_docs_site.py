"""The built documentation site: ``mkdocs build --strict`` passes, and what it ships is whole.

The site is built once for this module (skipped only when mkdocs is not installed). Strict mode
checks the Markdown links it understands; :mod:`tests.site_check` reads the built HTML for what
it does not check (raw HTML, anchors of other pages, images), and the tests below prove that
check fails on each kind of break.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.site_check import broken_references

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install the dev extra to build the docs)")
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "mkdocs", "build", "--strict"),
            *("--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)),
        ],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def test_mkdocs_build_strict(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("ManagedParallelEnv", "WorkerDiedError", "EpisodeLoader", "ThreadPrefetcher"):
        assert name in api, f"the API reference does not document {name}"


def test_every_image_link_and_anchor_of_the_site_resolves(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) >= 10, pages
    broken = broken_references(site)
    assert not broken, "the built site has broken references:\n" + "\n".join(broken)
    assert (site / "assets" / "heavy_reset.png").is_file(), "the heavy-resets chart is not shipped"


def test_the_site_check_reports_each_kind_of_break(tmp_path: Path) -> None:
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "index.html").write_text('<h2 id="closing">Closing</h2>', encoding="utf-8")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG")
    (tmp_path / "index.html").write_text(
        '<img src="logo.png"><a href="guide/#closing">ok</a><a href="https://example.org/x">ext</a>'
        '<img src="../benchmarks/chart.png"><img src="missing.png">'
        '<a href="guide/#no-such-anchor">bad anchor</a><a href="nowhere/">bad page</a>',
        encoding="utf-8",
    )
    assert broken_references(tmp_path) == [
        "index.html: ../benchmarks/chart.png (outside the site)",
        "index.html: missing.png (no such file)",
        "index.html: guide/#no-such-anchor (no element with id 'no-such-anchor')",
        "index.html: nowhere/ (no such file)",
    ]


def test_the_shipped_chart_is_the_benchmarks_chart() -> None:
    """docs/assets/heavy_reset.png is the copy benchmarks/heavy_reset.py writes of its chart."""
    shipped = ROOT / "docs" / "assets" / "heavy_reset.png"
    chart = ROOT / "benchmarks" / "results" / "heavy_reset.png"
    assert shipped.read_bytes() == chart.read_bytes(), "rerun the benchmark or copy its chart"
