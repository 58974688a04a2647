"""The episode ledger's reader processes: they load and parse episodes into a spool directory.

Readers are children of the ledger's process under the package's supervision, whatever env
class uses the ledger: each leads its own process group, carries an owner tag that processes it
execs inherit, arms the parent-death signal, and is reported to the external reaper, which
kills it (and its group) within milliseconds if the owner dies by any means. The one module of
``data/`` that starts processes (the ledger's own too, through :func:`start_supervised`), ends
them (:func:`end_supervised`) and bounds the first message read from a peer
(:func:`first_message`), with the package's one bounded wait (``_wait``).

A reader's whole protocol, on its end of a pipe::

    parent -> reader   (item, index, path)      load dataset[index], torch.save it to path
                       None                     exit
    reader -> parent   ("ok", item, nbytes)     path is complete
                       ("error", item, why)     dataset[index] raised: "ValueError: ..."
                       ("spool", item, why)     the spool file could not be written
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import torch

from .. import _identity, _platform, _reaper_client, _wait
from .._errors import format_exitcode
from .._tag import new_env_tag

__all__ = [
    "Reader",
    "ReaderPool",
    "Supervised",
    "acquire_reaper",
    "describe_dataset",
    "describe_episode",
    "describe_error",
    "end_supervised",
    "episode_path",
    "first_message",
    "owner_tag",
    "release_reaper",
    "start_supervised",
]

_logger = logging.getLogger("torchrl_ext")

#: Seconds a reader gets to exit after it is asked to, before SIGKILL.
STOP_GRACE = 2.0
#: Longest description of a dataset an error quotes.
_DESCRIPTION_CHARS = 200


def acquire_reaper() -> str:
    """Start this process's external reaper if needed and hold it until
    :func:`release_reaper`. Returns its FIFO; the directory around it is this process's runtime
    directory, which the reaper removes if this process dies by any means."""
    return _reaper_client.acquire()


def release_reaper() -> None:
    _reaper_client.release()


def episode_path(dataset: Any, index: int) -> str | None:
    """Where ``dataset`` says episode ``index`` lives (its ``episode_path(index)``), or None."""
    locate = getattr(dataset, "episode_path", None)
    if locate is None:
        return None
    try:
        return str(locate(index))
    except Exception:  # a broken locator must not hide the load's own error
        return None


def describe_episode(dataset: Any, index: int) -> str:
    """``episode 3 (/logs/ep3.bin)``: the index, and the path where the dataset names it."""
    where = episode_path(dataset, index)
    return f"episode {index}{f' ({where})' if where else ''}"


def describe_dataset(dataset: Any) -> str:
    """The dataset as an error names it: its ``repr`` where its class defines one (a dataset
    whose ``__repr__`` names its folder is named by its folder), else its class and length, and
    where its first episode lives.

    Example:
        >>> describe_dataset([])
        '[]'
        >>> class Logs:
        ...     def __len__(self): return 2
        ...     def episode_path(self, index): return f"/data/{index}.csv"
        >>> describe_dataset(Logs())
        'Logs of 2 episode(s), the first at /data/0.csv'
    """
    if type(dataset).__repr__ is not object.__repr__:
        try:
            text = repr(dataset)
        except Exception:  # a broken repr must not hide the error that names the dataset
            text = ""
        if text:
            cut = len(text) > _DESCRIPTION_CHARS
            return text[: _DESCRIPTION_CHARS - 3] + "..." if cut else text
    try:
        size = len(dataset)
    except Exception:
        return type(dataset).__qualname__
    where = episode_path(dataset, 0) if size else None
    return f"{type(dataset).__qualname__} of {size} episode(s){f', the first at {where}' if where else ''}"


def describe_error(err: BaseException) -> str:
    """Why a load failed, in one line: ``ValueError: truncated log``."""
    return f"{type(err).__name__}: {err}"


def owner_tag() -> str:
    """A fresh owner tag for the ledger's processes (call it in the owner)."""
    return str(new_env_tag())


