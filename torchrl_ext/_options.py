"""The options of one ``ManagedParallelEnv``: one frozen dataclass, validated once.

:data:`DEFAULTS` declares every option with its default; ``ManagedParallelEnv.__init__`` names
the same options in its signature (the documented API; a test checks the two agree) and hands
them here by name. An env pickled (sent to a collector worker) carries its :class:`Options` as
they are.
"""

from __future__ import annotations

import multiprocessing
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._compat import UPSTREAM_DEFAULTS, torchrl_release
from ._done_signal import DEFAULT_SPIN
from ._policy import DEFAULT_RESTART_BACKOFF, RestartRecord, parse_bytes

__all__ = ["ACCEPTED", "DEFAULTS", "DEFAULT_SHUTDOWN_TIMEOUT", "Options"]

#: As the installed TorchRL: 10 s (TorchRL 0.10 hard-codes the same wait).
DEFAULT_SHUTDOWN_TIMEOUT: float = UPSTREAM_DEFAULTS["shutdown_timeout"]

#: Every option and its default, as ``ManagedParallelEnv.__init__`` declares them (keyword-only).
DEFAULTS: dict[str, Any] = {
    "daemon_workers": None,
    "daemon": None,
    "shutdown_timeout": None,
    "handle_signals": True,
    "reap_orphans": True,
    "metadata_in_subprocess": None,
    "spin_wait": None,
    "exit_with_parent": None,
    "preload": True,
    "child_start_method": None,
    "max_restarts": 0,
    "restart_window": None,
    "step_timeout": None,
    "restart_on_error": False,
    "restart_backoff": DEFAULT_RESTART_BACKOFF,
    "on_restart": None,
    "start_timeout": None,
    "recycle_memory": None,
    "recycle_every": None,
    "collect_stats": True,
    "envs_per_worker": 1,
}


