# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned first, explicitly: an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
TORCH := torch==2.13.0
TORCHRL := torchrl==0.14.1
TORCHRL_OLD := "torchrl==0.10.1" "tensordict>=0.10,<0.11"
PIP_FLAGS := -q --disable-pip-version-check
# Every test run carries this tag; the leak fixture looks for processes that inherited it.
export TORCHRL_EXT_TEST_SESSION ?= make-$(shell date +%s)-$$PPID

.PHONY: demo test lint test-main test-compat test-stress docs bench clean try-torchrl

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

# `make test-stress`: the fault, close, exit, restart, forkserver and contract tests while
# tests/cpu_hog.py keeps every core busy (one spinning process per CPU, as `nproc` counts them,
# standard library only), the load under which timing-dependent supervision bugs show. The hog
# is started without the test-session tag (the leak fixture must not count it), is killed by the
# recipe's trap however pytest ends (it also exits by itself if this shell goes away), and the
# target's exit status is pytest's. Choose other tests with STRESS_TESTS (paths or node ids),
# e.g. `make test-stress STRESS_TESTS=tests/test_close.py`.
STRESS_TESTS ?= tests/test_faults.py tests/test_close.py tests/test_exit.py tests/test_restarts.py \
	tests/test_forkserver.py tests/contract
test-stress: .venv/.ready
	@env -u TORCHRL_EXT_TEST_SESSION .venv/bin/python tests/cpu_hog.py & hog=$$!; \
	trap 'kill $$hog 2>/dev/null; wait $$hog 2>/dev/null' EXIT; \
	trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP; \
	.venv/bin/python -m pytest $(STRESS_TESTS)

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
