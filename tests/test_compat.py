"""The TorchRL internals we rely on (``torchrl_ext._compat``) exist on the installed release.

When a TorchRL release renames or drops one, this fails naming the name and what it is for,
instead of a managed env failing somewhere later. See docs/design.md, "Trying a new TorchRL".
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import re
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from torchrl.envs import ParallelEnv, batched_envs

from tests.envs import make_env
from torchrl_ext import ManagedParallelEnv, UnsupportedTorchRLError, _compat, _intercept, _patch


def _without(sources: _compat.Installed, row: _compat.Private) -> _compat.Installed:
    """``sources`` as they would be had TorchRL renamed ``row``'s name away."""
    name = row.name
    if row.kind == "module":
        module, _, attr = name.rpartition(".")
        stripped = types.SimpleNamespace(
            **{k: v for k, v in vars(sources.modules[module]).items() if k != attr}
        )
        return dataclasses.replace(sources, modules={**sources.modules, module: stripped})
    if row.kind in ("env", "view"):
        target = sources.env if row.kind == "env" else sources.view
        stub = types.SimpleNamespace(**{k: v for k, v in vars(target).items() if k != name})
        return dataclasses.replace(sources, **{row.kind: stub})
    if row.kind in ("class", "hook"):
        names = {k for cls in ParallelEnv.__mro__ for k in vars(cls)} - {name}
        return dataclasses.replace(sources, env_class=types.SimpleNamespace(**dict.fromkeys(names)))
    if row.kind == "worker_kwarg":
        return dataclasses.replace(sources, worker_params=sources.worker_params - {name})
    pattern = rf"""["']{re.escape(name)}["']"""
    return dataclasses.replace(sources, loop_source=re.sub(pattern, "'renamed'", sources.loop_source))


def _missing(sources: _compat.Installed, release: tuple[int, int]) -> list[str]:
    return [str(row) for row in _compat.missing(sources, release)]


@pytest.fixture(scope="module")
def started_sources() -> Any:
    """The installed TorchRL's names, read from a started managed env and, from TorchRL 0.14
    on, an indexed view of it."""
    env = ManagedParallelEnv(2, functools.partial(make_env), daemon_workers=False, mp_start_method="fork")
    try:
        env.reset()
        view = env[0:1] if _compat.torchrl_release() >= (0, 14) else None
        yield _compat.Installed.read(env, view)
    finally:
        env.close()


@pytest.mark.compat
def test_every_private_name_in_the_inventory_exists_on_the_installed_torchrl(started_sources: Any) -> None:
    """Generated from ``_compat.INVENTORY``: a TorchRL release that renames or drops any name we
    use fails here, naming it and what it is for."""
    missing = _missing(started_sources, _compat.torchrl_release())
    assert not missing, f"TorchRL {_compat.torchrl_release()} lacks: {missing}"


@pytest.mark.compat
@pytest.mark.parametrize("row", _compat.INVENTORY, ids=lambda row: f"{row.kind}:{row.name}")
def test_the_inventory_check_fails_when_that_name_is_removed(started_sources: Any, row: Any) -> None:
    """Removing any one name the package uses makes the check above fail, on that name alone."""
    release = _compat.torchrl_release()
    if row.since is not None and release < row.since:
        pytest.skip(f"{row.name} is only required from TorchRL {row.since} on")  # an older release
    assert _missing(started_sources, release) == []
    assert _missing(_without(started_sources, row), release) == [str(row)]


@pytest.mark.compat
def test_a_release_lacking_an_internal_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """An untested TorchRL that dropped a name we use: the env says so when it is built, naming
    the name and the tested releases, instead of misbehaving later."""
    _compat.check_supported.cache_clear()
    monkeypatch.delattr(batched_envs, "_run_worker_pipe_direct")
    try:
        with pytest.raises(UnsupportedTorchRLError) as info:
            ManagedParallelEnv(2, make_env, mp_start_method="fork")
        message = str(info.value)
        assert "module _run_worker_pipe_direct" in message and _compat.TESTED_RELEASES in message
        assert "torchrl.envs.ParallelEnv" in message
    finally:
        _compat.check_supported.cache_clear()


@pytest.mark.compat
def test_a_users_patch_of_the_worker_function_is_not_read_as_torchrl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads TorchRL's worker function from TorchRL's source: a user's wrapper patched
    in its place before the first env is built (``**kwargs``, no command of its own) does not
    make a supported release look unsupported."""

    def users_wrapper(**kwargs: Any) -> None:
        raise AssertionError("never called")

    _compat.check_supported.cache_clear()
    monkeypatch.setattr(batched_envs, "_run_worker_pipe_shared_mem", users_wrapper)
    try:
        _compat.check_supported()
    finally:
        _compat.check_supported.cache_clear()


def _whole_file_def(source: str, name: str) -> tuple[str, str] | None:
    """What parsing the whole file finds for ``name``: its arguments (dumped) and source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.dump(node.args), ast.get_source_segment(source, node) or ""
    return None


@pytest.mark.compat
@pytest.mark.parametrize("name", ["_run_worker_pipe_shared_mem", "_run_worker_pipe_direct"])
def test_the_worker_function_is_read_from_its_own_lines(name: str) -> None:
    """The check reads TorchRL's worker function by parsing its own lines, not the whole file
    (a twentieth of a second of every program's first start): the same arguments and source."""
    source = inspect.getsource(batched_envs)
    cut = _compat._top_level_def(source, name)
    assert cut is not None, f"{name} was not cut out of TorchRL's source"
    assert (ast.dump(cut[0].args), cut[1]) == _whole_file_def(source, name)


