"""``python -m torchrl_ext doctor``: its report on this machine, each check's logic on faked
values, and the ImportError that non-POSIX systems get."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import ROOT, child_env
from torchrl_ext import _compat, _doctor, _platform, _probes
from torchrl_ext.__main__ import main
from torchrl_ext._doctor import Check
from torchrl_ext._probes import OrphanProbe

NAMES = [
    "pidfd",
    "PR_SET_PDEATHSIG",
    "PR_SET_CHILD_SUBREAPER",
    "orphan reaping",
    "/dev/shm",
    "ulimit -n",
    "start method",
    "preloaded start",
    "fork server",
    "TorchRL",
    "torch",
    "step path",
    "Ray",
]
STATUSES = ("ok", "degraded", "missing")
GiB = 2**30


def _doctor_cmd(
    *args: str, env_vars: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torchrl_ext doctor ARGS`` in a child interpreter."""
    env = child_env(**(env_vars or {}))
    cmd = [*prefix, sys.executable, "-m", "torchrl_ext", "doctor", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _parse_text(out: str) -> tuple[dict[str, str], str]:
    """``{check name: status}`` and the verdict line of the text report."""
    *lines, verdict = out.strip().splitlines()
    found = {}
    for line in lines:
        status, rest = line.split(None, 1)
        assert status in STATUSES, line
        names = [n for n in NAMES if rest.startswith(n + " ")]
        assert len(names) == 1, f"no known check on line {line!r}"
        found[names[0]] = status
    return found, verdict


# ----------------------------------------------------------------------- this machine
@pytest.mark.compat
def test_doctor_reports_every_check_and_exits_by_the_statuses() -> None:
    proc = _doctor_cmd()
    assert proc.returncode in (0, 1), proc.stderr
    found, verdict = _parse_text(proc.stdout)
    assert list(found) == NAMES
    all_ok = all(status == "ok" for status in found.values())
    assert proc.returncode == (0 if all_ok else 1), proc.stdout
    assert verdict.startswith("ok:" if all_ok else "degraded:"), verdict


def test_console_script_json_matches_the_exit_code() -> None:
    script = Path(sys.executable).with_name("torchrl-ext")
    if not script.exists():
        pytest.skip("the torchrl-ext console script is not installed in this environment")
    proc = subprocess.run(
        [str(script), "doctor", "--json", "--no-orphan-test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads(proc.stdout)
    assert [c["name"] for c in report["checks"]] == NAMES
    assert all(c["status"] in STATUSES and c["detail"] for c in report["checks"])
    assert all(c["hint"] for c in report["checks"] if c["status"] != "ok")
    assert report["ok"] == all(c["status"] == "ok" for c in report["checks"])
    assert proc.returncode == (0 if report["ok"] else 1)


def test_portable_mode_reports_degraded_with_exit_code_1() -> None:
    proc = _doctor_cmd("--json", "--no-orphan-test", env_vars={_platform.PORTABLE_VAR: "1"})
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("pidfd", "PR_SET_PDEATHSIG", "PR_SET_CHILD_SUBREAPER"):
        assert checks[name]["status"] == "missing", checks[name]
        assert _platform.PORTABLE_VAR in checks[name]["hint"]
    assert report["ok"] is False
    assert proc.returncode == 1


def test_low_open_files_limit_is_reported() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    # A shell lowers the soft limit only, then execs the doctor.
    proc = _doctor_cmd(
        "--json", "--no-orphan-test", prefix=("sh", "-c", f'ulimit -S -n {low} && exec "$@"', "sh")
    )
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["ulimit -n"]["status"] == "degraded", checks["ulimit -n"]
    assert f"soft limit {low} " in checks["ulimit -n"]["detail"]
    assert proc.returncode == 1


@pytest.mark.compat
def test_torchrl_check_detects_tested_versions_by_features() -> None:
    """On both tested TorchRL releases (0.10.1 reports ``0.0.0+unknown`` as its
    ``__version__``) the check recognises the release and finds the API it expects."""
    checks = {c.name: c for c in _doctor.run_checks(orphan_test=False)}
    assert list(checks) == NAMES
    version = _doctor._distribution_version("torchrl") or _doctor._distribution_version("torchrl-nightly")
    if version in _compat.TESTED_TORCHRL:  # a tested build, 0.15's stand-in nightly included
        assert checks["TorchRL"].status == "ok", checks["TorchRL"]


@pytest.mark.compat
def test_the_step_path_check_names_the_path_this_torchrl_allows() -> None:
    checks = {c.name: c for c in _doctor.run_checks(orphan_test=False)}
    check = checks["step path"]
    assert check.ok
    if _compat.HAS_DAEMON_KWARG:  # TorchRL >= 0.11: shared done flags, our path can serve
        assert check.detail.startswith("ours for envs with shared buffers"), check
        assert "envs_per_worker > 1 available" in check.detail
    else:
        assert check.detail.startswith("TorchRL's for every env"), check
        assert "envs_per_worker must be 1" in check.detail


def test_cli_exit_code_follows_the_checks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy = [Check("pidfd", "ok", "works"), Check("ulimit -n", "ok", "plenty")]
    monkeypatch.setattr(_doctor, "run_checks", lambda **kwargs: healthy)
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok:")

    sick = [*healthy, Check("/dev/shm", "degraded", "64 MiB", "docker run --shm-size=8g")]
    monkeypatch.setattr(_doctor, "run_checks", lambda **kwargs: sick)
    assert main(["doctor"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:2] == ["degraded", "/dev/shm"]
    assert lines[2].endswith("Fix: docker run --shm-size=8g")
    assert lines[-1].startswith("degraded: 1 of 3")

    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["checks"][2] == {
        "name": "/dev/shm",
        "status": "degraded",
        "detail": "64 MiB",
        "hint": "docker run --shm-size=8g",
    }


# ------------------------------------------------------------------ the orphan test
def test_orphan_probe_is_judged_without_becoming_a_subreaper() -> None:
    was_subreaper = _platform.is_child_subreaper()
    probe = _probes.probe_orphan_reaping()
    assert _platform.is_child_subreaper() == was_subreaper
    assert probe.pid is not None and probe.adopter_pid is not None
    if was_subreaper:
        assert probe.adopter_pid == os.getpid() and probe.reaped is None
        return
    assert probe.adopter_pid != os.getpid()
    if probe.reaped:
        try:
            gone = psutil.Process(probe.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        assert gone
    check = _doctor.check_orphan_reaping(probe, _platform.process_name(1))
    if probe.reaped is not None:
        assert check.status == ("ok" if probe.reaped else "missing"), check


def test_orphan_probe_reaps_its_orphan_when_this_process_is_a_subreaper() -> None:
    """The orphan comes back to us; the probe reaps it (the leak fixture checks that no
    zombie child is left) and falls back to PID 1's name."""
    if not _platform.has_prctl():
        pytest.skip("needs prctl(PR_SET_CHILD_SUBREAPER)")
    was_subreaper = _platform.is_child_subreaper()
    _platform.set_child_subreaper(True)
    try:
        probe = _probes.probe_orphan_reaping()
    finally:
        _platform.set_child_subreaper(was_subreaper)
    assert probe.adopter_pid == os.getpid()
    assert probe.reaped is None
    check = _doctor.check_orphan_reaping(probe, "tini")
    assert check.status == "ok"
    assert "child subreaper" in check.detail and "by name" in check.detail


@pytest.mark.parametrize(
    ("probe", "pid1", "status", "words"),
    [
        (OrphanProbe(10, 1, "process_api", True, 0.1), "process_api", "ok", "reaped a test orphan"),
        (OrphanProbe(10, 1, "python3", False, 5.0), "python3", "missing", "still a zombie"),
        (OrphanProbe(10, 77, "systemd", True, 0.1), "systemd", "ok", "child subreaper 'systemd'"),
        (None, "tini", "ok", "reaps orphans"),
        (None, "docker-init", "ok", "reaps orphans"),
        (None, "systemd", "ok", "reaps orphans"),
        (None, "python3.11", "missing", "not an init"),
        (None, "bash", "missing", "not an init"),
        (None, "mystery", "degraded", "unknown"),
        (None, None, "degraded", "unknown"),
        (OrphanProbe(10, 1, "python3", None, 0.0), "python3", "missing", "this process is PID 1"),
    ],
)
def test_orphan_reaping_verdicts(
    probe: OrphanProbe | None, pid1: str | None, status: str, words: str
) -> None:
    own_pid = 1 if probe is not None and probe.reaped is None else 4242
    check = _doctor.check_orphan_reaping(probe, pid1, own_pid=own_pid)
    assert check.status == status, check
    assert words in check.detail, check
    assert bool(check.hint) == (status != "ok")
    if status == "missing":
        assert "--init" in check.hint


# --------------------------------------------------------------------- each check
@pytest.mark.parametrize(
    "check",
    [_doctor.check_pidfd, _doctor.check_parent_death_signal, _doctor.check_child_subreaper],
)
def test_capability_checks_name_the_cause(check: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert check(True).status == "ok" and not check(True).hint
    monkeypatch.setenv(_platform.PORTABLE_VAR, "1")
    assert check(False).status == "missing"
    assert _platform.PORTABLE_VAR in check(False).hint
    monkeypatch.delenv(_platform.PORTABLE_VAR)
    assert "seccomp" in check(False).hint
    monkeypatch.setattr(_platform, "IS_LINUX", False)
    assert "Linux-only" in check(False).hint


def test_shm_check() -> None:
    small = _doctor.check_shm(64 * 2**20, linux=True)
    assert small.status == "degraded"
    assert "64 MiB" in small.detail and "SIGBUS" in small.detail
    assert "--shm-size" in small.hint
    assert _doctor.check_shm(GiB, linux=True).status == "ok"
    assert _doctor.check_shm(8 * GiB, linux=True).status == "ok"
    assert _doctor.check_shm(None, linux=True).status == "missing"
    assert _doctor.check_shm(None, linux=False).status == "ok"
    assert _doctor.check_shm(GiB, minimum=2 * GiB).status == "degraded"


def test_open_files_check() -> None:
    raisable = _doctor.check_open_files((1024, 1048576))
    assert raisable.status == "degraded"
    assert "ulimit -n 65536" in raisable.hint
    capped = _doctor.check_open_files((256, 1024))
    assert capped.status == "degraded"
    assert "hard limit is 1024" in capped.hint
    assert _doctor.check_open_files((4096, 4096)).status == "ok"
    assert "unlimited" in _doctor.check_open_files((-1, -1)).detail
    assert _doctor.check_open_files((1024, -1)).hint.startswith("`ulimit -n 65536`")


@pytest.mark.parametrize(
    ("version", "has_daemon", "has_timeout", "status", "words"),
    [
        ("0.14.1", True, True, "ok", "tested"),
        ("0.10.1", False, False, "ok", "tested"),
        ("0.0.0+unknown", False, False, "degraded", "API is that of 0.10"),
        (None, True, True, "degraded", "version unknown"),
        ("0.10.1", True, True, "degraded", "modified build"),
        ("0.12.0", True, False, "degraded", "untested"),
        ("0.15.0", True, True, "degraded", "untested"),
    ],
)
def test_torchrl_check(
    version: str | None, has_daemon: bool, has_timeout: bool, status: str, words: str
) -> None:
    check = _doctor.check_torchrl(version, has_daemon=has_daemon, has_shutdown_timeout=has_timeout)
    assert check.status == status, check
    assert words in check.detail, check


def test_torch_check() -> None:
    assert _doctor.check_torch("2.13.0+cpu").status == "ok"
    assert _doctor.check_torch("2.13.0").status == "ok"
    old = _doctor.check_torch("2.5.1")
    assert old.status == "degraded" and "torch==2.13.0" in old.hint


def test_start_method_and_ray_checks_are_informational() -> None:
    both = _doctor.check_start_method("fork", "fork")
    assert both.ok and "'fork'" in both.detail and "TorchRL's default" in both.detail
    assert "no _get_default_mp_start_method" in _doctor.check_start_method(None, None).detail

    var = _doctor.RAY_KILL_CHILDREN_VAR
    assert "not installed" in _doctor.check_ray(False, {var: "0"}).detail
    default = _doctor.check_ray(True, {})
    assert default.ok and "Ray's default: on" in default.detail
    off = _doctor.check_ray(True, {var: "false"})
    assert off.ok and "leaves a killed actor's children alone" in off.detail


def test_preloaded_start_check_says_whether_and_why_not() -> None:
    """The rule ``ManagedParallelEnv.__init__`` applies, case by case (always informational)."""
    applies = _doctor.check_preloaded_start(has_forkserver=True, chosen_method=None, daemonic_default=False)
    assert applies.ok and applies.detail.startswith("applies:") and not applies.hint
    cases = [
        ({"has_forkserver": False, "chosen_method": None, "daemonic_default": False}, "no forkserver", ""),
        ({"has_forkserver": True, "chosen_method": "fork", "daemonic_default": False}, "'fork'", "unset"),
        (
            {"has_forkserver": True, "chosen_method": None, "daemonic_default": True},
            "daemonic",
            "daemon_workers=False",
        ),
    ]
    for kwargs, why, hint in cases:
        check = _doctor.check_preloaded_start(**kwargs)  # type: ignore[arg-type]
        assert check.ok and check.detail.startswith("does not apply by default:"), check
        assert why in check.detail and hint in check.hint, check
    # No forkserver outranks the other reasons, a chosen method outranks daemonic workers.
    assert (
        "no forkserver"
        in _doctor.check_preloaded_start(
            has_forkserver=False, chosen_method="spawn", daemonic_default=True
        ).detail
    )
    assert (
        "'spawn'"
        in _doctor.check_preloaded_start(
            has_forkserver=True, chosen_method="spawn", daemonic_default=True
        ).detail
    )


@pytest.mark.compat
def test_preloaded_start_check_follows_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a running program: what the installed TorchRL and the program's own choice say."""
    from torchrl_ext import _compat, _forkserver

    def preloaded() -> Check:
        return {c.name: c for c in _doctor.run_checks(orphan_test=False)}["preloaded start"]

    monkeypatch.setattr(_forkserver, "start_method_chosen_by_user", lambda: False)
    check = preloaded()
    assert check.detail.startswith("does not apply" if _compat.UPSTREAM_DEFAULTS["daemon"] else "applies:")
    monkeypatch.setattr(_forkserver, "start_method_chosen_by_user", lambda: True)
    current = str(multiprocessing.get_start_method(allow_none=True))
    assert f"global start method {current!r}" in preloaded().detail


def test_exit_code_and_verdict() -> None:
    ok = [Check("a", "ok", "x"), Check("b", "ok", "y")]
    assert _doctor.exit_code(ok) == 0
    assert _doctor.format_text(ok).splitlines()[-1].startswith("ok: all 2 checks")
    for status in ("degraded", "missing"):
        bad = [*ok, Check("c", status, "z", "do w")]
        assert _doctor.exit_code(bad) == 1
        assert json.loads(_doctor.format_json(bad))["ok"] is False


def test_probe_measurements() -> None:
    size = _probes.shm_size()
    if os.path.isdir("/dev/shm"):
        assert size == shutil.disk_usage("/dev/shm").total
    assert _probes.shm_size("/nonexistent/shm") is None
    soft, hard = _probes.open_files_limit()
    assert soft == -1 or soft > 0
    assert hard == -1 or hard >= soft
    assert _platform.process_name(os.getpid()) == psutil.Process().name()


# ------------------------------------------------------------------------- non-POSIX
_NON_POSIX_CHILD = """\
import os, sys
os.name = "nt"  # what Windows reports
try:
    import torchrl_ext
except ImportError as err:
    print("ImportError:", err)
    print("torch imported:", "torch" in sys.modules)
else:
    print("imported on a non-POSIX system")
os.name = "posix"
import torchrl_ext
print("then imported:", torchrl_ext.__name__)
"""


@pytest.mark.compat
def test_non_posix_import_raises_a_clear_import_error() -> None:
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _NON_POSIX_CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ImportError: torchrl_ext needs a POSIX system (this one is os.name='nt')" in out, out
    for words in ("Linux is fully supported", "macOS with a reduced guarantee", "Windows is not supported"):
        assert words in out
    assert "torch imported: False" in out  # the check comes before anything else is imported
    assert "then imported: torchrl_ext" in out  # and os.name was the only reason


# ------------------------------------------------------------------ the platform surface
_NO_CHILD_SCRIPT = """
import subprocess, sys
started = []
init = subprocess.Popen.__init__
def recording(self, args, *rest, **kwargs):
    started.append(args)
    init(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = recording
from torchrl_ext import _platform
checks = [_platform.has_prctl(), _platform.has_parent_death_signal(), _platform.has_pidfd(),
          _platform.is_child_subreaper()]
print(checks, started)
sys.exit(1 if started else 0)
"""


def test_platform_checks_start_no_process() -> None:
    """The capability checks (first calls, in a fresh interpreter) load libc without running a
    program: a library call made while a worker or a server exits must leave no child (ctypes'
    ``find_library`` runs ``/sbin/ldconfig``, once seen as a survivor of a main process's exit)."""
    proc = subprocess.run(
        [sys.executable, "-c", _NO_CHILD_SCRIPT], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if sys.platform.startswith("linux"):
        assert proc.stdout.startswith("[True, True,"), proc.stdout  # prctl was found all the same


def test_fork_server_check_names_the_kind_and_the_reason() -> None:
    """NOTE [zygote]: the doctor says how this process's server starts, or started, and why
    it is not a zygote."""
    assert "zygote" in _doctor.check_fork_server(None, (None, None)).detail
    check = _doctor.check_fork_server("1 other Python thread(s) run (t)", (None, None))
    assert "new interpreter" in check.detail and "1 other Python thread(s) run (t)" in check.detail
    assert "start_fork_server()" in check.hint
    assert "zygote" in _doctor.check_fork_server("x", ("zygote", None)).detail
    check = _doctor.check_fork_server(None, ("interpreter", "CUDA is initialised in this process"))
    assert "CUDA is initialised" in check.detail and check.status == "ok"
