"""The marked transition of a restarted slot: the done entries restarts add, writing and clearing them.

A slot whose worker was replaced answers its in-flight step with a transition marked as cut
short (docs/restarts.md): the next observation is the new env's reset observation, rewards are
0, ``done``/``truncated``/``worker_restarted`` are True and every other done entry False. The
marks live in ``"next"`` only; every reset clears what a partial reset may have copied to the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ._compat import Upstream

__all__ = ["RESTARTED_KEY", "add_restart_keys", "clear_marks", "clear_root_marks", "mark_transition"]

#: The done-spec entry that flags a transition cut short by a worker restart.
RESTARTED_KEY = "worker_restarted"

#: Done entries set on a marked transition (by their last name); every other done entry is False.
_TRUE_ON_MARK = frozenset({"done", "truncated", RESTARTED_KEY})


def add_restart_keys(env: Any) -> list[str]:
    """Add ``truncated`` (if missing) and :data:`RESTARTED_KEY` to a batched env's done spec and
    shared-buffer template, shaped like its root ``done``. Returns the keys added.

    The spec and the template are replaced by extended copies: TorchRL shares them with the
    env's metadata (and so with indexed views), which must keep describing the workers' env.
    """
    done_spec = env.output_spec["full_done_spec"]
    names = list(done_spec.keys())
    if "done" not in names:
        raise ValueError(
            "max_restarts needs a root 'done' entry in the env's done spec to mark restarted "
            f"transitions; this env's done keys are {list(done_spec.keys(True, True))}"
        )
    added = [name for name in ("truncated", RESTARTED_KEY) if name not in names]
    if not added:
        return added
    extended = done_spec.clone()
    for name in added:
        extended[name] = done_spec["done"].clone()
    with _unlocked(env.output_spec):
        env.output_spec["full_done_spec"] = extended
    upstream = Upstream(env)
    template = upstream.buffer_template
    if template is not None:
        template = template.clone()
        for name in added:
            for key in (name, ("next", name)):
                like = template.get(("next", "done") if isinstance(key, tuple) else "done", None)
                if like is None:
                    like = template.get(("next", "done"))
                template.set(key, torch.zeros_like(like))
        upstream.buffer_template = template
    return added


@contextlib.contextmanager
def _unlocked(spec: Any) -> Iterator[None]:
    locked = bool(getattr(spec, "locked", False))
    if locked:
        spec.unlock_()
    try:
        yield
    finally:
        if locked:
            spec.lock_()


def mark_transition(
    slot_td: Any,
    obs_keys: Sequence[Any],
    reward_keys: Sequence[Any],
    done_keys: Sequence[Any],
    fresh: Any = None,
) -> None:
    """Write a restarted slot's transition into its shared buffer ``slot_td``: the next
    observation is the fresh env's reset observation (``fresh``, as recorded when it answered,
    written to the root too; else the root's), rewards are 0,
    ``done``/``truncated``/``worker_restarted`` are True and every other done entry False."""
    nxt = slot_td.get("next")
    source = slot_td if fresh is None else fresh
    for key in obs_keys:
        nxt.get(key).copy_(source.get(key))
        if fresh is not None:  # the root is the new env's too (step_and_maybe_reset reads it)
            slot_td.get(key).copy_(fresh.get(key))
    for key in reward_keys:
        nxt.get(key).zero_()
    for key in done_keys:
        last = key if isinstance(key, str) else key[-1]
        nxt.get(key).fill_(last in _TRUE_ON_MARK)


def clear_root_marks(td: Any, keys: Sequence[str]) -> None:
    """Set the root entries of ``keys`` in ``td`` to False: no env writes them on reset, and a
    partial reset copies whatever the caller's tensordict held (a marked step's next root) into
    the shared buffer. Marks live in ``"next"`` only."""
    for key in keys:
        value = td.get(key, None)
        if value is not None:
            value.zero_()


def clear_marks(slot_td: Any, keys: Sequence[str]) -> None:
    """Reset the done entries only restarts write (the env never does) back to False."""
    nxt = slot_td.get("next")
    for key in keys:
        nxt.get(key).zero_()
