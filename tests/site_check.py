"""Check a built static site: every image, script, stylesheet and link between its pages
resolves to a file of the site, and every ``#fragment`` to an element id of its target page.

``mkdocs build --strict`` checks the Markdown links it understands, but not raw HTML (an
``<img src>`` written by hand), nor what a theme or a plugin adds; this reads the HTML that is
actually shipped. Used by ``tests/test_docs_site.py``.

Example:
    >>> import tempfile, pathlib
    >>> site = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (site / "index.html").write_text('<h2 id="a">A</h2><a href="#a">a</a><img src="x.png">')
    >>> broken_references(site)
    ['index.html: x.png (no such file)']
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["broken_references"]

#: (tag, attribute) pairs whose value names another file of the site.
_REFERENCES = {("a", "href"), ("img", "src"), ("script", "src"), ("link", "href"), ("source", "src")}


class _Page(HTMLParser):
    """The element ids of one page and the references it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.references: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            if (tag, name) in _REFERENCES:
                self.references.append(value)


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _target(site: Path, page: Path, path: str) -> Path:
    """The file a site-relative ``path`` seen on ``page`` names (``dir/`` means its index)."""
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path).lstrip("/")).resolve()
    return target / "index.html" if target.is_dir() else target


def broken_references(site: Path) -> list[str]:
    """Every reference of every page of ``site`` that does not resolve, as ``page: reference
    (why)``; references to other hosts and other schemes (``https:``, ``mailto:``) are not
    followed."""
    site = site.resolve()
    pages = {path: _read(path) for path in sorted(site.rglob("*.html"))}
    broken = []
    for path, page in pages.items():
        for reference in page.references:
            parts = urlsplit(reference)
            if parts.scheme or parts.netloc:
                continue
            target = _target(site, path, parts.path) if parts.path else path
            where = f"{path.relative_to(site).as_posix()}: {reference}"
            if site not in target.parents and target != site:
                broken.append(f"{where} (outside the site)")
            elif not target.is_file():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _read(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no element with id {parts.fragment!r})")
    return broken
