"""One episode ledger for every env worker: each episode once per epoch, across all of them.

:class:`EpisodeLedger` is the owner's side: it starts the ledger's own process
(``_ledger_service``) and asks it for ``stats()``, ``state_dict()``...; it pickles into a
:class:`LedgerClient`, the workers' side, which connects once per process and asks for episodes.

With ``num_readers=0`` there are no readers: the ledger hands out indices, the worker calls
``dataset[index]`` itself, and the ledger asks the kernel to read the next episodes' files
ahead (``posix_fadvise(WILLNEED)``) where the dataset names them (``episode_path(index)``).
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sized
from multiprocessing.connection import Client, Connection
from typing import Any

import psutil
import torch

from .. import _closers, _identity
from .._cpython import finalize
from .._errors import format_exitcode
from ._closing import Closing
from ._ledger_service import Plan, serve
from ._ledger_state import LedgerState, no_episodes_message
from ._readers import (
    acquire_reaper,
    describe_dataset,
    describe_error,
    end_supervised,
    first_message,
    owner_tag,
    release_reaper,
    start_supervised,
)

__all__ = [
    "EpisodeLedger",
    "EpochsExhausted",
    "LedgerClient",
    "LedgerClosedError",
    "NoEpisodesError",
    "checked_state",
]

#: Seconds the ledger's process gets to close before SIGKILL.
_CLOSE_WAIT = 5.0
#: Seconds the ledger's process gets to say it started (its readers too) before it is ended.
START_WAIT = 60.0
#: Seconds a closing handle waits for the ledger to take note.
_GOODBYE_WAIT = 2.0
#: Seconds the owner waits for an answer of the ledger's process before it gives up on it.
_ANSWER_WAIT = 60.0
#: Longest Unix socket path Linux accepts (``sun_path`` less its terminator).
_MAX_SOCKET_PATH = 107


class EpochsExhausted(Exception):
    """Raised by ``next()`` once every episode of the ledger's ``epochs`` was handed out; only
    then (a ledger that can serve no episode at all raises :class:`NoEpisodesError`)."""


class NoEpisodesError(RuntimeError):
    """The ledger can serve no episode at all: its dataset has none (raised when the ledger is
    built), or every one is quarantined (raised by every ``next()`` from then on). The message
    names the dataset and the first quarantine reasons. Not the end of an epoch: let it end the
    run (an env's ``_reset`` that catches :class:`EpochsExhausted` lets it through)."""


class LedgerClosedError(ConnectionError):
    """The ledger is closed, or its process is gone: no episode can be handed out."""


def _read_bytes() -> int:
    try:
        return int(psutil.Process().io_counters().read_bytes)
    except (psutil.Error, AttributeError, NotImplementedError):
        return 0


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
        self._lock = threading.Lock()  # one exchange at a time on the connection

    def __reduce__(self) -> tuple[Any, ...]:
        return (LedgerClient, (self._address, self._authkey, self._dataset))

    def _connection(self) -> Connection:
        pid = os.getpid()
        if self._conn is None or self._pid != pid:
            try:
                conn = Client(self._address, family="AF_UNIX", authkey=self._authkey)
            except (OSError, EOFError) as err:
                raise LedgerClosedError(
                    f"cannot reach the episode ledger at {self._address!r} ({err}): it was closed, or "
                    "the process that built it is gone"
                ) from err
            conn.send(("hello", *_identity.me(), _read_bytes()))
            self._conn, self._pid, self._waited = conn, pid, None
            # A clean exit completes the held episode (multiprocessing workers run these too).
            finalize(self, _say_goodbye, (conn, pid), exitpriority=10)
        return self._conn

    def _ask(self, kind: str, detail: Any = None) -> tuple[Any, ...]:
        with self._lock:
            conn = self._connection()
            try:
                conn.send((kind, _read_bytes(), self._waited, detail))
                reply: tuple[Any, ...] = conn.recv()
            except BaseException as err:  # an interrupted exchange leaves the connection unusable
                self._conn = None
                conn.close()
                if isinstance(err, (EOFError, OSError)):
                    raise LedgerClosedError("the episode ledger closed, or its process is gone") from err
                raise
        return reply

    def next(self) -> tuple[int, Any]:
        """Finish the episode this process held and return the next: ``(index, episode)``.

        Raises :class:`EpochsExhausted` once the ledger's epochs are all handed out,
        :class:`NoEpisodesError` once no episode can be served at all (every one quarantined),
        and :class:`LedgerClosedError` once the ledger is closed.
        """
        started = time.perf_counter()
        reply = self._ask("next")
        while True:
            if reply[0] == "exhausted":
                raise EpochsExhausted(reply[1])
            if reply[0] == "no_episodes":
                raise NoEpisodesError(reply[1])
            if reply[0] != "episode":
                raise LedgerClosedError("the episode ledger is closing")
            _kind, epoch, index, path = reply
            try:
                episode = self._load(index, path)
            except Exception as err:  # the episode cannot be loaded here: quarantined, next one
                reply = self._ask("failed", describe_error(err))
                continue
            self.epoch = epoch
            self._waited = time.perf_counter() - started
            return index, episode

    def _load(self, index: int, path: str | None) -> Any:
        if path is None:
            return self._dataset[index]
        try:  # mapped, not read: tensors share the page cache's pages (copy-on-write)
            return torch.load(path, mmap=True, weights_only=False)
        finally:
            os.unlink(path)

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
        if conn.poll(_GOODBYE_WAIT):
            conn.recv()
    except (EOFError, OSError):
        pass
    conn.close()


def checked_state(
    dataset: Any,
    num_readers: int,
    prefetch: int,
    options: tuple[bool, int | None, int | None, int],
    owner: str = "EpisodeLedger",
) -> LedgerState:
    """The bookkeeping a ledger (``owner`` names its class) starts with, once its arguments are
    checked; ``options``: ``(shuffle, seed, epochs, quarantine_after)``."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"{owner} needs a map-style dataset with a length (index -> episode)")
    if num_readers < 0 or prefetch < 1:
        raise ValueError(f"num_readers must be >= 0 and prefetch >= 1, got {num_readers}, {prefetch}")
    if not len(dataset):
        raise NoEpisodesError(no_episodes_message(describe_dataset(dataset), 0))
    return LedgerState(len(dataset), *options)


class EpisodeLedger(Closing):
    """Hand each episode of ``dataset`` to exactly one env worker per epoch, across all of them.

    Build it in the main process and pass it to the env workers (``create_env_kwargs``): it
    pickles into a :class:`LedgerClient`, and a forked copy connects on its own, so it works
    with ``ManagedParallelEnv`` on every start path and with upstream ``ParallelEnv``, daemonic
    workers included. In the env's ``_reset``, ``index, episode = self.episodes.next()``.

    * **Exactly once per epoch.** Epoch ``e`` hands out ``EpisodeSampler(len(dataset),
      shuffle, seed).epoch_order(e)``; the next epoch starts as soon as this one is handed out.
      An episode is completed when the worker that holds it asks for the next one or closes (a
      recycled worker closes); when that worker is lost (killed, hung and replaced, or simply
      gone) it goes back to the front of the queue (the next to load, after those loaded
      ahead). Which worker gets which episode depends on timing; the order of handed-out
      indices, losses aside, does not.
    * **Bounded readers.** ``num_readers`` processes load and parse ahead (``prefetch`` episodes
      per connected worker), whatever the number of workers; they and the ledger's own process
      (a child of this one) are watched like env workers: nothing is left behind on any exit.
      ``num_readers=0``: the worker calls ``dataset[index]`` itself (the dataset must then
      pickle) and the ledger asks the kernel to read ahead the files
      ``dataset.episode_path(index)`` names.
    * **Quarantine.** An episode whose load raises, or that was lost ``quarantine_after``
      times, is skipped for the rest of the run, logged once with its index (and path).
    * **Epochs.** ``epochs=None`` runs forever; after ``epochs`` epochs ``next()`` raises
      :class:`EpochsExhausted` (iterating a handle just stops).
    * **No episode at all.** A dataset with none raises :class:`NoEpisodesError` here; once
      every episode is quarantined, ``next()`` raises it (not :class:`EpochsExhausted`), naming
      the dataset (by its ``repr`` where its class defines one) and the first reasons.
    * **Signals.** A SIGTERM, SIGINT or SIGHUP that ``ManagedParallelEnv``'s handler turns into
      a close ends the ledger's processes too, after the envs.

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
        state = checked_state(dataset, num_readers, prefetch, (shuffle, seed, epochs, quarantine_after))
        self._closed = False
        self._num_episodes = state.num_episodes
        if multiprocessing_context is None and "fork" in multiprocessing.get_all_start_methods():
            multiprocessing_context = "fork"  # starts in milliseconds; torch is not re-imported
        ctx = multiprocessing.get_context(multiprocessing_context)
        self._owner = os.getpid()  # fixed: only this process closes the ledger
        self._lock = threading.Lock()  # one control call at a time
        self._asked = 0  # the number of the last control call; _call writes
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
            plan = Plan(
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
            self._process, _key = start_supervised(ctx, serve, args, "torchrl_ext-ledger", fifo, owner_tag())
            theirs.close()
            try:
                _asked, kind, detail = first_message(self._control, START_WAIT, "no answer", self._process)
            except TimeoutError as err:
                kind, detail = "error", str(err)
            except (EOFError, OSError):
                kind, detail = "error", f"it exited with {format_exitcode(self._process.exitcode)}"
            if kind != "ok":
                raise RuntimeError(f"the episode ledger's process could not start: {detail}")
        except BaseException:
            self._shutdown(
                getattr(self, "_process", None), getattr(self, "_control", None), locals().get("directory")
            )
            raise
        self._client = LedgerClient(address, plan.authkey, dataset if num_readers == 0 else None)
        # At interpreter exit it runs before multiprocessing joins its children (exitpriority).
        self._finalizer = finalize(
            self, self._shutdown, (self._process, self._control, directory), exitpriority=10
        )
        _closers.add(self._finalizer)  # a signal-driven close ends it after the envs

    @staticmethod
    def _shutdown(process: Any, control: Connection | None, directory: str | None) -> None:
        """Ask the ledger's process to close, wait for it, then let the runtime directory go."""
        if control is not None:
            try:
                control.send((-1, "close", ()))
                control.poll(_CLOSE_WAIT) and control.recv()
            except (EOFError, OSError):
                pass
            control.close()
        if process is not None:
            end_supervised(process, _CLOSE_WAIT)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        release_reaper()

    def _call(self, method: str, *args: Any) -> Any:
        if os.getpid() != self._owner:
            raise RuntimeError(f"EpisodeLedger.{method}() is for the process that built the ledger")
        with self._lock:
            if self._closed or not self._finalizer.still_active():  # closed, by a signal maybe
                raise LedgerClosedError("the episode ledger is closed")
            self._asked += 1
            try:
                self._control.send((self._asked, method, args))
                while True:  # answers to calls an interrupt cut short come first: skip them
                    if not self._control.poll(_ANSWER_WAIT):
                        raise TimeoutError(f"no answer in {_ANSWER_WAIT:g} s")
                    asked, kind, value = self._control.recv()
                    if asked == self._asked:
                        break
            except (EOFError, OSError) as err:
                raise LedgerClosedError(
                    f"the episode ledger's process (pid {self._process.pid}) is gone: "
                    f"{format_exitcode(self._process.exitcode)} ({err})"
                ) from err
        if kind == "raise":
            raise value
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        return self._client.__reduce__()

    def client(self) -> LedgerClient:
        """A handle of its own: one episode held per handle and process. Give one to each env
        that shares a process with others (the envs of a ``SerialEnv``, say); across processes
        the ledger itself is enough.

        Example:
            >>> import torch
            >>> with EpisodeLedger([torch.zeros(2)] * 3, num_readers=0, epochs=1) as ledger:
            ...     a, b = ledger.client(), ledger.client()
            ...     held = a.next()[0], b.next()[0]  # each holds one
            ...     sorted(held + (ledger.next()[0],))
            [0, 1, 2]
        """
        return LedgerClient(*self._client.__reduce__()[1])

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
        share of the current epoch's episodes that can be served, quarantined ones left out;
        0.0 when none can be), ``readers``, ``readers_alive``, ``reader_restarts``,
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