@dataclass(frozen=True)
class Options:
    """What the user asked of one env, resolved and checked (see ``ManagedParallelEnv``).

    Example:
        >>> Options.validated(max_restarts=2).supervised_wait
        True
        >>> Options.validated(step_timeout="5")
        Traceback (most recent call last):
        ...
        ValueError: step_timeout must be None or a number of seconds > 0, got '5' (str)
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
    #: Envs stepped by one worker process (``_hosts``); 1: one process per env, as upstream.
    envs_per_worker: int = 1

    @classmethod
    def validated(cls, **arguments: Any) -> Options:
        """Check and resolve the options as ``ManagedParallelEnv`` takes them (by name; the
        others take their :data:`DEFAULTS`); raise ``ValueError`` naming the parameter to change
        and what it accepts (:data:`ACCEPTED`)."""
        unknown = sorted(set(arguments) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"not options of ManagedParallelEnv: {unknown}")
        given = {**DEFAULTS, **arguments}
        for name, value in given.items():
            accepts, check = ACCEPTED[name]
            if not check(value):
                raise ValueError(f"{name} must be {accepts}, got {value!r} ({type(value).__name__})")
        methods = multiprocessing.get_all_start_methods()
        child_start_method = given["child_start_method"]
        if child_start_method is not None and child_start_method not in methods:
            raise ValueError(
                f"child_start_method={child_start_method!r} is not a start method here; "
                f"choose one of {methods} or None"
            )
        recycle_memory = given["recycle_memory"]
        if recycle_memory is not None:
            recycle_memory = parse_bytes(recycle_memory, "recycle_memory")
            if not given["collect_stats"]:
                raise ValueError(
                    "recycle_memory needs the memory the supervisor samples: pass collect_stats=True "
                    "(the default), or use recycle_every"
                )
        envs_per_worker = int(given["envs_per_worker"])
        if envs_per_worker > 1 and torchrl_release() < (0, 11):
            raise ValueError(
                f"envs_per_worker={envs_per_worker} needs TorchRL >= 0.11 (its workers answer through "
                "shared flags); this is TorchRL 0.10: pass envs_per_worker=1"
            )
        if envs_per_worker > 1 and (
            given["recycle_memory"] is not None or given["recycle_every"] is not None
        ):
            raise ValueError(
                f"envs_per_worker={envs_per_worker} cannot be combined with recycle_memory/recycle_every "
                "(a recycled worker process holds one env): pass envs_per_worker=1 to recycle workers"
            )
        resolved = _resolve_daemon(given["daemon_workers"], given["daemon"])
        metadata_in_subprocess = given["metadata_in_subprocess"]
        shutdown_timeout = given["shutdown_timeout"]
        preload = given["preload"]
        return cls(
            daemon_workers=resolved,
            shutdown_timeout=float(
                DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout
            ),
            handle_signals=given["handle_signals"],
            reap_orphans=given["reap_orphans"],
            metadata_in_subprocess=not resolved if metadata_in_subprocess is None else metadata_in_subprocess,
            spin_wait=_seconds(given["spin_wait"]),
            exit_with_parent=given["exit_with_parent"],
            preload=preload if isinstance(preload, bool) else tuple(preload),
            child_start_method=child_start_method,
            max_restarts=int(given["max_restarts"]),
            restart_window=_seconds(given["restart_window"]),
            step_timeout=_seconds(given["step_timeout"]),
            restart_on_error=_error_types(given["restart_on_error"]),
            restart_backoff=_backoff(given["restart_backoff"]),
            on_restart=given["on_restart"],
            start_timeout=_seconds(given["start_timeout"]),
            recycle_memory=recycle_memory,
            recycle_every=None if given["recycle_every"] is None else int(given["recycle_every"]),
            collect_stats=given["collect_stats"],
            envs_per_worker=envs_per_worker,
        )

    @property
    def spin(self) -> float:
        """What the wait uses: ``spin_wait`` with its default resolved."""
        return DEFAULT_SPIN if self.spin_wait is None else self.spin_wait

    @property
    def command_spin(self) -> float:
        """How long a worker on the managed step path spins for its next command: ``spin``,
        except 0 under TorchRL's own wait (``float("inf")``), whose workers sleep on the pipe."""
        return 0.0 if self.spin == float("inf") else self.spin

    @property
    def recycling(self) -> bool:
        """Whether workers are recycled at episode boundaries (``recycle_memory``/``_every``)."""
        return self.recycle_memory is not None or self.recycle_every is not None

    @property
    def replaceable_workers(self) -> bool:
        """Whether workers may be replaced (restarts or recycling): the start records them."""
        return self.max_restarts > 0 or self.recycling

    @property
    def supervised_wait(self) -> bool:
        """Our own wait loop (restarts, hang detection, recycling) instead of TorchRL's."""
        return self.replaceable_workers or self.step_timeout is not None

    def answer_limit(self, pipe_timeout: float) -> float:
        """How long a worker may take to answer one command: ``step_timeout``, else TorchRL's
        wait (``pipe_timeout``); replacements' and standbys' seeds and resets are bounded by it."""
        return pipe_timeout if self.step_timeout is None else self.step_timeout

    def describe_answer_limit(self, pipe_timeout: float) -> str:
        """:meth:`answer_limit` as a warning names it: the parameter that set it."""
        if self.step_timeout is not None:
            return f"step_timeout={self.step_timeout:g}s"
        return f"{pipe_timeout:g}s (TorchRL's pipe_timeout)"

    def start_limit(self, pipe_timeout: float) -> float:
        """How long a worker may take to build its env: ``start_timeout``, else TorchRL's wait."""
        return pipe_timeout if self.start_timeout is None else self.start_timeout

    @property
    def raises_env_errors(self) -> bool:
        """Whether every exception an env raises in a worker is raised in the main process: not
        with restarts on errors (a restarted one is not raised), nor with recycling (a standby
        that fails only makes a warning)."""
        restarted = self.max_restarts > 0 and self.restart_on_error is not False
        return not restarted and not self.recycling

    @property
    def extra_preload(self) -> tuple[str, ...]:
        """Modules the user asked the preloaded server to import besides the factory's."""
        return self.preload if isinstance(self.preload, tuple) else ()


