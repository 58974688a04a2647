"""The ownership rule (``_identity``): a process is ours only by its identity, never by its pid
alone, and a process group only while a process of ours anchors it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest

from tests.test_close import _STRANGER  # leads its own group, one child in it
from torchrl_ext import _identity
from torchrl_ext._identity import same_process, start_time, tree
from torchrl_ext._starting import StartingWorker


@pytest.fixture
def stranger() -> Iterator[tuple[psutil.Process, int]]:
    """A stranger leading its own process group, and its child's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STRANGER], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        helper = int(proc.stdout.readline())
        yield psutil.Process(proc.pid), helper
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


@pytest.mark.compat
@pytest.mark.skipif(not _identity._PROC_STAT, reason="start times are the kernel's only on Linux")
@pytest.mark.parametrize("seconds_later", [1, 2])
def test_a_stranger_born_whole_seconds_after_a_dead_worker_is_not_that_worker(
    stranger: tuple[psutil.Process, int], seconds_later: int
) -> None:
    """A dead worker's pid reused by a stranger born exactly ``seconds_later`` seconds (to the
    clock tick) after the worker: the stranger is not the worker, its group is not the worker's
    and nothing of it is in the worker's tree. Before, identity allowed whole seconds of drift
    on Linux too: the close took such a stranger for its dead worker, anchored the recycled group
    on it and killed the stranger's child (CI, under load)."""
    proc, helper = stranger
    born = start_time(proc)
    dead_worker = {proc.pid: (born - seconds_later, proc.pid)}  # pid -> (create time, group)
    assert same_process(proc.pid, born) == proc
    assert same_process(proc.pid, born - seconds_later) is None
    assert os.getpgid(helper) == proc.pid
    found = tree(dead_worker, include_workers=False, dying=True)
    assert helper not in {p.pid for p in found}, "the stranger's child was taken for the dead worker's"
    assert not found


@pytest.mark.compat
@pytest.mark.skipif(not _identity._PROC_STAT, reason="start times are the kernel's only on Linux")
def test_a_starting_worker_whose_pid_was_reused_is_not_killed(stranger: tuple[psutil.Process, int]) -> None:
    """A worker being started that does not answer its hand-off in time is killed by identity:
    a stranger that holds its pid now (born after it) is left alone; the worker itself is killed."""
    proc, _ = stranger
    born = start_time(proc)
    process = SimpleNamespace(pid=proc.pid)
    StartingWorker(0, process, None, None, 0.0, create_time=born - 1).kill()  # an earlier process's pid
    assert proc.status() != psutil.STATUS_ZOMBIE
    StartingWorker(0, process, None, None, 0.0, create_time=born).kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.compat
def test_a_recycled_group_is_left_alone_even_when_its_worker_was_alive_a_moment_ago(
    stranger: tuple[psutil.Process, int],
) -> None:
    """A close anchors the groups of the workers it ended (``recent_groups``: alive a moment
    ago). If such a worker's pid was taken since by a stranger leading a new group, the group id
    is the stranger's: neither the stranger nor its child is in the tree."""
    proc, helper = stranger
    dead_worker = {proc.pid: (start_time(proc) - 0.5, proc.pid)}
    found = tree(dead_worker, recent_groups=[proc.pid], include_workers=False, dying=True)
    assert not {p.pid for p in found} & {proc.pid, helper}, found


@pytest.mark.compat
def test_one_pass_lists_each_trees_descendants_as_psutil_does(stranger: tuple[psutil.Process, int]) -> None:
    proc, child = stranger
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    trees = _identity.descendants_of([os.getpid(), proc.pid, child, gone.pid])
    for pid in (os.getpid(), proc.pid, child):
        listed = sorted(p.pid for p in psutil.Process(pid).children(recursive=True))
        assert sorted(p.pid for p in trees[pid]) == listed
    assert {proc.pid, child} <= {p.pid for p in trees[os.getpid()]}  # grandchildren too
    assert [p.pid for p in trees[proc.pid]] == [child]
    assert trees[child] == [] and trees[gone.pid] == []


#: Run by the test below: a process with no child, a child (which has its own child), a child
#: started by a thread that has ended, or a zombie child; it prints "ready", and at EOF on its
#: stdin ends and collects its children (as the middle one does its own).
_FAMILY = """
import os, subprocess, sys, threading
mode, kids, zombie = sys.argv[1], [], None
if mode == "grandchild":
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               "p = subprocess.Popen(['sleep', '60']); print('x', flush=True); "
                               "sys.stdin.read(); p.kill(); p.wait()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    middle.stdout.readline()
    kids.append(middle)
elif mode == "thread":
    thread = threading.Thread(target=lambda: kids.append(subprocess.Popen(["sleep", "60"])))
    thread.start()
    thread.join()
elif mode == "zombie":
    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
print("ready", flush=True)
sys.stdin.read()
for kid in kids:
    if kid.stdin is not None:
        kid.stdin.close()
    else:
        kid.kill()
    kid.wait()
if zombie is not None:
    os.waitpid(zombie, 0)
"""


@pytest.mark.skipif(not _identity._platform.has_proc_children(), reason="no /proc/PID/task/TID/children")
@pytest.mark.parametrize("mode", ["none", "grandchild", "thread", "zombie"])
def test_descendants_read_from_the_children_files_are_psutils(mode: str) -> None:
    """``descendants`` skips the scan of every process where a process's own ``children``
    files show it has none; otherwise, and wherever they show a child, it lists what psutil
    lists (a grandchild, a child whose thread ended, a zombie child)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAMILY, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "ready\n"
        expected = sorted(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        assert _identity._platform.has_children(proc.pid) is (mode != "none")
        assert sorted(p.pid for p in _identity.descendants(proc.pid)) == expected
        assert len(expected) == {"none": 0, "grandchild": 2, "thread": 1, "zombie": 1}[mode]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()
    assert _identity._platform.has_children(proc.pid) is None  # gone (collected)
