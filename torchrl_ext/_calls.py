"""Around each call of a managed env: the failure check before it, TorchRL's wait inside it
(ours with restarts, ``step_timeout`` or recycling), the translation of what escaped it, and its
measurement for ``stats()``. The env's overrides delegate here; ``env`` is the env itself (its
state is ``env._state``, an ``_start.EnvState``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._compat import Upstream
from ._keeper import raise_failure
from ._stats import RESET, STEP_AND_MAYBE_RESET, EpisodeEnds
from ._supervisor import LOST_PIPE_WAIT, WorkerSupervisor

__all__ = ["check_failed", "guarded", "loaded", "measured", "seeded", "translate", "wait"]


def check_failed(env: Any) -> WorkerSupervisor | None:
    """Hot path, before each call: raise the env's failure, or (restarts) clear marks and
    replace the workers lost since the last call; no system call otherwise."""
    state = env._state
    supervisor: WorkerSupervisor | None = state.supervisor
    if supervisor is not None:
        failure = supervisor.failure()
        if failure is not None:
            raise_failure(failure)
        if state.keeper.pending(supervisor):
            state.keeper.between_calls(Upstream(env), supervisor)
    return supervisor


def translate(env: Any, err: Exception, supervisor: WorkerSupervisor | None) -> None:
    """``err`` escaped TorchRL: raise the worker's failure instead if a worker is gone
    (decided by the supervisor's facts, never by the message); else return. A closed pipe
    is seen a moment before the death itself, so it gets a short wait; with restarts on, a
    loss counts (its slot is replaced at the next call)."""
    supervisor = env._state.supervisor or supervisor
    if supervisor is None:
        return
    found = supervisor.failure(
        wait=LOST_PIPE_WAIT if isinstance(err, EOFError | OSError) else 0.0, losses=True
    )
    if found is not None:
        raise_failure(found)


def guarded(env: Any, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` (TorchRL's), between the failure check and the failure translation."""
    supervisor = check_failed(env)
    try:
        return call(*args)
    except Exception as err:
        translate(env, err, supervisor)
        raise


def wait(env: Any, workers_range: Any, upstream_wait: Callable[[Any], None]) -> None:
    """``_wait_for_workers``: ours or ``upstream_wait`` (TorchRL's), timed for ``stats()``."""
    state = env._state
    if not state.options.collect_stats:
        _wait(env, workers_range, upstream_wait)
        return
    calls = state.stats.calls
    if calls.in_flight == RESET:  # TorchRL waits for exactly the workers it asked to reset
        calls.asked = Upstream(env).slots(workers_range)
    t0 = time.perf_counter()
    try:
        _wait(env, workers_range, upstream_wait)
    finally:
        calls.wait_s += time.perf_counter() - t0


def _wait(env: Any, workers_range: Any, upstream_wait: Callable[[Any], None]) -> None:
    state = env._state
    supervisor = state.supervisor
    upstream = Upstream(env)
    if supervisor is not None and state.options.supervised_wait:
        state.keeper.wait(upstream, supervisor, workers_range, supervisor.done_signal)
        return
    flags = upstream.done_flags
    if supervisor is None or flags is None or not upstream.use_buffers or state.options.spin == float("inf"):
        upstream_wait(workers_range)
        return
    supervisor.done_signal.wait_for(
        flags, upstream.slots(workers_range), upstream.pipe_timeout, state.options.spin, supervisor.check
    )


def measured(env: Any, kind: str, call: Callable[..., Any], tensordict: Any) -> Any:
    """:func:`guarded`, recorded for ``stats()`` (``collect_stats``): its duration, and which
    workers reset in it. A call TorchRL makes inside a measured one (its
    ``step_and_maybe_reset`` without buffers steps and resets through ``_step`` and
    ``_reset``) is part of that one."""
    state = env._state
    calls = state.stats.calls
    if calls.in_flight is not None or not state.options.collect_stats:
        return guarded(env, call, tensordict)
    calls.begin(kind)
    t0 = time.perf_counter()
    try:
        out = guarded(env, call, tensordict)
    finally:
        calls.in_flight = None
    seconds = time.perf_counter() - t0
    if kind != STEP_AND_MAYBE_RESET:
        calls.end(kind, seconds)
        return out
    ends = calls.ends
    if ends is None:
        ends = calls.ends = EpisodeEnds(env)
    rows = ends.rows(env, out[0], tensordict)
    calls.end(kind, seconds, Upstream(env).slots(rows) if rows else ())
    return out


def seeded(env: Any, set_seed: Callable[[], Any]) -> Any:
    """``set_seed`` (TorchRL's, bound to its arguments); a worker lost while seeding is replaced
    and every worker seeded again; the seeds are remembered for later replacements."""
    supervisor = check_failed(env)
    keeper = env._state.keeper
    try:
        try:
            return set_seed()
        except Exception as err:
            if supervisor is not None and keeper.replaced_after(Upstream(env), supervisor, err):
                return set_seed()
            translate(env, err, supervisor)
            raise
    finally:
        keeper.remember_seeds(Upstream(env))


def loaded(env: Any, load_state_dict: Callable[[], Any]) -> None:
    """``load_state_dict`` (TorchRL's, bound): TorchRL waits out a lost worker's event and
    returns, so a loss seen after it raises (its state never arrived)."""
    load_state_dict()
    supervisor = env._state.supervisor
    if supervisor is not None and supervisor.restartable:
        lost = supervisor.failure(wait=0.0, losses=True)
        if lost is not None:
            raise_failure(lost)
