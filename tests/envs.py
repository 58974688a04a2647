"""Test environments. Importable by reference, so they work under spawn and forkserver."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

OBS = 4


class EpisodeDataset(Dataset):  # type: ignore[type-arg]
    """Episode ``i`` is ``arange(OBS) + 100 * i``: values the tests can check."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(OBS, dtype=torch.float32) + 100.0 * i


class ToyEnv(EnvBase):
    """A small env whose reset may use a DataLoader or start subprocesses.

    loader: "none" | "per_reset" (a new DataLoader(num_workers=2) per reset, the discussion's
    literal pattern) | "persistent" (one DataLoader with persistent workers).
    """

    def __init__(
        self,
        loader: str = "none",
        dl_workers: int = 2,
        dl_context: str | None = None,
        subprocess_kind: str | None = None,
        step_sleep: float = 0.0,
        raise_in: str | None = None,
        ignore_sigterm: bool = False,
        block_close: bool = False,
        pid_dir: str | None = None,
        leak_in_init: bool = False,
        hold_gil: bool = False,
        hang_loader_start: bool = False,
        offset: bool = False,
        reset_sleep: float = 0.0,
        die_once_at_step: int | None = None,
        die_once_at_reset: int | None = None,
        die_flag: str | None = None,
        step_gate: str | None = None,
        die_in_init_if: str | None = None,
        grow_mb_per_step: int = 0,
        grow_mb_per_reset: int = 0,
        hold_mb: int = 0,
        init_gate: str | None = None,
        record_resets: bool = False,
        collect_from_reset: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=torch.Size([]), **kwargs)
        if offset:  # state that state_dict()/load_state_dict() carry, added to every observation
            self.register_buffer("offset", torch.zeros(OBS))
        if raise_in == "init" or (raise_in == "init_in_worker" and self._in_worker()):
            raise ValueError("boom in __init__")
        # Armed (the file exists): a worker built from now on dies while building its env, once
        # per ``die_flag`` file if one is given, else every time.
        armed = bool(die_in_init_if) and self._in_worker() and os.path.exists(str(die_in_init_if))
        if armed and (die_flag is None or _claim(die_flag)):
            os.kill(os.getpid(), signal.SIGKILL)
        # Armed (``<init_gate>.armed`` exists, or ``<init_gate>.once`` claimed): a worker built
        # from now on records "building" (with ``pid_dir``) and waits, in its factory, until
        # the file ``init_gate`` exists (never, for a hang).
        if init_gate and self._in_worker():
            once = os.path.exists(init_gate + ".once") and _claim(init_gate + ".once.taken")
            if os.path.exists(init_gate + ".armed") or once:
                if pid_dir:
                    _write_whole(
                        os.path.join(pid_dir, f"building-{os.getpid()}-{os.getpid()}"), str(os.getpid())
                    )
                while not os.path.exists(init_gate):
                    time.sleep(0.005)
        self.loader_kind = loader
        self.dl_workers = dl_workers
        self.dl_context = dl_context
        self.step_sleep = step_sleep
        self.hold_gil = hold_gil
        self.raise_in = raise_in
        self.block_close = block_close
        self.pid_dir = pid_dir
        self.hang_loader_start = hang_loader_start
        self.reset_sleep = reset_sleep
        #: SIGKILL this worker at its ``die_once_at_step``-th step, once per ``die_flag`` file.
        self.die_once_at_step = die_once_at_step
        #: The same at its ``die_once_at_reset``-th reset (in a worker).
        self.die_once_at_reset = die_once_at_reset
        self._resets = 0
        #: With ``pid_dir``, each reset in a worker records "reset<n>" (its n-th reset).
        self.record_resets = record_resets
        self.die_flag = die_flag
        #: In a worker, each step records "stepping" (with ``pid_dir``) and then waits until the
        #: file ``step_gate`` exists: the test decides when the step may end.
        self.step_gate = step_gate
        #: Each step (reset) keeps this many more MiB, every page touched (resident), until it dies.
        self.grow_mb_per_step = grow_mb_per_step
        self.grow_mb_per_reset = grow_mb_per_reset
        #: From its n-th reset on (0: never), each reset runs a full collection (``gc.collect()``).
        self.collect_from_reset = collect_from_reset
        self._kept: list[bytes] = []
        if hold_mb and self._in_worker():  # what a simulator holds: every page touched, its own
            self._kept.append(b"\x01" * (hold_mb << 20))
        self._steps = 0
        self._iter: Any = None
        self._loader: Any = None
        self._episode = 0
        self._t = 0
        self._current = torch.zeros(OBS)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._forked: list[int] = []
        self.observation_spec = Composite(observation=Unbounded(shape=(OBS,)))
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        if ignore_sigterm and self._in_worker():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if subprocess_kind is not None and self._in_worker():
            self._start_subprocess(subprocess_kind)
        if pid_dir is not None and self._in_worker():
            _write_whole(os.path.join(pid_dir, f"pdeathsig-{os.getpid()}"), str(_parent_death_signal()))
        if leak_in_init:  # a badly behaved env: its close() never stops this one
            cmd = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
            self._record("leak", subprocess.Popen(cmd).pid)

    def _in_worker(self) -> bool:
        """True in a ManagedParallelEnv worker (index >= 0), false in the spec-reading process."""
        return os.environ.get("TORCHRL_EXT_WORKER", "-1") != "-1"

    def _start_subprocess(self, kind: str) -> None:
        if kind == "forked_setsid":
            # Forked without exec, in a session of its own: neither the tag nor the worker's
            # process group shows it; only a snapshot of the worker's tree does.
            pid = os.fork()
            if pid == 0:
                try:
                    os.setsid()
                    while True:
                        time.sleep(1)
                finally:
                    os._exit(0)
            self._forked.append(pid)
            self._record("sim", pid)
            return
        cmd = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
        proc = subprocess.Popen(cmd, start_new_session=(kind == "setsid"))
        self._procs.append(proc)
        self._record("sim", proc.pid)

    def _record(self, what: str, pid: int) -> None:
        if self.pid_dir:
            _write_whole(os.path.join(self.pid_dir, f"{what}-{os.getpid()}-{pid}"), str(pid))

    def _next_episode(self) -> torch.Tensor:
        if self.loader_kind == "none":
            return EpisodeDataset()[self._episode % 8]
        if self.loader_kind == "per_reset":
            loader = DataLoader(
                EpisodeDataset(),
                batch_size=None,
                num_workers=self.dl_workers,
                sampler=[self._episode % 8],
                multiprocessing_context=self.dl_context,
            )
            episode = next(iter(loader))
            return episode
        if self._iter is None:
            init = None
            if self.hang_loader_start:
                assert self.pid_dir, "hang_loader_start records its phase in pid_dir"
                init = functools.partial(_loader_worker_starts, self.pid_dir, os.getpid())
                self._record("iter", os.getpid())  # the iterator, and its workers, start now
            self._loader = DataLoader(
                EpisodeDataset(),
                batch_size=None,
                num_workers=self.dl_workers,
                persistent_workers=True,
                multiprocessing_context=self.dl_context,
                worker_init_fn=init,
            )
            self._iter = iter(self._loader)
            if self.pid_dir:
                for w in getattr(self._iter, "_workers", []):
                    self._record("dl", w.pid)
        try:
            episode = next(self._iter)
        except StopIteration:
            self._iter = iter(self._loader)
            episode = next(self._iter)
        if self.hang_loader_start:
            self._record("batch", os.getpid())  # never reached: the loader's workers never start
        return episode

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        if self.raise_in == "reset":
            raise KeyError("boom in reset")
        self._resets += 1
        if self.record_resets and self._in_worker():
            self._record(f"reset{self._resets}", os.getpid())
        if self.collect_from_reset and self._resets >= self.collect_from_reset:
            gc.collect()
        if self.grow_mb_per_reset:
            self._kept.append(b"\x01" * (self.grow_mb_per_reset << 20))
        due = self.die_flag and self._resets == self.die_once_at_reset and self._in_worker()
        if due and _claim(str(self.die_flag)):  # once per flag: not again in the replacement
            if self.pid_dir:
                self._record("resetting", os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        if self.reset_sleep and self._in_worker():
            if self.pid_dir:
                self._record("resetting", os.getpid())
            time.sleep(self.reset_sleep)
        self._current = self._next_episode().clone()
        self._episode += 1
        self._t = 0
        return TensorDict(
            {
                "observation": self._current + self._offset(),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDict) -> TensorDict:
        if self.raise_in == "step":
            raise ZeroDivisionError("boom in step")
        self._steps += 1
        due = self.die_flag and self._steps == self.die_once_at_step and self._in_worker()
        if due and _claim(str(self.die_flag)):  # else another incarnation died here already
            os.kill(os.getpid(), signal.SIGKILL)
        if self.grow_mb_per_step:
            self._kept.append(b"\x01" * (self.grow_mb_per_step << 20))
        if self.hold_gil:
            if self.pid_dir:
                self._record("stepping", os.getpid())
            sum(range(10**12))  # one C call that never releases the GIL
        if self.step_sleep:
            if self.pid_dir:
                self._record("stepping", os.getpid())
            time.sleep(self.step_sleep)
        if self.step_gate and self._in_worker():
            if self.pid_dir:
                self._record("stepping", os.getpid())
            while not os.path.exists(self.step_gate):
                time.sleep(0.005)
        self._t += 1
        done = torch.tensor([self._t >= 5])
        return TensorDict(
            {
                "observation": self._current + self._t + self._offset(),
                "reward": torch.ones(1),
                "done": done,
                "terminated": done.clone(),
            },
            batch_size=[],
        )

    def _offset(self) -> torch.Tensor | float:
        return self.offset if hasattr(self, "offset") else 0.0

    def _set_seed(self, seed: int | None) -> None:
        self._episode = int(seed or 0) % 8

    def raise_after_the_next_command(self, first: int) -> None:
        """Forwarded to every worker (``env.raise_after_the_next_command(first)``): the worker
        of pid ``first`` (slot 0's: the one whose answer the main process reads first) raises at
        once, so the call raises in the main process; every other one raises only once the
        main process's next command has arrived on its pipe (or the pipe closed): its loss is
        seen after that command was sent to it."""
        if os.getpid() != first:
            _command_pipe().poll(None)
        raise RuntimeError("boom in a forwarded call")

    def close(self, *args: Any, **kwargs: Any) -> None:
        if self._in_worker() and self.pid_dir and not getattr(self, "_closed_once", False):
            self._closed_once = True
            self._record("closed", os.getpid())  # its env was closed (a graceful end)
        if self.block_close and self._in_worker():
            while True:
                time.sleep(1)
        for proc in self._procs:
            proc.terminate()
            proc.wait()
        self._procs = []
        for pid in self._forked:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        self._forked = []
        self._iter = None
        self._loader = None
        super().close(*args, **kwargs)


def _write_whole(path: str, text: str) -> None:
    """Write ``path`` so that no reader sees it empty or partly written (a test polls for these
    files and reads them at once): a hidden file beside it, which no test's pattern matches,
    renamed into place."""
    directory, name = os.path.split(path)
    part = os.path.join(directory, f".{name}.part")
    with open(part, "w") as fh:
        fh.write(text)
    os.replace(part, path)


def _claim(path: str) -> bool:
    """Create ``path`` with this process's pid in it; False if it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _command_pipe() -> Any:
    """The worker's end of its command pipe, found in the worker loop's frame (TorchRL's loop
    names it ``child_pipe``; on the managed step path it is the recorder that wraps it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if "child_pipe" in frame.f_locals:
            return frame.f_locals["child_pipe"]
        frame = frame.f_back  # type: ignore[assignment]
    raise RuntimeError("not called from a worker's loop: no child_pipe in the calling frames")


def _loader_worker_starts(pid_dir: str, env_worker: int, worker_id: int) -> None:
    """A DataLoader ``worker_init_fn`` that records that this loader worker started, then never
    returns (as one stuck opening its data would): the worker stays in its start-up, before
    torch's loop (and its watch of the parent) begins, and no batch is ever delivered."""
    _write_whole(os.path.join(pid_dir, f"dlstart-{env_worker}-{os.getpid()}"), str(os.getpid()))
    while True:
        time.sleep(1)


def _parent_death_signal() -> int:
    """This process's parent-death signal (``prctl(PR_GET_PDEATHSIG)``; 0: none or no prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(0)
    if not hasattr(libc, "prctl") or libc.prctl(2, ctypes.byref(value), 0, 0, 0) != 0:
        return 0
    return value.value


def make_env(**kwargs: Any) -> ToyEnv:
    return ToyEnv(**kwargs)


class SetStateEnv(ToyEnv):
    """A ToyEnv that says it supports ``set_state`` (TorchRL >= 0.14 then passes its workers'
    resets ``set_state=False``; older releases ignore the attribute)."""

    _supports_set_state = True


def make_set_state_env(**kwargs: Any) -> SetStateEnv:
    return SetStateEnv(**kwargs)


class NoiseEnv(ToyEnv):
    """A ToyEnv whose observations are torch random draws: its data depends on the worker's
    seed (``set_seed`` seeds torch in the worker), nothing else."""

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        out = super()._reset(tensordict, **kwargs)
        out["observation"] = torch.rand(OBS)
        return out

    def _step(self, tensordict: TensorDict) -> TensorDict:
        out = super()._step(tensordict)
        out["observation"] = torch.rand(OBS)
        return out


def make_noise_env(**kwargs: Any) -> NoiseEnv:
    return NoiseEnv(**kwargs)


#: How the probe env encodes a worker's default start method in its observation.
START_METHOD_CODES = {"fork": 1.0, "spawn": 2.0, "forkserver": 3.0}


class RandomProbeEnv(ToyEnv):
    """Reports, in its first reset's observation, the worker's unseeded random draws and its
    default start method: ``[torch.rand(), numpy.random.rand(), random.random(), code]``
    (``code`` from :data:`START_METHOD_CODES`; 0 if CUDA was initialised)."""

    def _reset(self, tensordict: TensorDict | None = None, **kwargs: Any) -> TensorDict:
        import multiprocessing
        import random

        import numpy

        out = super()._reset(tensordict, **kwargs)
        code = START_METHOD_CODES.get(multiprocessing.get_start_method(allow_none=True) or "", -1.0)
        if torch.cuda.is_initialized():
            code = 0.0
        draws = [torch.rand(()).item(), float(numpy.random.rand()), random.random(), code]
        out["observation"] = torch.tensor(draws)
        return out


def make_probe_env(**kwargs: Any) -> RandomProbeEnv:
    return RandomProbeEnv(**kwargs)
