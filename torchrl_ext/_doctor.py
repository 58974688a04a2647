"""``python -m torchrl_ext doctor``: what this machine supports, and what is lost where not.

Each check returns a :class:`Check`; :func:`run_checks` measures this machine and runs them
all. The check functions take what they judge as arguments, so each can be fed a fake value.

Example:
    >>> check_open_files((1024, 4096)).status
    'degraded'
    >>> exit_code([check_open_files((65536, 65536))])
    0
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from . import _platform, _probes
from ._compat import TESTED_RELEASES, TESTED_TORCHRL

__all__ = [
    "Check",
    "check_child_subreaper",
    "check_open_files",
    "check_orphan_reaping",
    "check_parent_death_signal",
    "check_pidfd",
    "check_ray",
    "check_shm",
    "check_start_method",
    "check_torch",
    "check_torchrl",
    "exit_code",
    "format_json",
    "format_text",
    "run_checks",
]

_log = logging.getLogger("torchrl_ext")

Status = Literal["ok", "degraded", "missing"]

#: Below this, ``/dev/shm`` is likely to fill up (Docker's default is 64 MiB).
SHM_MINIMUM = 2**30
#: Below this soft ``ulimit -n``, DataLoader workers run out of descriptors.
OPEN_FILES_MINIMUM = 4096
#: What the test suite runs on (TorchRL's builds: ``_compat.TESTED_TORCHRL``).
TESTED_TORCH = ("2.13.0",)
RAY_KILL_CHILDREN_VAR = "RAY_kill_child_processes_on_worker_exit"

#: PID 1 names of inits that reap orphans (``/proc/1/comm``, at most 15 characters).
_REAPING_INITS = frozenset(
    {
        "systemd",
        "init",
        "tini",
        "tini-static",
        "dumb-init",
        "docker-init",
        "catatonit",
        "s6-svscan",
        "runit",
        "runsvdir",
        "openrc-init",
        "supervisord",
        "launchd",
    }
)
#: PID 1 names of programs that do not reap processes they did not start.
_NON_REAPING_PREFIXES = ("python", "sh", "bash", "dash", "ash", "zsh", "node", "java", "sleep", "torchrun")


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report.

    ``ok``: the guarantee this check covers holds. ``degraded``: the library works, with a
    weaker guarantee or a risk that ``detail`` names. ``missing``: a capability is absent.
    ``hint`` says what to do (empty when nothing is to be done).

    Example:
        >>> Check("ulimit -n", "ok", "soft limit 65536").line(10)
        'ok       ulimit -n  soft limit 65536'
    """

    name: str
    status: Status
    detail: str
    hint: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def line(self, width: int = 0) -> str:
        """``STATUS NAME DETAIL[ Fix: HINT]``, the name padded to ``width``."""
        text = f"{self.status:<8} {self.name:<{width}} {self.detail}"
        return f"{text} Fix: {self.hint}" if self.hint else text


# ------------------------------------------------------------------- kernel capabilities
def _unavailable_hint(feature: str, linux_fix: str) -> str:
    if os.environ.get(_platform.PORTABLE_VAR) == "1":
        return f"unset {_platform.PORTABLE_VAR} (it turns prctl and pidfd off)"
    if not _platform.IS_LINUX:
        return f"none: {feature} is Linux-only; this is the reduced guarantee of macOS (see the FAQ)"
    return linux_fix


def _capability(name: str, available: bool, works: str, lost: str, fix: tuple[str, str]) -> Check:
    """``ok`` with ``works``, or ``missing`` with ``lost`` and the hint for ``fix``
    (``(feature, what to do on Linux)``)."""
    if available:
        return Check(name, "ok", works)
    return Check(name, "missing", lost, _unavailable_hint(*fix))


def check_pidfd(available: bool) -> Check:
    """Whether ``os.pidfd_open`` works (Linux >= 5.3)."""
    return _capability(
        "pidfd",
        available,
        "os.pidfd_open works: worker deaths and the main process's death are seen at once",
        "no os.pidfd_open: the supervisor also polls each worker every 0.1 s, the reaper polls the "
        "main process every 50 ms, exit codes come from multiprocessing only",
        ("pidfd", "needs Linux >= 5.3 and a seccomp profile that allows pidfd_open"),
    )


