"""One episode ledger for every env worker: each episode once per epoch, across all of them.

Data flow (every arrow is a pickled message; episodes go through spool files)::

    env worker (any process)           the ledger's process                      readers
    ------------------------           --------------------                      -------
    LedgerClient.next() --("next")---> a thread per connection
                                       LedgerState, pending loads (one lock)
    torch.load(path, mmap=True) <----- ("episode", epoch, index, path)
                                       dispatcher thread ---(item, index, path)---> reader k
                                                         <---("ok", item, nbytes)--  torch.save
                                                                                     to path

A connection is one worker process. Its lease is the episode it plays; the lease completes when
the same connection asks for its next episode or closes, and is lost when the connection ends
without closing or its process (pid and create time) is gone, checked every ``PEER_CHECK``
seconds. A lost episode goes back to the front of the queue; at ``quarantine_after`` losses, or
at the first load that raises, the episode is quarantined. Failure is decided in one place per
side: ``_Service._serve`` for workers, ``_Service._on_reader`` for readers.

With ``num_readers=0`` there are no readers: the ledger hands out indices, the worker calls
``dataset[index]`` itself, and the ledger asks the kernel to read the next episodes' files
ahead (``posix_fadvise(WILLNEED)``) where the dataset names them (``episode_path(index)``).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from multiprocessing import connection, util
from multiprocessing.connection import Connection
from typing import Any, Literal

import psutil
import torch

from .. import _identity
from .._errors import format_exitcode
from ._closing import Closing
from ._ledger_state import Item, LedgerState
from ._readers import (
    Reader,
    ReaderPool,
    Supervised,
    acquire_reaper,
    describe_episode,
    describe_error,
    episode_path,
    owner_tag,
    release_reaper,
    start_supervised,
)

__all__ = ["EpisodeLedger", "EpochsExhausted", "LedgerClient", "LedgerClosedError"]

_logger = logging.getLogger("torchrl_ext")

#: Seconds between checks that a connected worker's process still exists.
PEER_CHECK = 0.5
#: Latest data waits kept for the p50/p95 in ``stats()``.
WAIT_WINDOW = 1024
#: Seconds the ledger's process gets to close before SIGKILL.
_CLOSE_WAIT = 5.0
#: Longest Unix socket path Linux accepts (``sun_path`` less its terminator).
_MAX_SOCKET_PATH = 107


class EpochsExhausted(Exception):
    """Raised by ``next()`` once every episode of the ledger's ``epochs`` was handed out."""


class LedgerClosedError(ConnectionError):
    """The ledger is closed, or its process is gone: no episode can be handed out."""


LoadStatus = Literal["loading", "ready", "failed"]


@dataclass
class _Load:
    """A pending item's load."""

    status: LoadStatus  # loading -> ready | failed; the dispatcher writes (ready at once: no readers)
    path: str | None = None  # the spool file once ready (None: the worker loads it itself)
    error: str = ""  # why it failed