def start_supervised(
    ctx: Any, target: Any, args: tuple[Any, ...], name: str, fifo: str, tag: str, arm: bool | None = None
) -> tuple[BaseProcess, _identity.ProcessKey]:
    """Start ``target(*args, Supervised(...))`` in a process of its own group, reported to the
    reaper listening on ``fifo`` (from any process of the owner's tree). ``arm``: whether the
    calling thread outlives the process (default: the package's rule for env workers)."""
    if arm is None:
        arm = _platform.parent_death_outlives_worker(ctx.get_start_method())
    supervised = Supervised(os.getpid(), arm, tag, fifo)
    process = ctx.Process(target=target, args=(*args, supervised), name=name, daemon=False)
    process.start()
    assert process.pid is not None
    key = _identity.key_of(psutil.Process(process.pid)) or (process.pid, 0.0)
    _reaper_client.notify_watch(fifo, process.pid, key[1], process.pid)
    return process, key


def end_supervised(process: BaseProcess, grace: float) -> None:
    """End a process :func:`start_supervised` started, once it was asked to exit: wait up to
    ``grace`` seconds for it, then SIGKILL its group (it leads one) and reap it, bounded too.
    The one way ``data/`` ends its processes."""
    process.join(grace)
    if process.exitcode is None:  # not yet reaped: the group is still its own
        assert process.pid is not None
        try:
            _platform.kill_process_group(process.pid, signal.SIGKILL)
        except ValueError:  # it had not left our group yet
            process.kill()
        process.join(grace)


def first_message(conn: Connection, within: float, what: str, process: BaseProcess | None = None) -> Any:
    """The first message on ``conn``, read within ``within`` seconds: a peer that says nothing
    holds no one. Raises ``TimeoutError`` (``what`` names the limit), and ``EOFError`` when the
    peer closed the connection or ``process`` (the peer) exited first."""
    watched = [conn] if process is None else [conn, process.sentinel]

    def ready() -> bool:
        return conn.poll(0) or (process is not None and process.exitcode is not None)

    late = _wait.wait_for(
        ready, time.monotonic() + within, f"{what} within {within:g} s", sleep=_wait.on(watched)
    )
    if not late:
        assert isinstance(late, _wait.Late)
        raise TimeoutError(late.reason)
    if not conn.poll(0):  # the peer exited with nothing sent (callers catch it and say so)
        raise EOFError(what)
    return conn.recv()


@dataclass(frozen=True)
class Supervised:
    """What a process :func:`start_supervised` started needs to know of its supervision."""

    parent: int  # the pid that started it
    arm: bool  # whether the parent-death signal may be armed (the forking thread outlives it)
    tag: str  # the owner tag, inherited by what it execs
    fifo: str  # the owner's reaper, to report processes it starts itself

    def enter(self) -> None:
        """First thing in the process: lead a process group, die with the parent, tag."""
        _platform.new_process_group()
        if self.arm:
            _platform.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != self.parent:  # the parent died before the signal was armed
            os._exit(0)
        os.environ[_identity.OWNER_VAR] = self.tag
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle


def _reader_main(dataset: Any, conn: Connection, nice: int | None, supervised: Supervised) -> None:
    supervised.enter()
    torch.set_num_threads(1)  # as in a DataLoader worker: readers run side by side with the envs
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        item, index, path = task
        try:
            episode = dataset[index]
        except Exception as err:
            conn.send(("error", item, describe_error(err)))
            continue
        try:
            part = f"{path}.part"
            torch.save(episode, part)  # a worker maps it back: tensors are not copied again
            os.replace(part, path)
        except Exception as err:  # the spool's fault (a full disk), not the episode's
            conn.send(("spool", item, describe_error(err)))
            continue
        conn.send(("ok", item, os.path.getsize(path)))