_PRCTL_FIX = ("prctl", "allow prctl in the container's seccomp profile")


def check_parent_death_signal(available: bool) -> Check:
    """Whether ``prctl(PR_SET_PDEATHSIG)`` works."""
    return _capability(
        "PR_SET_PDEATHSIG",
        available,
        "workers die by themselves the moment the main process dies",
        "workers do not die with the main process by themselves: the external reaper kills them, "
        "or they exit when their pipe closes (after the current step)",
        _PRCTL_FIX,
    )


def check_child_subreaper(available: bool) -> Check:
    """Whether ``prctl(PR_SET_CHILD_SUBREAPER)`` works (Linux >= 3.4)."""
    return _capability(
        "PR_SET_CHILD_SUBREAPER",
        available,
        "orphans of a dead worker come to the main process, which kills and reaps them",
        "orphans of a dead worker go to PID 1: they are still killed (process group, snapshots, "
        "tag), but reaping them is up to PID 1",
        _PRCTL_FIX,
    )


# ------------------------------------------------------------------------------- PID 1
_INIT_HINT = "run an init as PID 1: `docker run --init`, or tini / dumb-init as the entrypoint"


def check_orphan_reaping(
    probe: _probes.OrphanProbe | None, pid1_name: str | None, own_pid: int | None = None
) -> Check:
    """Judge :func:`torchrl_ext._probes.probe_orphan_reaping`, or, when it did not decide
    (``probe`` is ``None`` or says ``reaped=None``), PID 1's name.

    Example:
        >>> check_orphan_reaping(None, "tini").status
        'ok'
        >>> check_orphan_reaping(None, "python3").status
        'missing'
    """
    name = "orphan reaping"
    pid1 = f"PID 1 ({pid1_name!r})" if pid1_name else "PID 1"
    if probe is not None and probe.reaped is not None:
        adopter = (
            pid1
            if probe.adopter_pid == 1
            else f"the child subreaper {probe.adopter_name!r} (pid {probe.adopter_pid}), not PID 1,"
        )
        if probe.reaped:
            return Check(
                name,
                "ok",
                f"{adopter} reaped a test orphan: what the reaper kills after the main process died "
                "is reaped too, no zombies pile up",
            )
        return Check(
            name,
            "missing",
            f"a test orphan adopted by {adopter} was still a zombie after {probe.waited:.1f} s (it stays): "
            "after the main process dies, the zombies of what the reaper kills stay too",
            _INIT_HINT,
        )
    own_pid = os.getpid() if own_pid is None else own_pid
    if probe is None:
        why, retry = "not tested", "run without --no-orphan-test to test it"
    elif probe.adopter_pid == own_pid == 1:
        why, retry = "this process is PID 1", "run the doctor as an ordinary process to test it"
    elif probe.adopter_pid == own_pid:
        why = "untestable: this process is a child subreaper, so the test orphan came back to it"
        retry = "run the doctor from a shell to test it"
    else:
        why, retry = "the test orphan did not decide", "run the doctor again"
    base = (pid1_name or "").lower()
    if base in _REAPING_INITS:
        return Check(name, "ok", f"{pid1} is an init that reaps orphans ({why}; judged by name)")
    if base.startswith(_NON_REAPING_PREFIXES):
        return Check(
            name,
            "missing",
            f"{pid1} is a program, not an init: it reaps only its own children ({why}; judged by name); "
            "after the main process dies, the zombies of what the reaper kills stay, and a Python "
            "that is PID 1 does not die from the SIGTERM it re-raises",
            _INIT_HINT,
        )
    return Check(
        name,
        "degraded",
        f"{pid1}: unknown whether it reaps orphans ({why}; judged by name)",
        f"{retry}, or {_INIT_HINT}",
    )


