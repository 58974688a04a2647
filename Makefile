# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned first, explicitly: an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
TORCH := torch==2.13.0
TORCHRL := torchrl==0.14.1
TORCHRL_OLD := "torchrl==0.10.1" "tensordict>=0.10,<0.11"
PIP_FLAGS := -q --disable-pip-version-check
# Every test run carries this tag; the leak fixture looks for processes that inherited it.
export TORCHRL_EXT_TEST_SESSION ?= make-$(shell date +%s)-$$PPID

.PHONY: demo test lint test-main test-compat docs bench clean try-torchrl

.venv/.ready: pyproject.toml Makefile
	test -x .venv/bin/python || $(PYTHON) -m venv .venv
	.venv/bin/pip install $(PIP_FLAGS) $(TORCH)
	.venv/bin/pip install $(PIP_FLAGS) "$(TORCHRL)" -e ".[dev,ray]"
	touch $@

.venv-torchrl010/.ready: pyproject.toml Makefile
	test -x .venv-torchrl010/bin/python || $(PYTHON) -m venv .venv-torchrl010
	.venv-torchrl010/bin/pip install $(PIP_FLAGS) $(TORCH)
	.venv-torchrl010/bin/pip install $(PIP_FLAGS) $(TORCHRL_OLD) psutil numpy pytest pytest-timeout
	.venv-torchrl010/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

demo: .venv/.ready
	.venv/bin/python examples/heavy_reset.py

lint: .venv/.ready
	.venv/bin/ruff check torchrl_ext tests examples benchmarks
	.venv/bin/ruff format --check torchrl_ext
	.venv/bin/mypy

test-main: .venv/.ready
	.venv/bin/python -m pytest

test-compat: .venv-torchrl010/.ready
	.venv-torchrl010/bin/python -m pytest -m compat

test: lint test-main test-compat

# Try the newest TorchRL release (or TORCHRL_TRY=torchrl==X.Y.Z): the internals check, the
# contract suite and the compat suite, in a throw-away venv. See docs/design.md.
TORCHRL_TRY ?= torchrl
try-torchrl:
	rm -rf .venv-torchrl-try && $(PYTHON) -m venv .venv-torchrl-try
	.venv-torchrl-try/bin/pip install $(PIP_FLAGS) $(TORCH)
	.venv-torchrl-try/bin/pip install $(PIP_FLAGS) --upgrade "$(TORCHRL_TRY)" psutil numpy pytest pytest-timeout
	.venv-torchrl-try/bin/pip install $(PIP_FLAGS) --no-deps -e .
	.venv-torchrl-try/bin/python -m pytest tests/test_compat.py tests/contract
	.venv-torchrl-try/bin/python -m pytest -m compat

docs: .venv/.ready
	.venv/bin/python -m mkdocs build --strict

clean:
	rm -rf .venv .venv-torchrl010 .pytest_cache .mypy_cache .ruff_cache site