# --------------------------------------------------------------------------- what each option accepts
def _is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` is not a number of seconds)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    return _is_number(value) and value > 0


def _or_none(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_flag(value: Any) -> bool:
    return isinstance(value, bool)


def _is_error_types(value: Any) -> bool:
    """``restart_on_error``: a bool, an exception type, or a non-empty tuple of them."""
    if isinstance(value, bool):
        return True
    types = value if isinstance(value, tuple) else (value,)
    return bool(types) and all(isinstance(t, type) and issubclass(t, BaseException) for t in types)


def _is_backoff(value: Any) -> bool:
    """``restart_backoff``: ``(first, cap)`` seconds, ``0 <= first <= cap``."""
    if not isinstance(value, tuple | list) or len(value) != 2 or not all(map(_is_number, value)):
        return False
    first, cap = value
    return bool(0 <= first <= cap)


def _is_module_list(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and all(isinstance(name, str) and name for name in value)
    )


_SECONDS = "None or a number of seconds > 0"
_OPTIONAL_FLAG = "None, True or False"

#: What each option of ``ManagedParallelEnv`` accepts: its description in the error message,
#: and the check. Every option has one (``Options.validated`` looks each one up); a value that
#: passes may still be refused for what it says (an unknown start method, a size string that
#: does not parse), by a message of its own.
ACCEPTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "daemon_workers": (_OPTIONAL_FLAG, _or_none(_is_flag)),
    "daemon": (_OPTIONAL_FLAG, _or_none(_is_flag)),
    "shutdown_timeout": (_SECONDS, _or_none(_is_seconds)),
    "handle_signals": ("True or False", _is_flag),
    "reap_orphans": ("True or False", _is_flag),
    "metadata_in_subprocess": (_OPTIONAL_FLAG, _or_none(_is_flag)),
    "spin_wait": (
        "None or a number of seconds >= 0 (0: never spin; float('inf'): TorchRL's own wait)",
        _or_none(lambda value: _is_number(value) and value >= 0),
    ),
    "exit_with_parent": (_OPTIONAL_FLAG, _or_none(_is_flag)),
    "preload": (
        "True, False or a list of module names (such as ['my_project.envs'])",
        lambda value: isinstance(value, bool) or _is_module_list(value),
    ),
    "child_start_method": (
        "None or a start method name such as 'fork'",
        _or_none(lambda v: isinstance(v, str)),
    ),
    "max_restarts": ("an int >= 0", lambda value: _is_int(value) and value >= 0),
    "restart_window": (_SECONDS, _or_none(_is_seconds)),
    "step_timeout": (_SECONDS, _or_none(_is_seconds)),
    "restart_on_error": (
        "True, False, an exception type or a tuple of them (as `except` takes)",
        _is_error_types,
    ),
    "restart_backoff": ("None or (first, cap) seconds with 0 <= first <= cap", _or_none(_is_backoff)),
    "on_restart": ("None or a callable taking a RestartRecord", _or_none(callable)),
    "start_timeout": (_SECONDS, _or_none(_is_seconds)),
    "recycle_memory": (
        "None, a number of bytes > 0 or a size such as '4GiB'",
        _or_none(lambda value: _is_int(value) or isinstance(value, str)),
    ),
    "recycle_every": (
        "None or an int >= 1 (episodes)",
        _or_none(lambda value: _is_int(value) and value >= 1),
    ),
    "collect_stats": ("True or False", _is_flag),
    "envs_per_worker": ("an int >= 1", lambda value: _is_int(value) and value >= 1),
}


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


def _error_types(
    value: bool | type[BaseException] | tuple[type[BaseException], ...],
) -> bool | tuple[type[BaseException], ...]:
    """``restart_on_error`` (checked): a bool, or the exception types as a tuple."""
    if isinstance(value, bool):
        return value
    return value if isinstance(value, tuple) else (value,)


def _backoff(value: Sequence[float] | None) -> tuple[float, float] | None:
    """``restart_backoff`` (checked): ``None`` or ``(first, cap)`` as floats."""
    if value is None:
        return None
    first, cap = value
    return float(first), float(cap)


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