# ------------------------------------------------------------------------------- limits
def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_shm(size: int | None, *, linux: bool = _platform.IS_LINUX, minimum: int = SHM_MINIMUM) -> Check:
    """Judge the size of ``/dev/shm`` (``None``: there is none).

    Example:
        >>> check_shm(64 * 2**20).status
        'degraded'
    """
    name = "/dev/shm"
    if size is None:
        if not linux:
            return Check(name, "ok", "none on this system: shared memory is not a file system here")
        return Check(
            name,
            "missing",
            "no /dev/shm: ParallelEnv buffers and DataLoader batches cannot be shared",
            "mount a tmpfs at /dev/shm (Docker: --shm-size=8g)",
        )
    if size < minimum:
        return Check(
            name,
            "degraded",
            f"{_size(size)} (below {_size(minimum)}): ParallelEnv buffers and DataLoader batches go "
            "through it; when it is full a worker dies of SIGBUS",
            "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory at "
            "/dev/shm; or fewer workers, a smaller prefetch_factor",
        )
    return Check(name, "ok", f"{_size(size)}: room for shared ParallelEnv buffers and DataLoader batches")


def check_open_files(limits: tuple[int, int], *, minimum: int = OPEN_FILES_MINIMUM) -> Check:
    """Judge ``(soft, hard)`` of ``ulimit -n`` (``-1``: unlimited)."""
    soft, hard = limits
    name = "ulimit -n"
    if soft == -1 or soft >= minimum:
        shown = "unlimited" if soft == -1 else soft
        return Check(
            name, "ok", f"soft limit {shown} open files: enough for the workers' pipes and shared tensors"
        )
    target = 65536 if hard == -1 else min(hard, 65536)
    if target >= minimum:
        hint = f"`ulimit -n {target}` before starting (the hard limit allows it)"
    else:
        hint = f"the hard limit is {hard}: docker run --ulimit nofile=65536:65536, or raise it in limits.conf"
    return Check(
        name,
        "degraded",
        f"soft limit {soft} open files (below {minimum}): every worker holds pipes, and torch "
        "passes each tensor a DataLoader worker sends as a file descriptor; "
        "'Too many open files' ends the run",
        hint,
    )


# ------------------------------------------------------------------------ Python packages
def check_start_method(current: str | None, torchrl_default: str | None) -> Check:
    """Report the start method in effect and TorchRL's default (informational: always ok)."""
    torchrl = (
        f"TorchRL's default: {torchrl_default!r}"
        if torchrl_default
        else "this TorchRL has no _get_default_mp_start_method: ParallelEnv uses multiprocessing's"
    )
    return Check(
        "start method",
        "ok",
        f"multiprocessing: {current or 'not set'!r} (importing torchrl sets spawn if none was chosen); "
        f"{torchrl}; fork, spawn and forkserver are all supported (mp_start_method=)",
    )


def check_preloaded_start(
    *, has_forkserver: bool, chosen_method: str | None, daemonic_default: bool
) -> Check:
    """Whether ``ManagedParallelEnv(n, fn)`` forks its workers from the preloaded fork server
    here (the fast default start: docs/guarantees.md, "Fast start"), and why not
    (informational: always ok).

    ``chosen_method``: a global start method the program chose itself (``None``: none, or only
    TorchRL's own); ``daemonic_default``: this TorchRL makes workers daemonic unless told.

    Example:
        >>> check_preloaded_start(has_forkserver=True, chosen_method=None, daemonic_default=False).detail
        'applies: workers are forks of a preloaded, supervised fork server (no mp_start_method given)'
    """
    name = "preloaded start"
    if not has_forkserver:
        why, hint = "this platform has no forkserver start method", ""
    elif chosen_method is not None:
        why = f"the program chose the global start method {chosen_method!r} (mp.set_start_method)"
        hint = "leave the global start method unset to get the preloaded server"
    elif daemonic_default:
        why = "this TorchRL's workers are daemonic by default (they may not have children)"
        hint = "pass daemon_workers=False"
    else:
        detail = (
            "applies: workers are forks of a preloaded, supervised fork server (no mp_start_method given)"
        )
        return Check(name, "ok", detail)
    return Check(
        name, "ok", f"does not apply by default: {why}; workers start by TorchRL's start method", hint
    )


