"""The CPython internals we rely on (``torchrl_ext._cpython.INVENTORY``) exist on this interpreter
in the shape we use, the check notices when one goes, and each is used by the one module that
owns it (``Internal.owner``) and by no other.

NOTE [CPython internals] in ``torchrl_ext/_cpython.py``.
"""

from __future__ import annotations

import ast
import multiprocessing
import multiprocessing.popen_fork
import multiprocessing.popen_forkserver
import multiprocessing.process
import multiprocessing.util
from pathlib import Path
from typing import Any

import pytest

from torchrl_ext import _cpython
from torchrl_ext._cpython import INVENTORY, Internal

pytestmark = pytest.mark.compat  # the whole file: every interpreter and TorchRL we support

PACKAGE = Path(_cpython.__file__).resolve().parent
LABELS = [e.label for e in INVENTORY]

#: Uses outside a name's owner module that are allowed for now (none): the scan below fails both
#: on a use not listed here and on an entry no longer used.
PENDING: dict[str, set[str]] = {}
#: Inventory names that no code names, so the scan cannot see them used: what relies on each.
UNNAMED: dict[str, str] = {
    "multiprocessing.popen_spawn_posix.Popen._launch": "spawn launches through spawnv_passfds (_tag)",
    "multiprocessing.popen_fork.Popen.close": "called on a process's Popen (_cpython.release_exited_process)",
}


# --------------------------------------------------------------------------- existence
@pytest.mark.parametrize("entry", INVENTORY, ids=LABELS)
def test_declared_name_exists_in_the_shape_we_use(entry: Internal) -> None:
    assert _cpython.missing([entry]) == [], f"torchrl_ext uses it for: {entry.used_for}"


def test_inventory_labels_are_unique() -> None:
    assert len(set(LABELS)) == len(LABELS)


def _stub(*args: Any, **kwargs: Any) -> None:
    return None