def _read_bytes() -> int:
    try:
        return int(psutil.Process().io_counters().read_bytes)
    except (psutil.Error, AttributeError, NotImplementedError):
        return 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _will_need(path: str | None) -> None:
    """Ask the kernel to start reading ``path`` (a file, or every file of a directory)."""
    if path is None or not hasattr(os, "posix_fadvise"):
        return
    files = [path]
    if os.path.isdir(path):
        files = [os.path.join(root, name) for root, _dirs, names in os.walk(path) for name in names]
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class _Service:
    """The ledger's process side: the state, the listener, the readers and their threads. It
    runs in the ledger's own process (``_service_main``), never in the owner's, so a busy
    trainer holding its GIL never delays a worker's ``next()``."""

    def __init__(self, dataset: Any, state: LedgerState, plan: _Plan, supervised: Supervised) -> None:
        self.dataset = dataset  # fixed
        self.state = state  # guarded by ``cond``
        self.plan = plan  # fixed
        self.cond = threading.Condition()  # guards every field below that is not fixed
        self.spool = os.path.join(plan.dir, "spool")  # fixed: the readers' output
        self.loads: dict[Item, _Load] = {}  # pending item -> its load; _fill/_on_reader/_hand_out
        self.queue: deque[tuple[Item, int]] = deque()  # (item, try) waiting for an idle reader
        self.tries = itertools.count()  # names spool files uniquely
        self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)  # seconds each next() waited
        self.peer_bytes: dict[int, int] = {}  # holder -> read_bytes of its process since it connected
        self.gone_bytes = 0  # the same, of workers that left
        self.holders = itertools.count(1)  # connection ids
        self.connections: dict[int, Connection] = {}  # holder -> its live connection
        self.closing = False  # set once by close(); every thread exits on it
        self.error: BaseException | None = None  # the readers' start failed
        self.threads: list[threading.Thread] = []  # fixed once started
        self.pool = (  # fixed; None with num_readers=0
            ReaderPool(dataset, plan.num_readers, plan.context, plan.reader_nice, supervised)
            if plan.num_readers
            else None
        )
        os.mkdir(self.spool)
        self.listener = connection.Listener(plan.address, family="AF_UNIX", authkey=plan.authkey)
        started = threading.Event()
        self.threads = [
            threading.Thread(target=self._dispatch_loop, args=(started,), name="torchrl_ext-ledger-readers"),
            threading.Thread(target=self._accept_loop, name="torchrl_ext-ledger-accept"),
        ]
        for thread in self.threads:
            thread.daemon = True
            thread.start()
        started.wait()
        if self.error is not None:
            self.close()
            raise self.error

    # -- readers ------------------------------------------------------------------------------
    def _dispatch_loop(self, started: threading.Event) -> None:
        try:
            if self.pool is not None:
                self.pool.start()  # from this thread, which outlives the readers
        except BaseException as err:
            self.error = err
            return
        finally:
            started.set()
        while not self.closing:
            pool = self.pool
            if pool is None:
                with self.cond:
                    self.cond.wait(PEER_CHECK)
                continue
            with self.cond:
                waitables = pool.waitables()
            ready = connection.wait(waitables, timeout=PEER_CHECK)
            with self.cond:
                if self.closing:
                    return
                for reader in list(pool.readers):
                    if reader.conn in ready:
                        self._on_reader(reader)
                    if reader.process.sentinel in ready and reader.conn not in ready:
                        self._on_reader(reader)
                self._dispatch()
                self.cond.notify_all()

    def _on_reader(self, reader: Reader) -> None:
        """One reader has a result, or is gone: the one place a reader's fate is decided."""
        assert self.pool is not None
        try:
            kind, item, detail = reader.conn.recv()
        except (EOFError, OSError):
            self._reader_died(reader)
            return
        reader.task = None
        load = self.loads.get(item)
        if load is None:  # its item was decided meanwhile (the ledger's state was reloaded)
            return
        if kind == "ok":
            load.status = "ready"  # at the path named when the task was sent
        else:
            load.status, load.error = "failed", str(detail)

    def _reader_died(self, reader: Reader) -> None:
        assert self.pool is not None
        task, reader.task = reader.task, None
        fresh = self.pool.replace(reader)
        how = self.pool.exit_description(reader)
        if task is None:
            _logger.warning(
                "torchrl_ext ledger: reader pid %d died (%s); started pid %d", reader.pid, how, fresh.pid
            )
            return
        item, _path = task
        kept = self.state.lose_pending(item)
        if kept is None:
            self.loads.pop(item, None)
            self._quarantined(item[1], self.state.quarantined[item[1]])
        else:
            self.queue.appendleft((item, next(self.tries)))
        _logger.warning(
            "torchrl_ext ledger: reader pid %d died (%s) loading %s; started pid %d",
            reader.pid,
            how,
            describe_episode(self.dataset, item[1]),
            fresh.pid,
        )

    def _dispatch(self) -> None:
        """Give queued loads to idle readers."""
        if self.pool is None:
            return
        for reader in self.pool.idle():
            if not self.queue:
                return
            item, attempt = self.queue.popleft()
            path = os.path.join(self.spool, f"{item[0]}-{item[1]}-{attempt}.pt")
            try:
                reader.conn.send((item, item[1], path))
            except OSError:  # it died: its sentinel says so next
                self.queue.appendleft((item, attempt))
                continue
            reader.task = (item, path)
            self.loads[item].path = path

    def _fill(self) -> None:
        """Keep ``prefetch`` items pending per connected worker, their loads started: workers of
        a batched env reset together, and each should find its episode ready."""
        depth = self.plan.prefetch * max(1, len(self.connections))
        while len(self.state.pending) < depth:
            item = self.state.take()
            if item is None:
                return
            if self.pool is None:
                self.loads[item] = _Load("ready")
                _will_need(episode_path(self.dataset, item[1]))
            else:
                self.loads[item] = _Load("loading")
                self.queue.append((item, next(self.tries)))
        self._dispatch()

    # -- workers ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closing:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError):
                if self.closing:
                    return
                continue
            if self.closing:
                conn.close()
                return
            holder = next(self.holders)
            thread = threading.Thread(
                target=self._serve, args=(conn, holder), name=f"torchrl_ext-ledger-{holder}", daemon=True
            )
            thread.start()

    def _serve(self, conn: Connection, holder: int) -> None:
        """One worker's connection: the one place its lease is completed or lost."""
        closed = False
        pid = -1
        try:
            _hello, pid, ctime, baseline = conn.recv()
            with self.cond:
                self.connections[holder] = conn
            while not self.closing:
                if not conn.poll(PEER_CHECK):
                    if not _identity.running(pid, ctime):
                        break
                    continue
                kind, read_bytes, waited, detail = conn.recv()
                with self.cond:
                    self.peer_bytes[holder] = read_bytes - baseline
                    if waited is not None:
                        self.waits.append(waited)
                    if kind == "close":
                        self.state.complete(holder)
                        closed = True
                        conn.send(("bye",))
                        return
                    if kind == "failed":  # the worker's own dataset[index] raised
                        self._reject(holder, str(detail))
                    reply = self._hand_out(holder)
                conn.send(reply)
        except (EOFError, OSError):
            pass
        finally:
            with self.cond:
                self.connections.pop(holder, None)
                self.gone_bytes += self.peer_bytes.pop(holder, 0)
                if not closed and not self.closing:
                    self._lost(holder, pid)
            conn.close()

    def _hand_out(self, holder: int) -> tuple[Any, ...]:
        """Complete ``holder``'s episode and lease it the next one (called with the lock)."""
        self.state.complete(holder)
        while True:
            self._fill()
            if not self.state.pending:
                return ("exhausted", self._exhausted_message())
            item = self.state.pending[0]
            load = self.loads[item]
            if load.status == "failed":
                del self.loads[item]
                self.state.quarantine(item, load.error)
                self._quarantined(item[1], load.error)
                continue
            if load.status == "ready":
                del self.loads[item]
                self.state.lease(holder)
                return ("episode", item[0], item[1], load.path)
            self.cond.wait(PEER_CHECK)
            if self.closing:
                return ("closed",)

    def _reject(self, holder: int, why: str) -> None:
        item = self.state.leases.pop(holder, None)
        if item is not None:
            self.state.quarantined.setdefault(item[1], why)
            self._quarantined(item[1], why)

    def _lost(self, holder: int, pid: int) -> None:
        item = self.state.leases.get(holder)
        if item is None:
            return
        kept = self.state.lose(holder)
        if kept is None:
            self._quarantined(item[1], self.state.quarantined[item[1]])
        else:
            _logger.info(
                "torchrl_ext ledger: worker pid %d is gone with episode %d of epoch %d; it goes back "
                "to the front of the queue",
                pid,
                item[1],
                item[0],
            )
        self.cond.notify_all()

    def _quarantined(self, index: int, why: str) -> None:
        _logger.warning(
            "torchrl_ext ledger: %s is quarantined for the rest of the run: %s",
            describe_episode(self.dataset, index),
            why,
        )

    def _exhausted_message(self) -> str:
        return (
            f"every episode of the ledger's {self.state.epochs} epoch(s) was handed out "
            f"({self.state.done} completed, {len(self.state.leases)} still played, "
            f"{len(self.state.quarantined)} quarantined)"
        )

    # -- the owner's view -----------------------------------------------------------------------
    def _stats(self) -> dict[str, float | int]:
        state, pool = self.state, self.pool
        waits = list(self.waits)
        worker_bytes = self.gone_bytes + sum(self.peer_bytes.values())
        return {
            "epoch": state.current,
            "served": state.served,
            "completed": state.done,
            "in_flight": len(state.leases),
            "requeued": state.requeued,
            "quarantined": len(state.quarantined),
            "duplicates": state.duplicates,
            "coverage": state.coverage(state.current),
            "readers": 0 if pool is None else len(pool.readers),
            "readers_alive": 0 if pool is None else pool.alive(),
            "reader_restarts": 0 if pool is None else pool.restarts,
            "workers_connected": len(self.connections),
            "data_wait_ms_p50": 1000 * _percentile(waits, 0.5),
            "data_wait_ms_p95": 1000 * _percentile(waits, 0.95),
            "read_bytes": worker_bytes + (0 if pool is None else pool.read_bytes()),
        }

    def close(self) -> None:
        with self.cond:
            if self.closing:
                return
            self.closing = True
            self.cond.notify_all()
            for conn in self.connections.values():
                try:
                    conn.close()
                except OSError:
                    pass
        try:  # wake the accept loop
            connection.Client(self.plan.address, family="AF_UNIX", authkey=self.plan.authkey).close()
        except (OSError, EOFError):
            pass
        self.listener.close()
        for thread in self.threads:
            thread.join(5.0)
        if self.pool is not None:
            self.pool.close()

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """What the owner asks for over the control pipe."""
        with self.cond:
            if method == "stats":
                return self._stats()
            if method == "load_state_dict":
                self.state.load_state_dict(*args)
                self.loads.clear()
                self.queue.clear()
                return None
            if method == "finished":
                return self.state.exhausted()
            if method == "quarantined":
                return dict(self.state.quarantined)
            if method == "pids":
                return [os.getpid(), *(r.pid for r in (self.pool.readers if self.pool else ()))]
            result = getattr(self.state, method)(*args)  # state_dict, completed_in
            return result


