"""The options of one ``ManagedParallelEnv``: one frozen dataclass, validated once.

``ManagedParallelEnv.__init__`` names every option in its signature (the documented API) and
hands them here by name; nothing else lists them. An env pickled (sent to a collector worker)
carries its :class:`Options` as they are.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._compat import UPSTREAM_DEFAULTS
from ._done_signal import DEFAULT_SPIN
from ._policy import RestartRecord, parse_bytes

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "Options"]

#: As the installed TorchRL: 10 s (TorchRL 0.10 hard-codes the same wait).
DEFAULT_SHUTDOWN_TIMEOUT: float = UPSTREAM_DEFAULTS["shutdown_timeout"]


@dataclass(frozen=True)
class Options:
    """What the user asked of one env, resolved and checked (see ``ManagedParallelEnv``).

    Example:
        >>> Options.validated(max_restarts=2).own_wait
        True
        >>> Options.validated(step_timeout=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: step_timeout must be None or > 0 seconds, got -1.0
    """

    #: Resolved from ``daemon_workers``/``daemon`` and TorchRL's default.
    daemon_workers: bool
    shutdown_timeout: float
    handle_signals: bool
    reap_orphans: bool
    #: Resolved: ``None`` becomes ``not daemon_workers``.
    metadata_in_subprocess: bool
    spin_wait: float | None
    exit_with_parent: bool | None
    preload: bool | tuple[str, ...]
    child_start_method: str | None
    max_restarts: int
    restart_window: float | None
    step_timeout: float | None
    #: ``True``/``False``, or the exception types whose raise restarts a slot.
    restart_on_error: bool | tuple[type[BaseException], ...]
    #: ``(first, cap)`` seconds (see ``_policy.Backoff``); ``None``: never wait.
    restart_backoff: tuple[float, float] | None
    on_restart: Callable[[RestartRecord], Any] | None
    start_timeout: float | None
    #: Bytes (resolved from a string such as ``"4GiB"``).
    recycle_memory: int | None
    recycle_every: int | None
    collect_stats: bool

    @classmethod
    def validated(cls, **arguments: Any) -> Options:
        """Check and resolve the options as ``ManagedParallelEnv`` takes them (any of its
        keyword-only parameters, by name; the others take its defaults: its signature is the
        one list of the options); raise ``ValueError`` naming the parameter to change."""
        defaults = _defaults()
        unknown = sorted(set(arguments) - set(defaults))
        if unknown:
            raise TypeError(f"not options of ManagedParallelEnv: {unknown}")
        given = {**defaults, **arguments}
        daemon_workers, daemon = given["daemon_workers"], given["daemon"]
        shutdown_timeout, spin_wait = given["shutdown_timeout"], given["spin_wait"]
        max_restarts, restart_window = given["max_restarts"], given["restart_window"]
        step_timeout, child_start_method = given["step_timeout"], given["child_start_method"]
        preload, metadata_in_subprocess = given["preload"], given["metadata_in_subprocess"]
        if shutdown_timeout is None:
            shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT
        if not shutdown_timeout > 0:
            raise ValueError(f"shutdown_timeout must be positive, got {shutdown_timeout!r}")
        if spin_wait is not None and not spin_wait >= 0:
            raise ValueError(f"spin_wait must be None or >= 0 seconds, got {spin_wait!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if restart_window is not None and not restart_window > 0:
            raise ValueError(f"restart_window must be None or > 0 seconds, got {restart_window!r}")
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be None or > 0 seconds, got {step_timeout!r}")
        start_timeout = given["start_timeout"]
        if start_timeout is not None and not start_timeout > 0:
            raise ValueError(f"start_timeout must be None or > 0 seconds, got {start_timeout!r}")
        recycle_memory, recycle_every = given["recycle_memory"], given["recycle_every"]
        if recycle_memory is not None:
            recycle_memory = parse_bytes(recycle_memory, "recycle_memory")
            if not given["collect_stats"]:
                raise ValueError(
                    "recycle_memory needs the memory the supervisor samples: pass collect_stats=True "
                    "(the default), or use recycle_every"
                )
        if recycle_every is not None and (
            isinstance(recycle_every, bool) or not isinstance(recycle_every, int) or recycle_every < 1
        ):
            raise ValueError(f"recycle_every must be None or an int >= 1 (episodes), got {recycle_every!r}")
        on_restart = given["on_restart"]
        if on_restart is not None and not callable(on_restart):
            raise ValueError(
                f"on_restart must be None or a callable taking a RestartRecord, got {on_restart!r}"
            )
        methods = multiprocessing.get_all_start_methods()
        if child_start_method is not None and child_start_method not in methods:
            raise ValueError(
                f"child_start_method={child_start_method!r} is not a start method here; "
                f"choose one of {methods} or None"
            )
        resolved = _resolve_daemon(daemon_workers, daemon)
        return cls(
            daemon_workers=resolved,
            shutdown_timeout=float(shutdown_timeout),
            handle_signals=bool(given["handle_signals"]),
            reap_orphans=bool(given["reap_orphans"]),
            metadata_in_subprocess=not resolved
            if metadata_in_subprocess is None
            else bool(metadata_in_subprocess),
            spin_wait=spin_wait,
            exit_with_parent=given["exit_with_parent"],
            preload=bool(preload) if isinstance(preload, bool) else tuple(str(m) for m in preload),
            child_start_method=child_start_method,
            max_restarts=max_restarts,
            restart_window=None if restart_window is None else float(restart_window),
            step_timeout=None if step_timeout is None else float(step_timeout),
            restart_on_error=_error_types(given["restart_on_error"]),
            restart_backoff=_backoff(given["restart_backoff"]),
            on_restart=on_restart,
            start_timeout=None if start_timeout is None else float(start_timeout),
            recycle_memory=recycle_memory,
            recycle_every=recycle_every,
            collect_stats=bool(given["collect_stats"]),
        )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> Options:
        """:meth:`validated` with the options found in ``arguments`` (the caller's ``locals()``)."""
        names = _defaults()
        return cls.validated(**{name: value for name, value in arguments.items() if name in names})

    @property
    def spin(self) -> float:
        """What the wait uses: ``spin_wait`` with its default resolved."""
        return DEFAULT_SPIN if self.spin_wait is None else self.spin_wait

    @property
    def recycles(self) -> bool:
        """Whether workers are recycled at episode boundaries (``recycle_memory``/``_every``)."""
        return self.recycle_memory is not None or self.recycle_every is not None

    @property
    def replaces(self) -> bool:
        """Whether workers may be replaced (restarts or recycling): the start records them."""
        return self.max_restarts > 0 or self.recycles

    @property
    def own_wait(self) -> bool:
        """Our own wait loop (restarts, hang detection, recycling) instead of TorchRL's."""
        return self.replaces or self.step_timeout is not None

    @property
    def extra_preload(self) -> tuple[str, ...]:
        """Modules the user asked the preloaded server to import besides the factory's."""
        return self.preload if isinstance(self.preload, tuple) else ()


def _error_types(value: Any) -> bool | tuple[type[BaseException], ...]:
    """``restart_on_error``: a bool, an exception type, or a tuple of them (as ``except`` takes)."""
    if isinstance(value, bool):
        return value
    types = value if isinstance(value, tuple) else (value,)
    if not types or not all(isinstance(t, type) and issubclass(t, BaseException) for t in types):
        raise ValueError(
            "restart_on_error must be True, False, an exception type or a tuple of them "
            f"(as `except` takes), got {value!r}"
        )
    return types


def _backoff(value: Any) -> tuple[float, float] | None:
    """``restart_backoff``: ``None`` or ``(first, cap)`` seconds, ``0 <= first <= cap``."""
    if value is None:
        return None
    try:
        first, cap = (float(v) for v in value)
    except (TypeError, ValueError):
        first = cap = -1.0
    if not 0 <= first <= cap:
        raise ValueError(
            f"restart_backoff must be None or (first, cap) seconds with 0 <= first <= cap, got {value!r}"
        )
    return first, cap


def _resolve_daemon(daemon_workers: bool | None, daemon: bool | None) -> bool:
    if daemon_workers is not None and daemon is not None and bool(daemon_workers) != bool(daemon):
        raise ValueError(
            f"daemon_workers={daemon_workers!r} and daemon={daemon!r} disagree; `daemon` is an alias "
            "of `daemon_workers`: pass only one (daemon_workers=False lets workers have children)."
        )
    if daemon_workers is not None:
        return bool(daemon_workers)
    if daemon is not None:
        return bool(daemon)
    return bool(UPSTREAM_DEFAULTS["daemon"])


@functools.cache
def _defaults() -> dict[str, Any]:
    """The options and their defaults: ``ManagedParallelEnv``'s keyword-only parameters."""
    from ._env import ManagedParallelEnv  # the env imports this module

    parameters = inspect.signature(ManagedParallelEnv.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
