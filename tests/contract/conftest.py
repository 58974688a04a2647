"""Fixtures of the contract suite (the autouse ``no_leaks`` of tests/conftest.py applies too)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

#: What forkserver children of this suite import anyway. Preloaded in the server, they are
#: imported once per test session instead of once per worker (~3-6 s each on 2 cores).
#: Without effect if a fork server is already running when the first contract test starts.
FORKSERVER_PRELOAD = ["torch", "tensordict", "torchrl", "torchrl.envs", "tests.contract.envs"]


@pytest.fixture(scope="session", autouse=True)
def _forkserver_preload() -> None:
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


@pytest.fixture
def restore_start_method() -> Iterator[None]:
    """Collectors take the process-wide start method (and set it when unset): restore it."""
    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)