def _simulate_removal(entry: Internal, monkeypatch: pytest.MonkeyPatch, *, reshape: bool) -> None:
    """Make ``entry`` absent (or, ``reshape``, present as a stub without its parameters and
    markers) until the test ends."""
    owner, last = _cpython._owner_and_last(entry)
    if entry.kind == "instance":
        original = owner.__init__

        def init_without(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            delattr(self, last)

        monkeypatch.setattr(owner, "__init__", init_without)
    elif reshape or entry.kind == "source":
        monkeypatch.setattr(owner, last, _stub)
    else:
        monkeypatch.delattr(owner, last)


def _reported(entries: Any = INVENTORY) -> list[str]:
    return [line.split(":", 1)[0] for line in _cpython.missing(entries)]


@pytest.mark.parametrize("entry", INVENTORY, ids=LABELS)
def test_a_removed_name_is_reported_alone(entry: Internal, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _reported() == []
    _simulate_removal(entry, monkeypatch, reshape=False)
    assert _reported() == [entry.label]


@pytest.mark.parametrize(
    "entry",
    [e for e in INVENTORY if e.params or e.markers],
    ids=[e.label for e in INVENTORY if e.params or e.markers],
)
def test_a_name_without_our_parameters_or_markers_is_reported(
    entry: Internal, monkeypatch: pytest.MonkeyPatch
) -> None:
    _simulate_removal(entry, monkeypatch, reshape=True)
    assert _reported() == [entry.label]


# --------------------------------------------------------------------------- no use elsewhere
def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _own_attribute_names(tree: ast.AST) -> set[int]:
    """``self.x`` nodes (and ``getattr(self, "x")`` strings) in classes that extend no
    ``multiprocessing`` class (named directly or through ``_cpython``): a class's own
    attributes, whatever they are called."""
    own: set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if any(ast.unparse(base).startswith(("multiprocessing", "_cpython.")) for base in cls.bases):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("self", "cls"):
                own.add(id(node))
            if isinstance(node, ast.Call) and len(node.args) >= 2 and ast.unparse(node.args[0]) == "self":
                own.add(id(node.args[1]))
    for node in ast.walk(tree):  # getattr(self, "_closed", ...) outside a class body too
        if isinstance(node, ast.Call) and len(node.args) >= 2 and ast.unparse(node.args[0]) == "self":
            own.add(id(node.args[1]))
    return own


def _matches(node: ast.AST, needle: str) -> bool:
    if needle.startswith("'"):
        return isinstance(node, ast.Constant) and node.value == needle.strip("'")
    if needle.startswith("."):
        name = needle[1:]
        if isinstance(node, ast.Attribute):
            return node.attr == name
        if isinstance(node, ast.keyword):
            return node.arg == name
        return isinstance(node, ast.Constant) and node.value == name
    if isinstance(node, ast.Attribute):
        text = ast.unparse(node)
        return text == needle or text.startswith(needle + ".")
    if isinstance(node, ast.ImportFrom) and node.module:
        return any(f"{node.module}.{a.name}" in (needle, needle.rsplit(".", 1)[0]) for a in node.names)
    pair = node.args if isinstance(node, ast.Call) else node.elts if isinstance(node, ast.Tuple) else []
    if len(pair) >= 2:  # getattr/setattr(module, "name"), or a (module, "name") patch target
        module, _, name = needle.rpartition(".")
        second = pair[1]
        return ast.unparse(pair[0]) == module and isinstance(second, ast.Constant) and second.value == name
    return False


def _inventory_declaration(tree: ast.Module) -> set[int]:
    """The nodes of ``INVENTORY = (...)``: declaring a name is not using it."""
    found: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "INVENTORY" and node.value:
            found.update(id(n) for n in ast.walk(node.value))
    return found


def scan(source: str, *, declares_inventory: bool = False) -> set[str]:
    """Labels of the inventory names ``source`` uses (see ``Internal.needles``); with
    ``declares_inventory`` (``_cpython``), its ``INVENTORY`` is not a use."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | _own_attribute_names(tree)
    if declares_inventory:
        skip |= _inventory_declaration(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        for entry in INVENTORY:
            if any(_matches(node, needle) for needle in entry.needles):
                found.add(entry.label)
    return found


def test_the_scan_finds_each_kind_of_use() -> None:
    source = (
        '"""A docstring naming multiprocessing.util.spawnv_passfds and --multiprocessing-fork."""\n'
        "import multiprocessing.util\n"
        "from multiprocessing.forkserver import read_signed\n"
        "class Mine:\n"
        "    def f(self, p):\n"
        "        self._popen = None  # our own attribute: not a use\n"
        "        return getattr(self, '_closed', True)\n"
        "def g(p, patch):\n"
        "    p._kwargs = {}\n"
        "    patch(multiprocessing.util, 'spawnv_passfds')\n"
        "    return '--multiprocessing-fork' in p, getattr(p, '_target', None)\n"
        "def h():\n"
        "    return multiprocessing.resource_tracker, 'getfd'  # a patch target\n"
        "class Child(_cpython.ForkServerPopen):\n"
        "    def f(self):\n"
        "        return self._fds  # a multiprocessing attribute, through _cpython's alias\n"
    )
    assert scan(source) == {
        "multiprocessing.process.BaseProcess._kwargs",
        "multiprocessing.process.BaseProcess._target",
        "multiprocessing.util.spawnv_passfds",
        "multiprocessing.forkserver.read_signed",
        "multiprocessing.spawn.get_command_line",
        "multiprocessing.resource_tracker.getfd",
        "multiprocessing.popen_forkserver.Popen.__init__",
    }


def test_the_scan_skips_only_the_inventory_declaration() -> None:
    source = (
        "INVENTORY: tuple = (_entry('multiprocessing.spawn:prepare', 'callable', 'x', '', '_inheriting'),)\n"
        "OTHER = ('_inheriting',)\n"
    )
    label = "multiprocessing.spawn._check_not_importing_main"
    assert scan(source) == {label}
    assert scan(source.splitlines()[0], declares_inventory=True) == set()
    assert scan(source, declares_inventory=True) == {label}


def _owner_file(entry: Internal) -> str:
    return entry.owner.replace(".", "/") + ".py"


def test_each_inventory_name_is_used_by_its_owner_only() -> None:
    """Each module uses only the inventory names it owns, and each module uses every name it
    owns (but those in ``UNNAMED``): a name has exactly one module allowed to use it."""
    owners = {e.label: _owner_file(e) for e in INVENTORY}
    assert not [f for f in owners.values() if not (PACKAGE / f).is_file()], "an owner is not a module"
    assert set(UNNAMED) <= set(owners), "UNNAMED lists a name the inventory does not declare"
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        uses = scan(path.read_text(encoding="utf-8"), declares_inventory=rel == "_cpython.py")
        if uses:
            found[rel] = uses
    foreign = {
        f: sorted(u for u in uses if owners[u] != f and u not in PENDING.get(f, set()))
        for f, uses in found.items()
    }
    foreign = {f: u for f, u in foreign.items() if u}
    stale = {f: sorted(p - found.get(f, set())) for f, p in PENDING.items() if p - found.get(f, set())}
    unused = sorted(label for label, f in owners.items() if label not in found.get(f, set()) | set(UNNAMED))
    seen = sorted(label for label in UNNAMED if any(label in uses for uses in found.values()))
    assert not foreign, f"CPython internals used outside their owner (use an accessor there): {foreign}"
    assert not stale, f"PENDING lists uses that are gone (remove them from PENDING): {stale}"
    assert not unused, f"CPython internals their owner does not use (fix the owner or the entry): {unused}"
    assert not seen, f"UNNAMED lists names the scan now finds (remove them from UNNAMED): {seen}"


# --------------------------------------------------------------------------- the accessors
def test_process_accessors_read_and_replace_what_start_uses() -> None:
    template = multiprocessing.get_context("spawn").Process(target=print, kwargs={"end": ""}, name="w-1")
    assert _cpython.process_target(template) is print
    assert _cpython.process_kwargs(template) == {"end": ""}
    assert _cpython.process_start_method(template) == "spawn"
    assert _cpython.process_start_method(multiprocessing.process.BaseProcess()) is None
    _cpython.set_process_kwargs(template, {"sep": ","})
    assert _cpython.process_kwargs(template) == {"sep": ","}
    template.daemon = True
    copy = _cpython.copy_unstarted_process(template, {"flush": True}, "w-restart1")
    assert copy is not template and copy.name == "w-restart1" and copy.daemon
    assert _cpython.process_kwargs(copy) == {"flush": True}
    assert _cpython.process_kwargs(template) == {"sep": ","}, "the template is untouched"
    assert _cpython.process_target(copy) is print
    copy.daemon = False
    assert template.daemon, "the copy has its own config"
    assert _cpython.daemon_in_config(template) and not _cpython.daemon_in_config(copy)
    _cpython.set_daemon_in_config(copy, True)
    assert copy.daemon


def test_a_started_process_copy_is_unstarted_and_startable() -> None:
    template = multiprocessing.get_context("fork").Process(target=_stub, kwargs={}, name="t-1")
    copy = _cpython.copy_unstarted_process(template, {}, "t-restart1")
    copy.start()
    copy.join(30)
    assert copy.exitcode == 0
    again = _cpython.copy_unstarted_process(template, {}, "t-restart2")
    assert again.exitcode is None and not again.is_alive(), "a copy of the template, not of the started one"
    assert template.exitcode is None


def test_is_forkserver_child_tells_the_popen_class() -> None:
    process = multiprocessing.process.BaseProcess()
    assert not _cpython.is_forkserver_child(process)
    process._popen = object.__new__(multiprocessing.popen_fork.Popen)  # type: ignore[attr-defined]
    assert not _cpython.is_forkserver_child(process)
    process._popen = object.__new__(multiprocessing.popen_forkserver.Popen)  # type: ignore[attr-defined]
    assert _cpython.is_forkserver_child(process)
    process._popen = None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (
            ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"],
            "worker",
        ),
        ([b"python", b"-c", b"from multiprocessing.forkserver import main; main(3, 4, [])"], "forkserver"),
        (["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"], None),
    ],
)
def test_spawned_kind_reads_argv(argv: list[Any], kind: str | None) -> None:
    assert _cpython.spawned_kind(argv) == kind


def test_helpers_are_told_by_their_command_line() -> None:
    assert _cpython.is_multiprocessing_helper("python -c from multiprocessing.forkserver import main")
    assert _cpython.is_multiprocessing_helper("python -c from multiprocessing.resource_tracker import main")
    assert not _cpython.is_multiprocessing_helper("python train.py")


def test_spawn_patch_target_is_what_multiprocessing_calls() -> None:
    module, name = _cpython.spawn_patch_target()
    assert getattr(module, name) is multiprocessing.util.spawnv_passfds