def check_fork_server(unsafe: str | None, running: tuple[str | None, str | None]) -> Check:
    """How the preloaded fork server starts from this process (informational: always ok):
    as a fork of the main process (a zygote, a fraction of a second) when the process is
    provably safe to fork at its first start, else as a new interpreter (seconds).

    ``unsafe``: why this process is not safe to fork now (``None``: it is); ``running``: the
    kind and fallback reason of a server this process already runs.

    Example:
        >>> check_fork_server(None, (None, None)).detail
        'starts as a fork of the main process (zygote): this process is safe to fork now'
    """
    name = "fork server"
    kind, fallback = running
    if kind == "zygote":
        return Check(name, "ok", "running as a fork of the main process (zygote)")
    if kind == "interpreter":
        return Check(name, "ok", f"running as a new interpreter: {fallback}", _EARLY_HINT)
    if unsafe is None:
        return Check(
            name, "ok", "starts as a fork of the main process (zygote): this process is safe to fork now"
        )
    return Check(name, "ok", f"would start as a new interpreter here: {unsafe}", _EARLY_HINT)


_EARLY_HINT = "call torchrl_ext.start_fork_server() before the program starts threads (docs/quickstart.md)"


def _api_generation(has_daemon: bool, has_shutdown_timeout: bool) -> str:
    if has_shutdown_timeout:
        return "0.13+"
    return "0.11-0.12" if has_daemon else "0.10"


#: The API generation of each tested TorchRL build.
_TESTED_GENERATION = dict(zip(TESTED_TORCHRL, ("0.10", "0.13+", "0.13+"), strict=True))


def check_torchrl(version: str | None, *, has_daemon: bool, has_shutdown_timeout: bool) -> Check:
    """Judge TorchRL's version by its distribution metadata *and* its API.

    The API (``ParallelEnv(daemon=, shutdown_timeout=)``) decides what the version string
    cannot: torchrl 0.10.1 wheels report ``0.0.0+unknown`` as ``torchrl.__version__``.

    Example:
        >>> check_torchrl("0.14.1", has_daemon=True, has_shutdown_timeout=True).status
        'ok'
        >>> check_torchrl("0.12.0", has_daemon=True, has_shutdown_timeout=False).status
        'degraded'
    """
    name = "TorchRL"
    api = _api_generation(has_daemon, has_shutdown_timeout)
    release = (version or "").split("+")[0]
    tested = TESTED_RELEASES
    hint = "install a tested TorchRL (torchrl==0.14.1), or run the test suite on this version (make test)"
    if release in ("", "0.0.0"):
        return Check(
            name,
            "degraded",
            f"version unknown ({version or 'no metadata'!r}); its API is that of {api}; tested: {tested}",
            hint,
        )
    expected = _TESTED_GENERATION.get(release)
    if expected is None:
        return Check(name, "degraded", f"{release} is untested (tested: {tested}); API of {api}", hint)
    if expected != api:
        return Check(
            name,
            "degraded",
            f"{release} by its metadata, but its API is that of {api}: a modified build, untested",
            hint,
        )
    return Check(name, "ok", f"{release} (tested; API of {api})")


def check_step_path(has_done_flags: bool) -> Check:
    """Which batched step path this TorchRL lets a managed env run (always ``ok``: TorchRL's
    path is upstream's own; ``env.step_path`` says which one an env runs, and why).

    Example:
        >>> check_step_path(False).detail.split(":")[0]
        "TorchRL's for every env"
    """
    if has_done_flags:
        return Check(
            "step path",
            "ok",
            "ours for envs with shared buffers (use_buffers) and tensor-only CPU specs, TorchRL's "
            "for the others; env.step_path says which and why; envs_per_worker > 1 available",
        )
    return Check(
        "step path",
        "ok",
        "TorchRL's for every env: TorchRL < 0.11 answers through events (and envs_per_worker must be 1)",
    )


def check_torch(version: str) -> Check:
    """Judge torch's version against the tested one (the local part, ``+cpu``, is ignored)."""
    release = version.split("+")[0]
    if release in TESTED_TORCH:
        return Check("torch", "ok", f"{version} (tested)")
    return Check(
        "torch",
        "degraded",
        f"{version} is untested (tested: {', '.join(TESTED_TORCH)})",
        f"pip install torch=={TESTED_TORCH[-1]}, or run the test suite on this version (make test)",
    )


