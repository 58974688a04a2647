"""Every option of ``ManagedParallelEnv`` is checked when the env is built: a value of the wrong
type, or out of range, raises ``ValueError`` naming the option, what it accepts and what it got
(value and type), before anything starts. One table, which must name every option."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv
from torchrl_ext._options import ACCEPTED as _ACCEPTED
from torchrl_ext._options import DEFAULTS, Options

#: Refused values of each option: wrong types first, then values out of range.
REFUSED: dict[str, list[Any]] = {
    "daemon_workers": ["no", 0],
    "daemon": [1],
    "shutdown_timeout": ["10", True, 0, -1.0],
    "handle_signals": [None, "yes"],
    "reap_orphans": [1],
    "metadata_in_subprocess": ["no"],
    "spin_wait": ["0", -1.0, float("nan")],
    "exit_with_parent": [0],
    "preload": ["my_project.envs", None, [1], [""]],
    "child_start_method": [5],
    "max_restarts": ["2", 2.0, True, -1],
    "restart_window": ["60", 0],
    "step_timeout": ["5", True, 0, -1.0, float("nan")],
    "restart_on_error": ["yes", 1, ()],
    "restart_backoff": ["fast", ("0.1", "1"), (1.0,), (2.0, 1.0)],
    "on_restart": ["print"],
    "start_timeout": ["30", 0],
    "recycle_memory": [[1], 2.5, True],
    "recycle_every": ["10", 1.5, 0],
    "collect_stats": [None, 1],
    "envs_per_worker": ["2", 1.5, True, 0],
}

#: Values of other types than the defaults' that are accepted (numpy scalars, lists).
ACCEPTED: dict[str, Any] = {
    "step_timeout": np.float64(5.0),
    "start_timeout": 30,
    "max_restarts": np.int64(2),
    "restart_window": np.float32(60.0),
    "spin_wait": float("inf"),
    "preload": ["tests.envs"],
    "restart_backoff": [0, 1.0],
    "restart_on_error": (KeyError, TimeoutError),
    "recycle_every": np.int32(10),
    "recycle_memory": "4GiB",
    "child_start_method": "fork",
}


def _options() -> set[str]:
    parameters = inspect.signature(ManagedParallelEnv.__init__).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.compat
def test_the_table_names_every_option() -> None:
    assert set(REFUSED) == _options()


@pytest.mark.compat
def test_the_signature_declares_the_options_defaults_and_each_reaches_the_options() -> None:
    """The env's signature (what a user reads) and ``DEFAULTS`` (what ``Options`` resolves from)
    list the same options with the same defaults, and each one is checked by ``ACCEPTED``; an
    option given to the env reaches ``Options.validated`` (a refused value raises)."""
    parameters = inspect.signature(ManagedParallelEnv.__init__).parameters.values()
    declared = {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert declared == DEFAULTS
    assert set(_ACCEPTED) == set(DEFAULTS)
    assert Options.validated() == Options.validated(**DEFAULTS)


@pytest.mark.compat
@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name, values in REFUSED.items() for value in values], ids=repr
)
def test_a_refused_option_names_itself_and_what_it_accepts(name: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        ManagedParallelEnv(2, make_env, **{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be "), message
    assert message.endswith(f", got {value!r} ({type(value).__name__})"), message


@pytest.mark.compat
def test_values_of_other_accepted_types_pass() -> None:
    options = Options.validated(**ACCEPTED)
    assert options.step_timeout == 5.0 and type(options.step_timeout) is float
    assert options.max_restarts == 2 and type(options.max_restarts) is int
    assert options.preload == ("tests.envs",) and options.restart_backoff == (0.0, 1.0)
    assert options.recycle_every == 10 and options.recycle_memory == 4 << 30


@pytest.mark.compat
def test_the_step_timeout_of_the_issue() -> None:
    """``step_timeout="5"`` used to fail at the first comparison with a bare TypeError."""
    with pytest.raises(
        ValueError, match=r"^step_timeout must be None or a number of seconds > 0, got '5' \(str\)$"
    ):
        ManagedParallelEnv(2, make_env, step_timeout="5")


@pytest.mark.compat
def test_an_assigned_shutdown_timeout_reaches_every_holder_of_the_options() -> None:
    """``env.shutdown_timeout = x`` (upstream's attribute, read at the next start) is what the
    slot keeper and the recycler (which bounds a retiring worker's close by it) use."""
    env = ManagedParallelEnv(1, make_env, daemon_workers=False, recycle_every=2)
    try:
        env.shutdown_timeout = 3.0
        keeper = env._state.keeper
        assert env.shutdown_timeout == 3.0
        assert keeper.options.shutdown_timeout == keeper.recycler.options.shutdown_timeout == 3.0
    finally:
        env.close(raise_if_closed=False)
