"""Look at a built site as a reader at 1400 px does: report every code block or table that must
be scrolled sideways (its content is wider than its box), using headless Chromium.

Not a test (CI machines have no browser): run it by hand after ``make docs`` and before
changing the stylesheet, and look at the screenshots it writes::

    python -m tests.site_layout site /tmp/layout    # needs /usr/bin/chromium (Debian: chromium)

Material's table wrapper reaches 0.8rem past the text column by design; that is not counted.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

WIDTH = 1400

#: Appended to every page of a copy of the site: once laid out, list what overflows its box.
_MEASURE = r"""<script>
window.addEventListener("load", function () { setTimeout(function () {
  var found = [];
  document.querySelectorAll(".md-typeset pre > code, .md-typeset__scrollwrap").forEach(function (e) {
    if (e.scrollWidth > e.clientWidth + 1)
      found.push(e.scrollWidth + " px in " + e.clientWidth + ": "
                 + e.textContent.slice(0, 70).replace(/\s+/g, " "));
  });
  var out = document.createElement("pre"); out.id = "layout-report";
  out.textContent = document.documentElement.scrollHeight + "\n" + found.join("\n");
  document.body.appendChild(out);
}, 500); });
</script>"""


def _chromium(*args: str) -> str:
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def overflowing(site: Path, shots: Path) -> dict[str, list[str]]:
    """Per page of ``site``: what overflows at WIDTH px; a full-page screenshot of each page goes
    to ``shots`` (pages longer than 16,000 px are cut there)."""
    copy = shots / "site"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(site, copy)
    report: dict[str, list[str]] = {}
    for page in sorted(copy.rglob("index.html")):
        page.write_text(page.read_text(encoding="utf-8").replace("</body>", _MEASURE + "</body>"), "utf-8")
        dom = _chromium(
            f"--window-size={WIDTH},1000", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()
        )
        match = re.search(r'<pre id="layout-report">(.*?)</pre>', dom, re.S)
        name = page.parent.relative_to(copy).as_posix().strip(".") or "index"
        if match is None:
            report[name] = ["no report: the page did not finish loading"]
            continue
        height, *found = html.unescape(match.group(1)).splitlines()
        report[name] = found
        shot = shots / f"{name.replace('/', '_')}.png"
        _chromium(
            f"--window-size={WIDTH},{min(int(height), 16000)}",
            "--virtual-time-budget=4000",
            f"--screenshot={shot}",
            page.as_uri(),
        )
    return report


if __name__ == "__main__":
    site, shots = Path(sys.argv[1]), Path(sys.argv[2])
    shots.mkdir(parents=True, exist_ok=True)
    problems = overflowing(site, shots)
    for name, found in problems.items():
        print(f"{name}: {len(found) or 'nothing'} clipped", *(f"\n    {f}" for f in found))
    sys.exit(1 if any(problems.values()) else 0)
