"""The documentation is tested like the code.

* Every ```python block of README.md and docs/*.md runs, in a fresh interpreter, under
  ``tests/harness.py`` (a subreaper that reports every process the block leaves behind).
  Blocks fenced as ``text``, ``bash``, ``diff``... are not run.
* The doctests of every module of the package pass.
* What the docs must cover is checked against the code: every exception class of
  ``torchrl_ext._errors`` and every message the library logs at WARNING or above appears in
  docs/troubleshooting.md; every test the guarantee table cites exists.
* The built site: tests/test_docs_site.py.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import json
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchrl_ext
from tests.conftest import child_env, kill_tree
from torchrl_ext import _errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
HARNESS = ROOT / "tests" / "harness.py"

#: Seconds one code block may run (it starts torch, and maybe a ManagedParallelEnv).
BLOCK_TIMEOUT = 120.0
#: Seconds a process may outlive its block before the harness kills it and reports a leak.
BLOCK_LINGER = 10.0
RUN_LANGUAGES = {"python", "py", "python3"}


# --------------------------------------------------------------------------- code blocks
@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


def extract_blocks(path: Path) -> list[CodeBlock]:
    """Fenced code blocks of a Markdown file, dedented by their fence's indentation."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        match = _OPEN.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        info = match["info"].lstrip("{").strip()
        language = info.split()[0].lstrip(".").lower() if info else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: code fence is never closed")
        blocks.append(CodeBlock(path, i + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def _python_blocks() -> list[CodeBlock]:
    return [b for path in DOC_FILES for b in extract_blocks(path) if b.language in RUN_LANGUAGES]


PYTHON_BLOCKS = _python_blocks()


def test_docs_have_runnable_examples() -> None:
    names = {b.path.name for b in PYTHON_BLOCKS}
    assert {"README.md", "quickstart.md", "troubleshooting.md"} <= names, names


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_python_block_runs(block: CodeBlock, tmp_path: Path) -> None:
    starts_env = re.search(r"\b(Managed)?ParallelEnv\s*\(", block.code) is not None
    if starts_env:
        assert 'mp_start_method="fork"' in block.code, (
            f'{block.name}: a block that starts a ParallelEnv must pass mp_start_method="fork" '
            "(spawn re-imports torch in every worker: too slow for the docs test)"
        )
        closes = ".close()" in block.code or "closing(" in block.code
        closes = closes or re.search(r"with\s+(Managed)?ParallelEnv\s*\(", block.code) is not None
        assert closes, f"{block.name}: a block that starts a ParallelEnv must close it"
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    report = tmp_path / "harness.json"
    env = child_env()
    cmd = [sys.executable, str(HARNESS), str(report), str(BLOCK_LINGER), "--", sys.executable, str(script)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT + BLOCK_LINGER + 10)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{block.name} did not finish within {BLOCK_TIMEOUT:.0f}s\n{out}\n{err[-4000:]}")
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{err[-4000:]}"
    result = json.loads(report.read_text())
    assert result["returncode"] == 0, (
        f"{block.name} exited with {result['returncode']}\n"
        f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}"
    )
    assert not result["leaked"], f"{block.name} left processes behind: {result['leaked']}"


# ------------------------------------------------------------------------------ doctests
def _package_modules() -> list[str]:
    names = [torchrl_ext.__name__]
    for info in pkgutil.walk_packages(torchrl_ext.__path__, prefix=f"{torchrl_ext.__name__}."):
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("module_name", _package_modules())
def test_doctests(module_name: str) -> None:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output: list[str] = []
    for test in finder.find(module, module_name):
        runner.run(test, out=output.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(output)


def test_public_modules_have_doctests() -> None:
    finder = doctest.DocTestFinder(exclude_empty=True)
    examples = sum(
        len(t.examples) for name in _package_modules() for t in finder.find(importlib.import_module(name))
    )
    assert examples > 0


# ------------------------------------------------------------------- what the docs cover
def _normalized(text: str) -> str:
    return " ".join(text.split())


def test_troubleshooting_covers_every_exception_class() -> None:
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^#{2,4}\s+`?(\w+)`?\s*$", page, flags=re.MULTILINE))
    classes = [
        name
        for name in _errors.__all__
        if inspect.isclass(getattr(_errors, name)) and issubclass(getattr(_errors, name), BaseException)
    ]
    assert classes
    missing = [name for name in classes if name not in headings]
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


_LOG_METHODS = {"warning", "error", "exception", "critical"}
_LOGGER_NAMES = {"log", "logger", "_log", "_logger"}
_PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")


def _string_value(node: ast.AST, constants: dict[str, str]) -> list[str] | None:
    """The literal parts of a log message expression, or None if it cannot be read."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _PLACEHOLDER.split(node.value)
    if isinstance(node, ast.Name) and node.id in constants:
        return _PLACEHOLDER.split(constants[node.id])
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return None


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """A module's top-level ``NAME = "text"`` assignments (messages kept in constants)."""
    return {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _logged_messages() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((ROOT / "torchrl_ext").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _LOG_METHODS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in _LOGGER_NAMES
                and node.args
            ):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            parts = _string_value(node.args[0], constants)
            assert parts is not None, f"{where}: cannot read the logged message to check the docs"
            found.append((where, [p.strip() for p in parts if len(p.strip()) >= 4]))
    return found


def test_troubleshooting_covers_every_logged_warning() -> None:
    page = _normalized((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    messages = _logged_messages()
    assert len(messages) >= 5
    missing = [
        f"{where}: {fragment!r}"
        for where, fragments in messages
        for fragment in fragments
        if _normalized(fragment) not in page
    ]
    assert not missing, "docs/troubleshooting.md does not quote these logged messages:\n" + "\n".join(missing)


#: Messages raised by the package that no user can meet (internal guards and protocol errors,
#: caught where they are raised), by ``(file, start of the message)``, ``None`` for every message
#: the file raises; each says why, and each must exempt a message raised today.
_INTERNAL_RAISES: dict[tuple[str, str | None], str] = {
    ("torchrl_ext/_forkserver.py", "too many fds for one fork request"): (
        "fork-server protocol: an oversized request, caught by the client"
    ),
    ("torchrl_ext/_platform.py", None): (
        "a guard against signalling process group 0/1, or errno of a failed call"
    ),
}

#: TorchRL's own messages that reach users unchanged (asserted to be in the installed TorchRL).
_UPSTREAM_MESSAGES = ("trying to close a closed environment",)


def _exemption(rel: str, lead: str) -> tuple[str, str | None] | None:
    """The ``_INTERNAL_RAISES`` key that exempts the message ``lead`` raised in ``rel``, if any."""
    for file, start in _INTERNAL_RAISES:
        if file == rel and (start is None or lead.startswith(start)):
            return file, start
    return None


def _raised_messages() -> list[tuple[str, str]]:
    """Where, and the lead (see :func:`_lead`), of every ``raise SomeError("...")`` message
    ``_INTERNAL_RAISES`` does not exempt (and that every exemption exempts one)."""
    found = []
    used = set()
    for path in sorted((ROOT / "torchrl_ext").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            parts = _string_value(node.exc.args[0], constants)
            if parts is None:  # not a message (an error class of ours builds its own)
                continue
            lead = _lead(parts)
            exemption = None if lead is None else _exemption(rel, lead)
            if exemption is not None:
                used.add(exemption)
            elif lead is not None:
                found.append((f"{rel}:{node.lineno}", lead))
    unused = sorted(set(_INTERNAL_RAISES) - used, key=str)
    assert not unused, f"_INTERNAL_RAISES exempts messages no longer raised (remove them): {unused}"
    return found


def _lead(parts: list[str]) -> str | None:
    """What a user searches for: the message's first literal part of 12 characters or more,
    cut at a word boundary within 60 (``None`` if the message has none)."""
    first = next((" ".join(p.split()) for p in parts if len(p.strip()) >= 12), None)
    if first is None or len(first) <= 60:
        return first
    return first[:60].rsplit(" ", 1)[0]


def test_troubleshooting_quotes_every_raised_message() -> None:
    """Every message the package raises starts with text the troubleshooting page quotes (its
    table of messages points to the section): found by an AST scan, as logged warnings are."""
    page = _normalized((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    messages = _raised_messages()
    assert len(messages) >= 10, messages
    missing = [f"{where}: {lead!r}" for where, lead in messages if lead not in page]
    assert not missing, "docs/troubleshooting.md does not quote these raised messages:\n" + "\n".join(missing)


def test_troubleshooting_quotes_the_upstream_messages_users_meet() -> None:
    import torchrl

    page = _normalized((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    sources = "".join(p.read_text(encoding="utf-8") for p in Path(torchrl.__file__).parent.rglob("*.py"))
    for message in _UPSTREAM_MESSAGES:
        assert message in sources, f"the installed TorchRL no longer raises {message!r}"
        assert message in page, f"docs/troubleshooting.md does not quote {message!r}"


@dataclass(frozen=True)
class CitedTest:
    """Where a test runs, as pytest collects it."""

    compat: bool  # some of its cases are in the compat suite (also run on TorchRL 0.10.1)
    methods: frozenset[str]  # start methods among its parameters or quoted in its source
    #: Its cases: their string parameters, and why a skip mark skips the case here (or None).
    cases: tuple[tuple[frozenset[str], str | None], ...] = ()
    #: Run by the TorchRL 0.15 suite (``make test-torchrl015``): in the compat suite, the
    #: contract suite or ``tests/test_compat.py``.
    next_suite: bool = False

    @property
    def only_from_015(self) -> bool:
        """Every case is skipped here because it tests a path TorchRL 0.15 brought."""
        return bool(self.cases) and all(skip and BEFORE_015 in skip for _params, skip in self.cases)

    def skipped_here(self, module: str, name: str, method: str | None) -> str | None:
        """Why this machine skips the cases of ``method`` (all cases if none of them has it as
        a parameter; ``None``: they run): every such case carries a skip mark that applies
        here, or the test's module names it in ``MACHINE_SKIPS`` (test name -> the check the
        test itself calls before it skips), whose check gives a reason for ``method``."""
        relevant = [skip for params, skip in self.cases if method in params] or [
            skip for _params, skip in self.cases
        ]
        if relevant and all(relevant):
            return f"every case is skipped by a mark: {relevant[0]}"
        try:
            checks = getattr(importlib.import_module(module), "MACHINE_SKIPS", {})
        except pytest.skip.Exception as err:  # a module-level skip (importorskip)
            return f"its module is skipped: {err}"
        check = checks.get(name)
        return None if check is None else check(method)


#: The skip reason of the tests of a path TorchRL 0.15 brought (``tests/test_handoff.py``): their
#: rows say "0.15 only"; everywhere else a row claims 0.15 exactly when the 0.15 suite runs
#: every test it cites.
BEFORE_015 = "TorchRL < 0.15"
_CLAIMS_015 = re.compile(r"\b0\.15\b")
#: What ``make test-torchrl015`` runs besides the compat suite.
_NEXT_SUITE_PATHS = ("contract/", "test_compat.py")

#: Start paths a row may claim. "default": no ``mp_start_method`` at all, each class's default
#: (the contract suite's ``"default"`` parameter); "preloaded": the managed default's server.
_METHOD = re.compile(r"\b(forkserver|fork|spawn|preloaded|default)\b")
_QUOTED_METHOD = re.compile(r"""["'](forkserver|fork|spawn|preloaded|default)["']""")
_CITED = re.compile(r"`((?:\w+/)*test_\w+\.py)::(test_\w+)`")

# Run by the test below in a fresh interpreter: collect the given files and print, for each
# test function, whether a case of it carries the compat mark, its parameter values, and for
# each case its string parameters and why a skip mark skips it here (skip, skipif).
_COLLECT = """
import json, sys
from pathlib import Path
import pytest
from _pytest.skipping import evaluate_skip_marks

found = {}

class Collect:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            key = f"{Path(item.path).relative_to(Path('tests').resolve()).as_posix()}::{item.originalname}"
            entry = found.setdefault(key, {"compat": False, "params": [], "cases": []})
            entry["compat"] = entry["compat"] or item.get_closest_marker("compat") is not None
            callspec = getattr(item, "callspec", None)
            params = []
            if callspec is not None:
                params = [v for v in callspec.params.values() if isinstance(v, str)]
                entry["params"] += params
            skip = evaluate_skip_marks(item)
            entry["cases"].append([params, None if skip is None else skip.reason or "skip mark"])

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Collect()])
print("COLLECTED" + json.dumps(found))
sys.exit(int(code))
"""


def _guarantee_rows() -> list[list[str]]:
    """The rows of every table of docs/guarantees.md whose last columns are "proven on" and
    "proven by" (the summary at the top links to them and claims nothing of its own)."""
    page = (DOCS / "guarantees.md").read_text(encoding="utf-8")
    rows: list[list[str]] = []
    header: list[str] = []
    for line in page.splitlines():
        if not line.startswith("|"):
            header = []  # a table ends
            continue
        if re.match(r"^\|\s*-", line):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
        elif header[-2:] == ["proven on", "proven by"]:
            rows.append(cells)
    return rows


def _source_methods() -> dict[str, set[str]]:
    """Start methods quoted in each test function's source (``"file.py::test_name"``)."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT / "tests").as_posix()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"{rel}::{node.name}"] = set(_QUOTED_METHOD.findall(ast.unparse(node)))
    return found


def _cited_tests(rows: list[list[str]]) -> dict[str, CitedTest]:
    """What pytest collects of every test the rows cite (a test it does not collect is left
    out: the caller reports it)."""
    files = sorted({f"tests/{path}" for cells in rows for path, _ in _CITED.findall(cells[-1])})
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT, *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("COLLECTED")), None)
    assert proc.returncode == 0 and line is not None, (
        f"collection failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    quoted = _source_methods()
    return {
        key: CitedTest(
            entry["compat"],
            frozenset({*quoted.get(key, ()), *(p for p in entry["params"] if _METHOD.fullmatch(p))}),
            tuple((frozenset(params), skip) for params, skip in entry["cases"]),
            entry["compat"] or key.startswith(_NEXT_SUITE_PATHS),
        )
        for key, entry in json.loads(line[len("COLLECTED") :]).items()
    }


def test_guarantee_table_cites_existing_tests() -> None:
    """Every row cites tests that pytest collects, and names where they are proven: the TorchRL
    releases (0.10.1 exactly when every cited test has cases in the compat suite) and the start
    methods (forkserver and spawn only where every cited test runs them). A row claims nothing
    this machine skips: no cited test is skipped here for a start method the row names (by a
    skip mark, a skipped module, or the test's own machine check, ``MACHINE_SKIPS``)."""
    rows = _guarantee_rows()
    assert len(rows) >= 20
    defined = _cited_tests(rows)
    for cells in rows:
        row = " | ".join(cells)
        cited = [f"{path}::{name}" for path, name in _CITED.findall(cells[-1])]
        assert cited, f"guarantee row cites no test: {row}"
        unknown = [c for c in cited if c not in defined]
        assert not unknown, f"guarantee row cites tests that do not exist: {unknown}"
        assert len(cells) >= 4, f"guarantee row without a 'proven on' column: {row}"
        where, tests = cells[-2], [defined[c] for c in cited]
        only_015 = all(t.only_from_015 for t in tests)
        if only_015:
            assert "0.15 only" in where, f"row of TorchRL 0.15's own path without '0.15 only': {row}"
        else:
            assert "0.14.1" in where, f"row does not say it is proven on TorchRL 0.14.1: {row}"
        compat = all(t.compat for t in tests) and not only_015
        assert ("0.10.1" in where) == compat, (
            f"row {'omits' if compat else 'claims'} TorchRL 0.10.1, but its tests are "
            f"{'all' if compat else 'not all'} in the compat suite: {row}"
        )
        next_suite = all(t.next_suite for t in tests)
        assert bool(_CLAIMS_015.search(where)) == next_suite, (
            f"row {'omits' if next_suite else 'claims'} TorchRL 0.15, but its tests are "
            f"{'all' if next_suite else 'not all'} in the 0.15 suite: {row}"
        )
        claimed = set(_METHOD.findall(where))
        assert claimed or "no env workers" in where, f"row names no start method: {row}"
        for method in claimed - {"fork"}:
            missing = [c for c, t in zip(cited, tests, strict=True) if method not in t.methods]
            assert not missing, f"row claims {method}, which {missing} do not run: {row}"
        for c, t in zip(cited, tests, strict=True):
            if t.only_from_015:
                continue  # skipped for the release here, not for this machine
            path, name = c.split("::")
            module = "tests." + path.removesuffix(".py").replace("/", ".")
            for method in sorted(claimed) or [None]:
                reason = t.skipped_here(module, name, method)
                assert reason is None, (
                    f"row claims {method or 'its cases'}, but {c} is skipped on this machine "
                    f"({reason}): {row}"
                )


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((?!https?:|#)([^)#\s]+)", readme)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_documented_shutdown_order_matches_the_constants() -> None:
    """NOTE [shutdown order]: every percentage quoted next to the escalation is a constant's."""
    from torchrl_ext import _shutdown

    close_pct = round(100 * _shutdown.CLOSE_MESSAGE_SHARE)
    term_pct = round(100 * _shutdown.SIGTERM_SHARE)
    kill_pct = round(100 * _shutdown.SIGKILL_SHARE)
    allowed = {close_pct, term_pct, kill_pct, 100}
    sources = {
        path.name: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    }
    sources["_shutdown.py"] = _shutdown.__doc__ or ""
    quoted = 0
    for name, text in sources.items():
        for line in text.splitlines():
            if not re.search(r"SIGTERM|SIGKILL|close\W+message", line):
                continue
            for pct in re.findall(r"(\d+)\s?%", line):
                quoted += 1
                assert int(pct) in allowed, f"{name}: {pct} % in {line.strip()!r}; constants say {allowed}"
    assert quoted >= 4, "the shutdown order is no longer quoted where this test looks"
    design = sources["design.md"]
    assert re.search(rf"message.*\|\s*{close_pct} % of `shutdown_timeout`", design)
    assert re.search(rf"\|\s*SIGTERM \(at {close_pct} %\)\s*\|\s*{term_pct} %", design)
    assert re.search(rf"\|\s*SIGKILL \(at {term_pct} %\)\s*\|\s*{kill_pct} %", design)


def test_troubleshooting_doctor_table_lists_every_check() -> None:
    """The doctor's table in docs/troubleshooting.md has a row for every check the doctor runs
    (it lacked ``preloaded start``)."""
    from torchrl_ext._doctor import run_checks

    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    section = page[page.index("## First: run the doctor") :]
    section = section[: section.index("\n## ", 1)]
    rows = set(re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE))
    rows |= {
        name
        for cell in re.findall(r"^\| (`[^|]+`) \|", section, flags=re.MULTILINE)
        for name in re.findall(r"`([^`]+)`", cell)
    }
    missing = [check.name for check in run_checks(orphan_test=False) if check.name not in rows]
    assert not missing, f"docs/troubleshooting.md's doctor table has no row for {missing}"
