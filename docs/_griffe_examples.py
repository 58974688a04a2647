"""Griffe extension used by the docs build (``mkdocs.yml``); not part of the package.

The package's docstrings head their doctests with ``Example:``. Griffe's Google-style parser
only knows the plural ``Examples:`` as an examples section and renders the singular as a
Markdown admonition, where ``>>>`` lines become nested block quotes and ``x["key"]`` looks
like a reference link (a warning, so a failure in strict mode). This extension renames the
heading before the docstring is parsed, so the doctests render as code.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_SINGULAR = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)


class ExampleHeadings(Extension):
    """Rewrite ``Example:`` section headings to ``Examples:``."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        _rename(obj)

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        # The root package is not passed to ``on_object``.
        _rename(pkg)


def _rename(obj: Object) -> None:
    docstring = obj.docstring
    if docstring is not None and "Example:" in docstring.value:
        docstring.value = _SINGULAR.sub(r"\g<indent>Examples:", docstring.value)
