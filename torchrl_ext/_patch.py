"""Scoped, nest-safe, thread-safe replacement of a module attribute (see ``_compat``'s rule)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ScopedPatch"]


class ScopedPatch:
    """Replace ``module.name`` while at least one scope is active; nest-safe and thread-safe.

    ``make(previous)`` builds the replacement from the value that was current on entry.

    Example:
        >>> import types
        >>> mod = types.SimpleNamespace(f=lambda: "theirs")
        >>> patch = ScopedPatch(mod, "f", lambda previous: lambda: "ours, then " + previous())
        >>> with patch.active():
        ...     mod.f()
        'ours, then theirs'
        >>> mod.f()
        'theirs'
    """

    def __init__(self, module: Any, name: str, make: Callable[[Any], Any]) -> None:
        self._module = module
        self._name = name
        self._make = make
        self._lock = threading.RLock()
        self._depth = 0
        self._previous: Any = None
        self._installed: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        with self._lock:
            if self._depth == 0:
                self._previous = getattr(self._module, self._name)
                self._installed = self._make(self._previous)
                setattr(self._module, self._name, self._installed)
            self._depth += 1
            installed = self._installed
        try:
            yield installed
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    if getattr(self._module, self._name) is self._installed:
                        setattr(self._module, self._name, self._previous)
                    self._previous = self._installed = None
