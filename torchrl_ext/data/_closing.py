"""One base for the data objects that hold workers or threads: an idempotent ``close()``, a
context manager, and a best-effort close when collected."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closing"]


class Closing:
    """Subclasses define ``close()`` (idempotent); ``with`` closes on exit, collection closes
    too (:meth:`_close_when_collected`, errors ignored: module globals may be gone).

    Example:
        >>> class Resource(Closing):
        ...     _closed = False
        ...     def close(self) -> None:
        ...         self._closed = True
        >>> with Resource() as r:
        ...     r.closed
        False
        >>> r.closed
        True
    """

    _closed: bool

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def close(self) -> None:
        raise NotImplementedError

    def _close_when_collected(self) -> None:
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Plain try/except, not contextlib.suppress: module globals may be gone at teardown.
        try:
            self._close_when_collected()
        except Exception:  # pragma: no cover - best effort during interpreter teardown
            pass
