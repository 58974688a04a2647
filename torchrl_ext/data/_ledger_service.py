"""The episode ledger's own process: the bookkeeping, the socket workers connect to, the readers.

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

The owner (``EpisodeLedger``) talks to this process through one control pipe: ``(number,
method, args)`` in, ``(number, "ok", value)`` or ``(number, "raise", exception)`` out (the
number skips answers to calls an interrupt cut short); ``close`` ends it, and so does the
owner's death.

The messages of a worker's connection, all tuples::

    worker -> ledger   ("hello", pid, create_time, read_bytes)     first, once
                       ("next", read_bytes, waited_s, None)         complete mine, give the next
                       ("failed", read_bytes, waited_s, why)        dataset[index] raised here
                       ("close", read_bytes, None, None)            complete mine, goodbye
    ledger -> worker   ("episode", epoch, index, path | None)       path None: load it yourself
                       ("exhausted", message)                       epochs are all handed out
                       ("no_episodes", message)                     none can be served at all
                       ("closed",) / ("bye",)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Literal

from .. import _identity
from ._ledger_state import Item, LedgerState, no_episodes_message
from ._readers import (
    Reader,
    ReaderPool,
    Supervised,
    describe_dataset,
    describe_episode,
    episode_path,
    first_message,
)

__all__ = ["Plan", "serve"]

_logger = logging.getLogger("torchrl_ext")

#: Seconds between checks that a connected worker's process still exists.
PEER_CHECK = 0.5
#: Seconds a new connection gets to say hello before it is closed (a peer that says nothing
#: holds no thread).
HELLO_WAIT = 30.0
#: Latest data waits kept for the p50/p95 in ``stats()``.
WAIT_WINDOW = 1024


LoadStatus = Literal["loading", "ready", "failed"]


@dataclass
class _Load:
    """A pending item's load."""

    status: LoadStatus  # loading -> ready | failed; the dispatcher writes (ready at once: no readers)
    path: str | None = None  # the spool file once ready (None: the worker loads it itself)
    error: str = ""  # why it failed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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

    def __init__(self, dataset: Any, state: LedgerState, plan: Plan, supervised: Supervised) -> None:
        self.dataset = dataset  # fixed
        self.state = state  # guarded by ``cond``
        self.plan = plan  # fixed
        self.cond = threading.Condition()  # guards every field below that is not fixed
        self.spool = os.path.join(plan.dir, "spool")  # fixed: the readers' output
        self.loads: dict[
            Item, _Load
        ] = {}  # pending item -> its load; _fill, _on_reader, _hand_out, _quarantined
        self.queue: deque[tuple[Item, int]] = deque()  # (item, try) waiting for an idle reader
        self.tries = itertools.count()  # names spool files uniquely
        self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)  # seconds each next() waited
        self.peer_bytes: dict[int, int] = {}  # holder -> read_bytes of its process since it connected
        self.gone_bytes = 0  # the same, of workers that left
        self.holders = itertools.count(1)  # connection ids
        self.connections: dict[int, Connection] = {}  # holder -> its live connection
        self.hints: list[int] = []  # indices to read ahead once the lock is let go; _fill, _serve
        self.closing = False  # set once by close(); every thread exits on it
        self.error: BaseException | None = None  # the readers' start failed
        self.threads: list[threading.Thread] = []  # fixed once started
        self.pool = (  # fixed; None with num_readers=0
            ReaderPool(dataset, plan.num_readers, plan.context, plan.reader_nice, supervised)
            if plan.num_readers
            else None
        )
        os.mkdir(self.spool)
        self.listener = Listener(plan.address, family="AF_UNIX", authkey=plan.authkey)
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
            ready = set(wait(waitables, timeout=PEER_CHECK))
            with self.cond:
                if self.closing:
                    return
                try:
                    for reader in list(pool.readers):
                        if reader.conn in ready or reader.process.sentinel in ready:
                            self._on_reader(reader)
                    self._replenish(pool)
                    self._dispatch()
                except Exception:  # never let the readers' thread die: workers would wait forever
                    _logger.exception("torchrl_ext ledger: error while serving the readers")
                self.cond.notify_all()

    def _on_reader(self, reader: Reader) -> None:
        """One reader has a result, or is gone: the one place a reader's fate is decided."""
        assert self.pool is not None
        message = None
        if reader.conn.poll(0):  # a result (a whole small message), or EOF
            try:
                message = reader.conn.recv()
            except (EOFError, OSError):
                message = None
        if message is None:
            if not reader.process.is_alive() or reader.conn.closed or reader.conn.poll(0):
                self._reader_died(reader)
            return
        kind, item, detail = message
        task, reader.task = reader.task, None
        load = self.loads.get(item)
        if load is None:  # its item was dropped meanwhile (quarantined, or the state reloaded)
            if kind == "ok" and task is not None:
                _unlink(task[1])
            return
        if kind == "ok":
            load.status = "ready"  # at the path named when the task was sent
        elif kind == "spool":  # the reader could not write the spool file: load it again
            self._lost_load(item, f"its spool file could not be written ({detail})")
        else:
            load.status, load.error = "failed", str(detail)

    def _reader_died(self, reader: Reader) -> None:
        assert self.pool is not None
        task, reader.task = reader.task, None
        self.pool.remove(reader)
        how = self.pool.exit_description(reader)
        what = "" if task is None else f" loading {describe_episode(self.dataset, task[0][1])}"
        _logger.warning("torchrl_ext ledger: reader pid %d died (%s)%s", reader.pid, how, what)
        if task is not None:
            self._lost_load(task[0], "its reader died")

    def _lost_load(self, item: Item, why: str) -> None:
        """A pending item's load was lost: load it again, or quarantine it at its last loss."""
        if item not in self.loads:  # dropped meanwhile
            return
        if self.state.lose_pending(item, why) is None:
            self.loads.pop(item, None)
            self._quarantined(item[1], self.state.quarantined[item[1]])
        else:
            self.loads[item] = _Load("loading")
            self.queue.appendleft((item, next(self.tries)))

    def _replenish(self, pool: ReaderPool) -> None:
        """Start the readers that are missing (one died); a failed start is retried later."""
        missing = pool.count - len(pool.readers)
        if missing <= 0:
            return
        try:
            for pid in pool.start():
                _logger.warning("torchrl_ext ledger: started reader pid %d", pid)
        except Exception as err:
            _logger.warning(
                "torchrl_ext ledger: could not start a reader (%s); trying again in %.1f s", err, PEER_CHECK
            )

    def _dispatch(self) -> None:
        """Give queued loads to idle readers."""
        if self.pool is None:
            return
        for reader in self.pool.idle():
            while self.queue and self.queue[0][0] not in self.loads:
                self.queue.popleft()  # dropped meanwhile
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
                self.hints.append(item[1])
            else:
                self.loads[item] = _Load("loading")
                self.queue.append((item, next(self.tries)))
        self._dispatch()

    # -- workers ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closing:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):
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
            _hello, pid, ctime, baseline = first_message(conn, HELLO_WAIT, "no hello")
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
                    if kind == "failed":  # the worker could not load what it was leased
                        self._reject(holder, str(detail))
                    reply = self._hand_out(holder, conn)
                    hints, self.hints = self.hints, []
                if reply[0] == "gone":  # it left while it waited: the next recv says how
                    continue
                try:
                    conn.send(reply)
                except OSError:  # it never got the episode: not its loss
                    with self.cond:
                        self._give_back(holder, reply)
                    raise
                for index in hints:  # outside the lock: a slow file system delays no one
                    _will_need(episode_path(self.dataset, index))
        except (EOFError, OSError):
            pass
        finally:
            with self.cond:
                self.connections.pop(holder, None)
                self.gone_bytes += self.peer_bytes.pop(holder, 0)
                if not closed and not self.closing:
                    self._lost(holder, pid)
            conn.close()

    def _hand_out(self, holder: int, conn: Connection) -> tuple[Any, ...]:
        """Complete ``holder``'s episode and lease it the next one (called with the lock)."""
        self.state.complete(holder)
        while True:
            self._fill()
            if not self.state.can_serve():
                return ("no_episodes", self._no_episodes_message())
            if not self.state.pending and not self.state.waiting():
                return ("exhausted", self._exhausted_message())
            item = self.state.pending[0] if self.state.pending else None
            if item is None:  # a cluster node waiting for its next grant
                self.cond.wait(PEER_CHECK)
                if self.closing:
                    return ("closed",)
                if conn.poll(0):
                    return ("gone",)
                continue
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
            if conn.poll(0):  # EOF (or a message out of turn): it is not waiting any more
                return ("gone",)

    def _give_back(self, holder: int, reply: tuple[Any, ...]) -> None:
        """An episode leased to ``holder`` never reached it: first in line again, no loss."""
        if reply[0] == "episode" and self.state.give_back(holder) is not None and reply[3] is not None:
            _unlink(reply[3])

    def _reject(self, holder: int, why: str) -> None:
        index = self.state.leases[holder][1] if holder in self.state.leases else None
        already = index in self.state.quarantined
        if self.state.reject(holder, why) is not None and not already:
            assert index is not None
            self._quarantined(index, why)

    def _lost(self, holder: int, pid: int) -> None:
        item = self.state.leases.get(holder)
        if item is None:
            return
        already = item[1] in self.state.quarantined
        kept = self.state.lose(holder)
        if kept is None:
            if not already:
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
        """An index was quarantined: drop the loads of its other copies, and say so once."""
        pending = set(self.state.pending)
        for item, load in self.loads.items():
            if item not in pending and load.status == "ready" and load.path is not None:
                _unlink(load.path)
        self.loads = {item: load for item, load in self.loads.items() if item in pending}
        self.queue = deque(entry for entry in self.queue if entry[0] in pending)
        _logger.warning(
            "torchrl_ext ledger: %s is quarantined for the rest of the run: %s",
            describe_episode(self.dataset, index),
            why,
        )

    def _exhausted_message(self) -> str:
        state = self.state
        return (
            f"every episode of the ledger's {state.epochs} epoch(s) was handed out "
            f"({state.done} completed, {len(state.leases)} still played, "
            f"{len(state.quarantined)} quarantined)"
        )

    def _no_episodes_message(self) -> str:
        causes = [(describe_episode(self.dataset, i), why) for i, why in self.state.first_causes()]
        return no_episodes_message(describe_dataset(self.dataset), self.state.num_episodes, causes)

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
            Client(self.plan.address, family="AF_UNIX", authkey=self.plan.authkey).close()
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
class Plan:
    """Everything the ledger's process is started with, beside the dataset and the state."""

    dir: str  # the ledger's directory, inside the owner's runtime directory
    address: str  # the Unix socket workers connect to
    authkey: bytes  # what they authenticate with
    num_readers: int
    prefetch: int
    context: str | None  # how the ledger's process and its readers start
    reader_nice: int | None


def serve(dataset: Any, state: LedgerState, plan: Plan, control: Connection, supervised: Supervised) -> None:
    """The ledger's process: serve until the owner says close, or is gone."""
    supervised.enter()
    parent = supervised.parent
    try:
        service = _Service(dataset, state, plan, supervised)
    except BaseException as err:
        control.send((0, "error", f"{type(err).__name__}: {err}"))
        return
    control.send((0, "ok", None))
    try:
        while True:
            if not control.poll(PEER_CHECK):
                if os.getppid() != parent:
                    return
                continue
            try:
                asked, method, args = control.recv()
            except (EOFError, OSError):
                return
            if method == "close":
                service.close()
                control.send((asked, "ok", None))
                return
            try:
                control.send((asked, "ok", service.call(method, args)))
            except Exception as err:
                control.send((asked, "raise", err))
    finally:
        service.close()