@dataclass
class Reader:
    """One reader process and the parent's end of its pipe."""

    process: BaseProcess  # fixed; started by ReaderPool.start
    conn: Connection  # fixed; closed by ReaderPool when the reader is gone
    key: _identity.ProcessKey  # fixed: (pid, create time)
    task: tuple[Any, str] | None = None  # (item, path) it is loading; the ledger writes

    @property
    def pid(self) -> int:
        return self.key[0]


class ReaderPool:
    """``count`` reader processes started by ``context``; one that dies is removed, and the
    next :meth:`start` starts another."""

    def __init__(
        self, dataset: Any, count: int, context: str | None, nice: int | None, supervised: Supervised
    ) -> None:
        self._dataset = dataset  # fixed
        self._count = count  # fixed
        self._ctx = multiprocessing.get_context(context)  # fixed
        self._nice = nice  # fixed
        self._supervised = supervised  # fixed: the ledger process's own supervision
        self.readers: list[Reader] = []  # live readers; start/remove/close write
        self.restarts = 0  # readers started in place of one that died; start writes
        self._replaced = 0  # readers removed and not yet started again; remove/start write
        self._gone_read_bytes = 0  # storage bytes read by readers already gone
        self._last_read: dict[int, int] = {}  # pid -> its last read_bytes sample

    def start(self) -> list[int]:
        """Start the readers that are missing; returns their pids. Call it from the thread that
        outlives them: their parent-death signal follows the thread that forked them."""
        started = []
        while len(self.readers) < self._count:
            reader = self._start_one()
            self.readers.append(reader)
            started.append(reader.pid)
            if self._replaced:
                self._replaced -= 1
                self.restarts += 1
        return started

    def _start_one(self) -> Reader:
        ours, theirs = self._ctx.Pipe(duplex=True)
        args = (self._dataset, theirs, self._nice)
        sup = self._supervised
        process, key = start_supervised(
            self._ctx, _reader_main, args, "torchrl_ext-reader", sup.fifo, sup.tag
        )
        theirs.close()
        return Reader(process, ours, key)

    def idle(self) -> list[Reader]:
        return [r for r in self.readers if r.task is None]

    def waitables(self) -> list[Any]:
        """What ``multiprocessing.connection.wait`` should watch: pipes and exit sentinels."""
        return [r.conn for r in self.readers] + [r.process.sentinel for r in self.readers]

    @property
    def count(self) -> int:
        """How many readers the pool keeps."""
        return self._count

    def remove(self, reader: Reader) -> None:
        """``reader`` died: reap it; :meth:`start` puts another in its place."""
        self.readers.remove(reader)
        self._retire([reader])
        self._replaced += 1

    def exit_description(self, reader: Reader) -> str:
        """How ``reader`` ended, as the package's errors say it (``SIGKILL(-9)``)."""
        return format_exitcode(reader.process.exitcode)

    def alive(self) -> int:
        return sum(r.process.is_alive() for r in self.readers)

    def read_bytes(self) -> int:
        """Bytes the readers, past and present, read from storage."""
        total = self._gone_read_bytes
        for reader in self.readers:
            total += self._sample(reader.pid)
        return total

    def _sample(self, pid: int) -> int:
        try:
            self._last_read[pid] = psutil.Process(pid).io_counters().read_bytes
        except (psutil.Error, AttributeError, NotImplementedError):  # gone, or not on this OS
            pass
        return self._last_read.get(pid, 0)

    def _retire(self, readers: Iterable[Reader]) -> None:
        for reader in readers:
            self._gone_read_bytes += self._last_read.pop(reader.pid, 0)
            end_supervised(reader.process, STOP_GRACE)
            reader.conn.close()  # the reaper may keep its key: it checks identity before a kill

    def close(self) -> None:
        """Ask every reader to exit; SIGKILL the group of any that does not."""
        for reader in self.readers:
            self._sample(reader.pid)
            try:
                reader.conn.send(None)
            except OSError:
                pass
        readers, self.readers = self.readers, []
        self._retire(readers)
