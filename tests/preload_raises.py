"""A module that fails at import: the preloaded fork server must name it (tests/test_forkserver.py)."""

raise RuntimeError("tests.preload_raises refuses to be imported")
