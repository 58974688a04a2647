"""The TorchRL internals we rely on (``torchrl_ext._compat``) exist on the installed release.

When a TorchRL release renames or drops one, this fails naming the name and what it is for,
instead of a managed env failing somewhere later. See docs/design.md, "Trying a new TorchRL".
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import types

import pytest
from torchrl.envs import ParallelEnv, batched_envs

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv, _compat


def _release() -> tuple[int, int]:
    # The wheel's metadata, not torchrl.__version__ (0.10.1 wheels report 0.0.0+unknown there).
    major, minor = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torchrl")).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def _required(label: str) -> tuple[str, bool]:
    """``"name (>=0.11)"`` -> ("name", whether the installed release must have it)."""
    found = re.fullmatch(r"(\S+)(?: \(>=(\d+)\.(\d+)\))?", label)
    assert found is not None, label
    name, major, minor = found.groups()
    if major is None:
        return name, True
    return name, _release() >= (int(major), int(minor))


@pytest.mark.compat
@pytest.mark.parametrize("label", sorted(_compat.PRIVATE_MODULE_NAMES))
def test_private_module_names_exist(label: str) -> None:
    name, required = _required(label)
    module_name, attr = name.rsplit(".", 1)
    module = importlib.import_module(
        f"torchrl.envs.{module_name}" if module_name == "batched_envs" else f"torchrl.{module_name}"
    )
    if required:
        assert hasattr(module, attr), (
            f"TorchRL {importlib.metadata.version('torchrl')} has no {module.__name__}.{attr}; "
            f"torchrl_ext uses it as the {_compat.PRIVATE_MODULE_NAMES[label]}"
        )


@pytest.mark.compat
def test_private_env_attributes_exist() -> None:
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    try:
        env.reset()
        missing = []
        for label, purpose in _compat.PRIVATE_ENV_ATTRIBUTES.items():
            name, required = _required(label)
            if required and name not in env.__dict__ and not hasattr(ParallelEnv, name):
                missing.append(f"{name} ({purpose})")
        assert not missing, f"TorchRL {importlib.metadata.version('torchrl')} lacks: {missing}"
    finally:
        env.close()


@pytest.mark.compat
def test_defaults_are_read_from_the_installed_torchrl() -> None:
    defaults = _compat.UPSTREAM_DEFAULTS
    if _compat.HAS_DAEMON_KWARG:
        assert defaults["daemon"] is False  # TorchRL >= 0.11 default
    else:
        assert defaults["daemon"] is True  # 0.10 hard-codes daemonic workers
    assert defaults["shutdown_timeout"] == 10.0
    assert defaults["raise_if_closed"] is True


@pytest.mark.compat
def test_fault_check_is_installed_at_the_first_start_not_at_import() -> None:
    """Importing the package leaves TorchRL's fault check alone; a start routes only our
    worker lists to the supervisor and delegates every other list to what was there."""
    import subprocess
    import sys

    code = (
        "import torchrl_ext\n"
        "from torchrl.envs import batched_envs\n"
        "print(type(batched_envs._check_for_faulty_process).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "function", out.stdout
    calls: list[object] = []
    previous = batched_envs._check_for_faulty_process
    try:
        batched_envs._check_for_faulty_process = lambda processes: calls.append(processes)
        _compat.install_fault_check()
        check = batched_envs._check_for_faulty_process
        foreign: list[object] = []
        check(foreign)
        assert calls == [foreign], "a list that is not ours goes to the function that was there"
        raised = []
        ours = _compat.SupervisedWorkers([], lambda: raised.append(True))
        check(ours)
        assert raised == [True] and calls == [foreign]
    finally:
        batched_envs._check_for_faulty_process = previous


@pytest.mark.compat
def test_scoped_patch_restores_what_was_current_and_keeps_a_later_patch() -> None:
    module = types.SimpleNamespace(f="original")
    patch = _compat.ScopedPatch(module, "f", lambda previous: f"ours over {previous}")
    module.f = "user's"
    with patch.active() as installed:
        assert module.f == installed == "ours over user's"
        with patch.active():  # nested: still ours, restored once
            pass
        assert module.f == installed
    assert module.f == "user's"
    with patch.active():
        module.f = "patched meanwhile"
    assert module.f == "patched meanwhile", "someone else's patch made inside the scope stays"