@dataclass(frozen=True)
class _Plan:
    """Everything the ledger's process is started with, beside the dataset and the state."""

    dir: str  # the ledger's directory, inside the owner's runtime directory
    address: str  # the Unix socket workers connect to
    authkey: bytes  # what they authenticate with
    num_readers: int
    prefetch: int
    context: str | None  # how the ledger's process and its readers start
    reader_nice: int | None


def _service_main(
    dataset: Any, state: LedgerState, plan: _Plan, control: Connection, supervised: Supervised
) -> None:
    """The ledger's process: serve until the owner says close, or is gone."""
    supervised.enter()
    parent = supervised.parent
    try:
        service = _Service(dataset, state, plan, supervised)
    except BaseException as err:
        control.send(("error", f"{type(err).__name__}: {err}"))
        return
    control.send(("ok", None))
    try:
        while True:
            if not control.poll(PEER_CHECK):
                if os.getppid() != parent:
                    return
                continue
            try:
                method, args = control.recv()
            except (EOFError, OSError):
                return
            if method == "close":
                service.close()
                control.send(("ok", None))
                return
            try:
                control.send(("ok", service.call(method, args)))
            except Exception as err:
                control.send(("raise", err))
    finally:
        service.close()


class LedgerClient:
    """A worker's handle on an :class:`EpisodeLedger`: what the ledger pickles into.

    One connection per process, opened at the first :meth:`next`, so a handle copied into a
    forked process connects on its own. :meth:`next` completes the episode this process held
    and returns the next one as ``(index, episode)``.
    """

    def __init__(self, address: str, authkey: bytes, dataset: Any = None) -> None:
        self._address = address  # fixed
        self._authkey = authkey  # fixed
        self._dataset = dataset  # fixed: set only with num_readers=0, where workers load
        self._conn: Connection | None = None  # this process's connection; _connection writes
        self._pid = -1  # the process ``_conn`` belongs to
        self._waited: float | None = None  # the last next()'s wait, sent with the following one
        self.epoch = -1  # the epoch of the episode this process holds (-1: none yet)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LedgerClient, (self._address, self._authkey, self._dataset))

    def _connection(self) -> Connection:
        pid = os.getpid()
        if self._conn is None or self._pid != pid:
            try:
                conn = connection.Client(self._address, family="AF_UNIX", authkey=self._authkey)
            except (OSError, EOFError) as err:
                raise LedgerClosedError(
                    f"cannot reach the episode ledger at {self._address!r} ({err}): it was closed, or "
                    "the process that built it is gone"
                ) from err
            conn.send(("hello", *_identity.me(), _read_bytes()))
            self._conn, self._pid, self._waited = conn, pid, None
            # A clean exit completes the held episode (multiprocessing workers run these too).
            util.Finalize(self, _say_goodbye, args=(conn, pid), exitpriority=10)
        return self._conn

    def _ask(self, kind: str, detail: Any = None) -> tuple[Any, ...]:
        conn = self._connection()
        try:
            conn.send((kind, _read_bytes(), self._waited, detail))
            reply: tuple[Any, ...] = conn.recv()
        except (EOFError, OSError) as err:
            self._conn = None
            raise LedgerClosedError("the episode ledger closed, or its process is gone") from err
        return reply

    def next(self) -> tuple[int, Any]:
        """Finish the episode this process held and return the next: ``(index, episode)``.

        Raises :class:`EpochsExhausted` once the ledger's epochs are all handed out, and
        :class:`LedgerClosedError` once the ledger is closed.
        """
        started = time.perf_counter()
        reply = self._ask("next")
        while True:
            if reply[0] == "exhausted":
                raise EpochsExhausted(reply[1])
            if reply[0] != "episode":
                raise LedgerClosedError("the episode ledger is closing")
            _kind, epoch, index, path = reply
            try:
                episode = self._load(index, path)
            except Exception as err:
                if path is not None:
                    raise
                reply = self._ask("failed", describe_error(err))
                continue
            self.epoch = epoch
            self._waited = time.perf_counter() - started
            return index, episode

    def _load(self, index: int, path: str | None) -> Any:
        if path is None:
            return self._dataset[index]
        # Mapped, not read: tensors share the page cache's pages (copy-on-write).
        episode = torch.load(path, mmap=True, weights_only=False)
        os.unlink(path)
        return episode

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """``(index, episode)`` until the ledger's epochs are exhausted."""
        while True:
            try:
                yield self.next()
            except EpochsExhausted:
                return

    def close(self) -> None:
        """Complete the held episode and disconnect this process (idempotent)."""
        if self._conn is not None and self._pid == os.getpid():
            _say_goodbye(self._conn, self._pid)
        self._conn = None