_AWKWARD = '''
import functools


class Holder:
    def nested(self, a):
        return a


def cut_in_a_string(a, b=1):
    text = """
column zero inside the body
"""
    return text


@functools.cache
def decorated(x, *, y):
    return x


def last(c):
    return c
'''


@pytest.mark.parametrize(
    ("name", "cut"), [("nested", False), ("cut_in_a_string", False), ("decorated", True), ("last", True)]
)
def test_a_definition_its_own_lines_do_not_give_is_read_from_the_whole_file(
    name: str, cut: bool, tmp_path: Path
) -> None:
    """Where the cut is not one function of that name (only a nested one, a body with a line at
    column zero inside a string), the whole file is parsed: the result is the same either way."""
    path = tmp_path / "awkward_module.py"
    path.write_text(_AWKWARD)
    spec = importlib.util.spec_from_file_location("awkward_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (_compat._top_level_def(_AWKWARD, name) is not None) == cut
    params, source = _compat._defined(module, name)
    whole = _whole_file_def(_AWKWARD, name)
    assert whole is not None and source == whole[1]
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.FunctionDef)
    expected = {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
    assert params == expected
    assert _compat._defined(module, "absent") == (frozenset(), "")


#: TorchRL's own private names, as the inventory declares them (the commands are plain words;
#: the hooks are the methods ``ManagedParallelEnv`` overrides, by definition named there).
_DECLARED = {row.name.rpartition(".")[2] for row in _compat.INVENTORY if row.kind not in ("command", "hook")}


def _foreign_uses(path: Path) -> list[str]:
    """Uses of a declared TorchRL name in ``path`` outside ``_compat``: a string naming it (an
    instance-dict key, a kwarg, ``getattr``), or an attribute of that name read on anything but
    ``self`` of a class of ours that is not a TorchRL env."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for cls in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
        env_class = isinstance(cls, ast.ClassDef) and any(
            isinstance(base, ast.Name) and base.id.endswith("ParallelEnv") for base in cls.bases
        )
        for node in ast.walk(cls):
            if isinstance(node, ast.Constant) and node.value in _DECLARED and id(node) not in docstrings:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in _DECLARED:
                on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
                if not on_self or env_class:
                    found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return sorted(set(found))


@pytest.mark.compat
def test_no_module_but_compat_names_a_torchrl_private() -> None:
    """The inventory is complete only if nothing reaches TorchRL's internals around it."""
    package = Path(_compat.__file__).parent
    uses = [
        use
        for path in sorted(package.rglob("*.py"))
        if path.name != "_compat.py"
        for use in _foreign_uses(path)
    ]
    assert not uses, f"TorchRL private names used outside _compat (declare and reach them there): {uses}"


@pytest.mark.compat
def test_the_release_is_read_from_the_installed_module() -> None:
    """``torchrl.__version__`` first, then the ``torchrl`` or ``torchrl-nightly`` metadata."""
    release = _compat.torchrl_release()
    assert release >= (0, 10), release
    assert (release >= (0, 11)) == _compat.HAS_DAEMON_KWARG


@pytest.mark.parametrize(
    ("version", "metadata", "expected", "looked_up"),
    [
        ("0.14.1", {"torchrl": "0.13.0"}, (0, 14), []),  # __version__ tells: no metadata read
        ("0.0.0+unknown", {"torchrl": "0.10.1"}, (0, 10), ["torchrl"]),  # 0.10.1's own
        ("", {"torchrl-nightly": "2026.10.27"}, (2026, 10), ["torchrl", "torchrl-nightly"]),
        ("", {}, (0, 0), ["torchrl", "torchrl-nightly"]),
    ],
)
def test_the_release_reads_metadata_only_when_the_module_does_not_tell(
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    metadata: dict[str, str],
    expected: tuple[int, int],
    looked_up: list[str],
) -> None:
    """Each metadata lookup costs milliseconds of a program's first start: it is made only
    when the versions before it do not parse (a 0.0 counts as not parsing)."""
    asked: list[str] = []

    def fake_version(dist: str) -> str:
        asked.append(dist)
        if dist not in metadata:
            raise importlib.metadata.PackageNotFoundError(dist)
        return metadata[dist]

    monkeypatch.setattr(_compat.torchrl, "__version__", version, raising=False)
    monkeypatch.setattr(_compat.importlib.metadata, "version", fake_version)
    assert _compat.torchrl_release() == expected
    assert asked == looked_up


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
        _intercept.install_fault_check()
        check = batched_envs._check_for_faulty_process
        foreign: list[object] = []
        check(foreign)
        assert calls == [foreign], "a list that is not ours goes to the function that was there"
        raised = []
        ours = _intercept.SupervisedWorkers([], lambda: raised.append(True))
        check(ours)
        assert raised == [True] and calls == [foreign]
    finally:
        batched_envs._check_for_faulty_process = previous


@pytest.mark.compat
def test_scoped_patch_restores_what_was_current_and_keeps_a_later_patch() -> None:
    module = types.SimpleNamespace(f="original")
    patch = _patch.ScopedPatch(module, "f", lambda previous: f"ours over {previous}")
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