def check_ray(installed: bool, environ: Mapping[str, str]) -> Check:
    """Report Ray's child-killing setting (informational: both settings are tested)."""
    if not installed:
        return Check("Ray", "ok", "not installed: nothing to check")
    value = environ.get(RAY_KILL_CHILDREN_VAR)
    if value is not None and value.strip().lower() in ("0", "false"):
        return Check(
            "Ray",
            "ok",
            f"{RAY_KILL_CHILDREN_VAR}={value}: Ray leaves a killed actor's children alone; "
            "the external reaper ends the env workers and their children",
        )
    setting = "unset (Ray's default: on)" if value is None else f"={value}"
    return Check(
        "Ray",
        "ok",
        f"{RAY_KILL_CHILDREN_VAR} {setting}: Ray SIGKILLs a killed actor's direct children (the env "
        "workers and the reaper's shim); the reaper runs behind the shim and ends the rest",
    )


# ------------------------------------------------------------------------------ running
def _torchrl_default_start_method() -> str | None:
    from ._compat import torchrl_default_start_method

    return torchrl_default_start_method()


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_checks(*, orphan_test: bool = True, orphan_timeout: float = 5.0) -> list[Check]:
    """Measure this machine and run every check, in the order of the report.

    ``orphan_test=False`` judges PID 1 by its name instead of making a test orphan (see
    :func:`torchrl_ext._probes.probe_orphan_reaping`).
    """
    import torch

    from . import _compat
    from ._forkserver import server_kind, start_method_chosen_by_user

    probe = _probes.probe_orphan_reaping(orphan_timeout) if orphan_test else None
    _log.debug("orphan probe: %s", probe)
    torchrl_version = _distribution_version("torchrl") or _distribution_version("torchrl-nightly")
    if torchrl_version is None:
        import torchrl

        torchrl_version = getattr(torchrl, "__version__", None)
    return [
        check_pidfd(_platform.has_pidfd()),
        check_parent_death_signal(_platform.has_parent_death_signal()),
        check_child_subreaper(_platform.has_prctl()),
        check_orphan_reaping(probe, _platform.process_name(1)),
        check_shm(_probes.shm_size()),
        check_open_files(_probes.open_files_limit()),
        check_start_method(
            multiprocessing.get_start_method(allow_none=True), _torchrl_default_start_method()
        ),
        check_preloaded_start(
            has_forkserver="forkserver" in multiprocessing.get_all_start_methods(),
            chosen_method=(
                multiprocessing.get_start_method(allow_none=True) if start_method_chosen_by_user() else None
            ),
            daemonic_default=bool(_compat.UPSTREAM_DEFAULTS["daemon"]),
        ),
        check_fork_server(_platform.fork_unsafe_reason(), server_kind()),
        check_torchrl(
            torchrl_version,
            has_daemon=_compat.HAS_DAEMON_KWARG,
            has_shutdown_timeout=_compat.HAS_SHUTDOWN_TIMEOUT_KWARG,
        ),
        check_torch(str(torch.__version__)),
        check_step_path(_compat.HAS_DAEMON_KWARG),
        check_ray(importlib.util.find_spec("ray") is not None, os.environ),
    ]


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check is ok (every guarantee holds), 1 otherwise."""
    return 0 if all(c.ok for c in checks) else 1


def format_text(checks: Sequence[Check]) -> str:
    """One line per check, then a verdict."""
    width = max((len(c.name) for c in checks), default=0)
    lines = [c.line(width) for c in checks]
    bad = [c.name for c in checks if not c.ok]
    if bad:
        lines.append(f"degraded: {len(bad)} of {len(checks)} checks not ok ({', '.join(bad)}); see above")
    else:
        lines.append(f"ok: all {len(checks)} checks passed; every guarantee holds on this machine")
    return "\n".join(lines) + "\n"


def format_json(checks: Sequence[Check]) -> str:
    """``{"ok": bool, "checks": [{"name", "status", "detail", "hint"}, ...]}``."""
    return json.dumps({"ok": exit_code(checks) == 0, "checks": [asdict(c) for c in checks]}, indent=2) + "\n"