def _say_goodbye(conn: Connection, pid: int) -> None:
    if os.getpid() != pid or conn.closed:
        return
    try:
        conn.send(("close", _read_bytes(), None, None))
        conn.recv()
    except (EOFError, OSError):
        pass
    conn.close()


class EpisodeLedger(Closing):
    """Hand each episode of ``dataset`` to exactly one env worker per epoch, across all of them.

    Build it in the main process and pass it to the env workers (``create_env_kwargs``): it
    pickles into a :class:`LedgerClient`, and a forked copy connects on its own, so it works
    with ``ManagedParallelEnv`` on every start path and with upstream ``ParallelEnv``, daemonic
    workers included. In the env's ``_reset``, ``index, episode = self.episodes.next()``.

    * **Exactly once per epoch.** Epoch ``e`` hands out ``EpisodeSampler(len(dataset),
      shuffle, seed).epoch_order(e)``; the next epoch starts as soon as this one is handed out.
      An episode is completed when the worker that holds it asks for the next one or closes;
      when that worker is lost (killed, hung and replaced, recycled, or simply gone) it goes back
      to the front of the queue. Which worker gets which episode depends on timing; the order
      of handed-out indices, losses aside, does not.
    * **Bounded readers.** ``num_readers`` processes load and parse ahead (``prefetch`` episodes
      per connected worker),
      whatever the number of workers; they are children of this process, watched like env
      workers (nothing is left behind on any exit). ``num_readers=0``: the worker calls
      ``dataset[index]`` itself (the dataset must then pickle) and the ledger asks the kernel
      to read ahead the files ``dataset.episode_path(index)`` names.
    * **Quarantine.** An episode whose load raises, or that was lost ``quarantine_after``
      times, is skipped for the rest of the run, logged once with its index (and path).
    * **Epochs.** ``epochs=None`` runs forever; after ``epochs`` epochs ``next()`` raises
      :class:`EpochsExhausted` (iterating a handle just stops).

    ``stats()`` is a flat snapshot in TorchRL's convention; ``state_dict()`` and
    ``load_state_dict()`` resume the epoch where it was. See docs/heavy-resets.md.

    Example:
        >>> import torch
        >>> episodes = [torch.full((3,), float(i)) for i in range(4)]
        >>> with EpisodeLedger(episodes, num_readers=1, shuffle=False, epochs=1) as ledger:
        ...     [index for index, _episode in ledger]
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        dataset: Any,
        num_readers: int = 2,
        shuffle: bool = True,
        seed: int | None = None,
        *,
        epochs: int | None = None,
        quarantine_after: int = 2,
        prefetch: int = 2,
        multiprocessing_context: str | None = None,
        reader_nice: int | None = 19,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError("EpisodeLedger needs a map-style dataset with a length (index -> episode)")
        if num_readers < 0 or prefetch < 1:
            raise ValueError(f"num_readers must be >= 0 and prefetch >= 1, got {num_readers}, {prefetch}")
        self._closed = False
        self._num_episodes = len(dataset)
        state = LedgerState(len(dataset), shuffle, seed, epochs, quarantine_after)
        if multiprocessing_context is None and "fork" in multiprocessing.get_all_start_methods():
            multiprocessing_context = "fork"  # starts in milliseconds; torch is not re-imported
        ctx = multiprocessing.get_context(multiprocessing_context)
        self._owner = os.getpid()  # fixed: only this process closes the ledger
        self._lock = threading.Lock()  # one control call at a time
        # Inside the reaper's directory, which the reaper removes if this process dies.
        fifo = acquire_reaper()
        try:
            directory = tempfile.mkdtemp(prefix="ledger-", dir=os.path.dirname(fifo))
            address = os.path.join(directory, "s")
            if len(address) > _MAX_SOCKET_PATH:
                raise OSError(
                    f"the ledger's socket path {address!r} is longer than {_MAX_SOCKET_PATH} bytes; "
                    "set TMPDIR to a shorter directory"
                )
            plan = _Plan(
                directory,
                address,
                secrets.token_bytes(32),
                num_readers,
                prefetch,
                multiprocessing_context,
                reader_nice,
            )
            self._control, theirs = ctx.Pipe(duplex=True)
            args = (dataset, state, plan, theirs)
            self._process, _key = start_supervised(
                ctx, _service_main, args, "torchrl_ext-ledger", fifo, owner_tag()
            )
            theirs.close()
            kind, detail = self._control.recv()
            if kind != "ok":
                raise RuntimeError(f"the episode ledger's process could not start: {detail}")
        except BaseException:
            self._shutdown(
                getattr(self, "_process", None), getattr(self, "_control", None), locals().get("directory")
            )
            raise
        self._client = LedgerClient(address, plan.authkey, dataset if num_readers == 0 else None)
        self._finalizer = weakref.finalize(self, self._shutdown, self._process, self._control, directory)

    @staticmethod
    def _shutdown(process: Any, control: Connection | None, directory: str | None) -> None:
        """Ask the ledger's process to close, wait for it, then let the runtime directory go."""
        if control is not None:
            try:
                control.send(("close", ()))
                control.poll(_CLOSE_WAIT) and control.recv()
            except (EOFError, OSError):
                pass
            control.close()
        if process is not None:
            process.join(_CLOSE_WAIT)
            if process.exitcode is None:
                process.kill()
                process.join(_CLOSE_WAIT)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        release_reaper()

    def _call(self, method: str, *args: Any) -> Any:
        if os.getpid() != self._owner:
            raise RuntimeError(f"EpisodeLedger.{method}() is for the process that built the ledger")
        with self._lock:
            if self._closed:
                raise LedgerClosedError("the episode ledger is closed")
            try:
                self._control.send((method, args))
                kind, value = self._control.recv()
            except (EOFError, OSError) as err:
                raise LedgerClosedError(
                    f"the episode ledger's process (pid {self._process.pid}) is gone: "
                    f"{format_exitcode(self._process.exitcode)}"
                ) from err
        if kind == "raise":
            raise value
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        return self._client.__reduce__()

    def next(self) -> tuple[int, Any]:
        """:meth:`LedgerClient.next` for this process."""
        return self._client.next()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self._client)

    @property
    def epoch(self) -> int:
        """The epoch of the episode this process holds (-1: none yet)."""
        return self._client.epoch

    @property
    def num_episodes(self) -> int:
        return self._num_episodes

    @property
    def finished(self) -> bool:
        """Every episode of every epoch was handed out and completed (or quarantined);
        never true with ``epochs=None``."""
        return bool(self._call("finished"))

    def stats(self) -> dict[str, float | int]:
        """A snapshot: ``epoch``, ``served``, ``completed``, ``in_flight``, ``requeued``,
        ``quarantined``, ``duplicates`` (within an epoch: always 0), ``coverage`` (completed
        share of the current epoch), ``readers``, ``readers_alive``, ``reader_restarts``,
        ``workers_connected``, ``data_wait_ms_p50``/``_p95`` (each ``next()``, load included)
        and ``read_bytes`` (what the readers and workers read from storage)."""
        result: dict[str, float | int] = self._call("stats")
        return result

    def pids(self) -> list[int]:
        """The ledger's processes: its own, then its readers'."""
        result: list[int] = self._call("pids")
        return result

    def quarantined(self) -> dict[int, str]:
        """Quarantined episode indices and why."""
        result: dict[int, str] = self._call("quarantined")
        return result

    def completed_in(self, epoch: int) -> frozenset[int]:
        """The indices completed in ``epoch`` (the last few finished epochs are kept)."""
        result: frozenset[int] = self._call("completed_in", epoch)
        return result

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position, seed and quarantine; episodes in flight are replayed on resume."""
        result: dict[str, Any] = self._call("state_dict")
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (before the first episode is handed out)."""
        self._call("load_state_dict", state_dict)

    def close(self) -> None:
        """Stop the readers and the server; workers' next ``next()`` raises
        :class:`LedgerClosedError`. In another process, only disconnects that process."""
        if os.getpid() != self._owner:
            self._client.close()
            return
        if self._closed:
            return
        self._client.close()
        with self._lock:
            self._closed = True
        self._finalizer()
