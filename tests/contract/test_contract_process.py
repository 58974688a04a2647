"""Contract: what an env factory can see of the process it runs in is what upstream shows it.

A factory can only tell where it runs by its interpreter: its pid, its ``sys.argv``, working
directory and ``sys.path``, its main module, its thread count. Upstream builds the
spec-reading env in the main process and every worker by spawn (its default on TorchRL >=
0.11). The managed default forks workers from a preloaded server and reads specs in a
supervised child; by upstream's rules every process with another pid is a worker, so both
must look exactly like upstream's workers.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import START_METHODS, child_env, fd_table
from tests.contract.envs import make_counting_env, make_thread_checking_env
from tests.contract.helpers import HAS_DAEMON, Record, Variant, assert_same_as_upstream, closing, run_variants

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).with_name("argv_script.py")


def _run_script(impl: str, out: Path, cwd: Path, start_path: str) -> str:
    env = child_env()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), impl, str(out), start_path],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, f"{impl}: exit {result.returncode}\n{result.stderr[-4000:]}"
    return result.stdout.strip()


@pytest.mark.skipif(not HAS_DAEMON, reason="the default path is the preloaded server only on TorchRL >= 0.11")
def test_script_reading_argv_at_module_level_sees_what_spawn_shows(tmp_path: Path) -> None:
    """A script that reads ``sys.argv`` above its ``__main__`` guard works on the default path,
    and every process that builds the env sees the same ``sys.argv``, working directory,
    ``sys.path`` and main module (``__mp_main__``, by path) as upstream's spawned workers."""
    seen: dict[str, list[dict[str, object]]] = {}
    cwd = tmp_path / "elsewhere"  # not the script's directory: the working directory must follow
    cwd.mkdir()
    for impl in ("upstream", "managed"):
        out = tmp_path / impl
        out.mkdir()
        printed = _run_script(impl, out, cwd, "default")
        if impl == "managed":
            assert printed == "preloaded", printed
        seen[impl] = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    # Upstream: its 2 workers; managed: its 2 workers and the spec-reading process.
    assert len(seen["upstream"]) == 2 and len(seen["managed"]) == 3, seen
    upstream = seen["upstream"][0]
    assert upstream["argv"] == [str(SCRIPT), "upstream", str(tmp_path / "upstream"), "default"]
    assert upstream["cwd"] == str(cwd) and upstream["__main__.__name__"] == "__mp_main__"
    for impl, records in seen.items():
        for record in records:
            expected = dict(upstream)
            expected["argv"] = [str(SCRIPT), impl, str(tmp_path / impl), "default"]
            expected["module-level IMPL"] = impl
            assert record == expected, f"{impl} differs from upstream's spawned worker"


@pytest.mark.compat
@pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
def test_every_other_process_is_a_worker_by_its_thread_count(mp_start_method: str) -> None:
    """TorchRL's ``test_num_threads`` rule: a factory that runs outside the main process
    must see ``num_sub_threads`` torch threads, as a worker does (the spec-reading process
    too, which upstream does not have)."""
    sub_threads = torch.get_num_threads() + 1  # never what the main process runs
    factory = functools.partial(make_thread_checking_env, os.getpid(), sub_threads)

    def scenario(variant: Variant, rec: Record) -> None:
        env = rec(
            "build",
            lambda: variant(2, factory, num_sub_threads=sub_threads, mp_start_method=mp_start_method),
            describe=lambda env: "built",
        )
        if env is None:
            return
        with closing(env):
            rec("rollout", lambda: env.rollout(3).batch_size)

    assert_same_as_upstream(run_variants(scenario))


def _descriptor_kinds() -> Counter[str]:
    """This process's open pipes, sockets and anonymous descriptors (pidfds, eventfds), by
    kind. Paths are left out: torch's shared-memory buffers stay mapped until the env is
    collected, in upstream's env too, and our reaper's FIFO outlives the last close by design
    (``_reaper_client.LINGER``)."""
    return Counter(target.split(":[")[0] for target in fd_table().values() if not target.startswith("/"))


@pytest.mark.compat
@pytest.mark.parametrize("mp_start_method", ["default", *START_METHODS])
def test_close_leaves_no_pipe_socket_or_pidfd_open_while_the_env_is_referenced(mp_start_method: str) -> None:
    """Upstream's close drops its worker processes and channels, so their pipes close at once
    although the caller still holds the env; ours must too, not when a collection finds it."""

    def scenario(variant: Variant, rec: Record) -> None:
        def build_use_close() -> Any:
            env = variant(2, make_counting_env, mp_start_method=mp_start_method)
            with closing(env):
                env.rollout(3)
            return env

        build_use_close()  # process-wide helpers (a fork server, the resource tracker) start here
        before = _descriptor_kinds()
        env = build_use_close()
        rec("left open after close", lambda: dict(_descriptor_kinds() - before))
        del env

    assert_same_as_upstream(run_variants(scenario))
