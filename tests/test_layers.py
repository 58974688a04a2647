"""The package's import graph has layers: every module imports only modules below its own layer,
or before it in its own layer; so the graph has no circle and nothing imports back up. Every
import counts: top-level, inside a function, or only for type checking (which is not allowed at
all: a type-only import is how a circle hides). Read from the source with ``ast``; imports
nothing of the package."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchrl_ext"

#: Bottom to top. A module may import modules of lower layers and those listed before it in its
#: own layer. ``data/`` is apart: nothing here imports it, and it imports of the package only the
#: process supervision its ledger's processes live under (``DATA_MAY_IMPORT``).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "primitives: the standard library and psutil only",
        [
            "_wait",
            "_closers",
            "_patch",
            "_platform",
            "_cpython",
            "_identity",
            "_watcher",
            "_done_signal",
            "_errors",
            "_reaper_client",
            "_reaper",
            "_stacks",
            "_status",
            "_wire",
            "_report",
            "_probes",
        ],
    ),
    (
        "adapters and plain values",
        ["_compat", "_step_path", "_hosts", "_policy", "_marks", "_channel", "_tag", "_options"],
    ),
    (
        "the worker side and process starting",
        ["_worker", "_intercept", "_forkserver", "_metadata", "_lifecycle"],
    ),
    ("supervision of processes", ["_record", "_stats", "_shutdown", "_handover", "_supervisor"]),
    ("the start plan and starting a worker", ["_plan", "_starting"]),
    ("policies over slots", ["_slots", "_recycle", "_keeper"]),
    ("around each call, and the start sequence", ["_calls", "_start"]),
    ("the env", ["_env"]),
    ("the package and the command line", ["__init__", "_sweep", "_doctor", "__main__"]),
]


def _rank() -> dict[str, tuple[int, int]]:
    return {
        name: (layer, order) for layer, (_, names) in enumerate(LAYERS) for order, name in enumerate(names)
    }


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """``(module, line, type_checking_only)`` for every import of a package module in ``path``."""
    tree = ast.parse(path.read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("torchrl_ext")
        ):
            parts = (node.module or "").split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("torchrl_ext.")]
        found += [(name, node.lineno, id(node) in guarded) for name in names]
    return found


def _modules() -> list[str]:
    return sorted(path.stem for path in PACKAGE.glob("*.py"))


@pytest.mark.compat
def test_every_module_has_a_layer() -> None:
    listed = [name for _, names in LAYERS for name in names]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == _modules()


@pytest.mark.compat
def test_no_module_imports_a_higher_layer_or_a_later_module_of_its_own() -> None:
    rank = _rank()
    wrong = []
    for module in _modules():
        for name, line, _ in _imports(PACKAGE / f"{module}.py"):
            if name == "data":
                wrong.append(f"{module}.py:{line} imports data/, which is apart")
            elif name in rank and rank[name] >= rank[module]:
                wrong.append(
                    f"{module}.py:{line} imports {name} ({LAYERS[rank[name][0]][0]}), which is not below it"
                )
    assert wrong == []


@pytest.mark.compat
def test_no_import_is_for_type_checking_only() -> None:
    hidden = [
        f"{module}.py:{line} imports {name} under TYPE_CHECKING"
        for module in _modules()
        for name, line, type_only in _imports(PACKAGE / f"{module}.py")
        if type_only
    ]
    assert hidden == []


#: What ``data/`` may import of the package: identity, platform calls, CPython internals (through
#: their accessors), the reaper, the error wording, the owner tag, the closes run after the envs'
#: and the bounded wait (all in the two bottom layers, so no circle can pass through data/).
DATA_MAY_IMPORT = {
    "_identity",
    "_platform",
    "_cpython",
    "_reaper_client",
    "_errors",
    "_tag",
    "_closers",
    "_wait",
}


@pytest.mark.compat
def test_the_data_package_imports_only_process_supervision_of_the_package() -> None:
    rank = _rank()
    assert all(rank[name][0] <= 1 for name in DATA_MAY_IMPORT)
    wrong = []
    for path in sorted((PACKAGE / "data").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                ours = [a.name for a in node.names if a.name.startswith("torchrl_ext")]
                wrong += [f"{path.name}:{node.lineno} imports {name}" for name in ours]
            if not isinstance(node, ast.ImportFrom):
                continue
            if (node.module or "").startswith("torchrl_ext") or node.level > 2:
                wrong.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif node.level == 2:
                names = [node.module] if node.module else [a.name for a in node.names]
                wrong += [f"{path.name}:{node.lineno} imports {n}" for n in names if n not in DATA_MAY_IMPORT]
    assert wrong == []
