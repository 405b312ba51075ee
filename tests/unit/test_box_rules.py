"""The worker's side of a 1.0 program's box (``workers.v1.box``) without processes: which limit a failed program's
exit names, and the demo on a machine whose user cannot make boxes (docs/agl-v1.md, "Boxes")."""

from __future__ import annotations

import argparse
import signal
import subprocess

import pytest

from bridge.core.infra import ConfigError
from bridge.core.settings import load_settings
from bridge_lab import demo
from workers.v1 import box


@pytest.mark.parametrize(
    ("code", "output", "named"),
    [
        (-signal.SIGXCPU, "", "AGL_V1_PROGRAM_CPU_S=3600"),
        (1, "Traceback ...\nMemoryError\n", "AGL_V1_PROGRAM_MEMORY_MB=8192"),
        (1, "OSError: [Errno 27] File too large\n", "AGL_V1_PROGRAM_MAX_FILE_MB=1024"),
        (1, "OSError: [Errno 24] Too many open files\n", "AGL_V1_PROGRAM_MAX_OPEN_FILES=4096"),
        (1, "BlockingIOError: [Errno 11] Resource temporarily unavailable\n", "AGL_V1_PROGRAM_MAX_PROCESSES=512"),
        (1, "RuntimeError: can't start new thread\n", "AGL_V1_PROGRAM_MAX_PROCESSES=512"),
    ],
)
def test_a_failed_programs_exit_names_the_limit_it_ran_into(code: int, output: str, named: str) -> None:
    limit = box.limit_hit(code, output, load_settings())
    assert limit is not None and named in limit


def test_an_ordinary_failure_names_no_limit_and_an_unboxed_program_none() -> None:
    assert box.limit_hit(1, "ValueError: the agent broke\n", load_settings()) is None
    assert box.limit_hit(1, "MemoryError\n", load_settings(agl_v1_isolation="none")) is None


def test_a_full_disk_names_the_quota_only_where_the_programs_directory_had_one() -> None:
    """A box without a mount namespace has no quota: "No space left on device" is then a full disk, no limit."""
    full = "OSError: [Errno 28] No space left on device\n"
    limit = box.limit_hit(1, full, load_settings(agl_v1_program_disk_mb=32), disk_quota=True)
    assert limit is not None and "AGL_V1_PROGRAM_DISK_MB=32" in limit
    assert box.limit_hit(1, full, load_settings(), disk_quota=False) is None


def test_an_attempt_records_its_disk_quota_only_where_its_box_has_a_mount_namespace() -> None:
    quota = box.Isolation("box", 2_000_000_123, {"file_bytes": 1, "disk_bytes": 2}, namespaces=True)
    assert quota.record()["disk_quota"] is True and quota.record()["limits"]["disk_bytes"] == 2
    without = box.Isolation("box", 2_000_000_123, {"file_bytes": 1})
    assert without.record()["disk_quota"] is False and "no disk quota" in without.describe()
    settings = load_settings(agl_v1_program_disk_mb=32)
    assert "32 MiB disk quota" in box.node_isolation(settings, namespaces=True)
    assert "no disk quota (no mount namespace)" in box.node_isolation(settings, namespaces=False)
    assert "no disk quota (AGL_V1_PROGRAM_DISK_MB=0)" in box.node_isolation(load_settings(agl_v1_program_disk_mb=0))


def test_the_demo_runs_1_0_programs_unboxed_where_its_user_cannot_box_them_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(agl="v1", workers=1, concurrency=2, pool="threads", no_flower=True, log_dir=None)
    monkeypatch.setattr(box, "missing_capabilities", lambda: ["CAP_SETUID", "CAP_SETGID"])
    config = demo._stack_config(load_settings(redis_key_scope="demo-test"), args)
    assert config.extra_env["AGL_V1_ISOLATION"] == "none"
    assert "lacks CAP_SETUID and CAP_SETGID: the demo's 1.0 programs run unboxed" in capsys.readouterr().err
    monkeypatch.setattr(box, "missing_capabilities", lambda: [])
    assert "AGL_V1_ISOLATION" not in demo._stack_config(load_settings(redis_key_scope="demo-test"), args).extra_env


@pytest.mark.parametrize(
    ("pid_namespace", "named"), [(True, "AGL_V1_PROGRAM_PID_NAMESPACE=false"), (False, "box cannot be made")]
)
def test_a_probe_whose_namespace_mounts_are_refused_names_the_setting_that_goes_without(
    monkeypatch: pytest.MonkeyPatch, pid_namespace: bool, named: str
) -> None:
    """Where a security module refuses the mounts (AppArmor's docker-default), the start-up check says how to box
    programs without the namespaces, rather than only that the box failed."""
    refused = "agl-box-failed: its box could not be made: PermissionError(13, 'mount None on /')"
    monkeypatch.setattr(
        box.subprocess, "run", lambda argv, **_: subprocess.CompletedProcess(argv, 125, "", refused + "\n")
    )
    settings = load_settings(agl_v1_program_pid_namespace=pid_namespace)
    with pytest.raises(ConfigError, match=named):
        box.probe(settings)


def test_a_probe_whose_disk_quota_cannot_be_mounted_names_the_setting_that_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The namespaces can be made but the quota's tmpfs cannot be mounted: the start-up check names
    AGL_V1_PROGRAM_DISK_MB=0, not the PID namespace."""
    refused = (
        "agl-box-failed: its box could not be made: PermissionError(1, \"the disk quota's tmpfs "
        '(AGL_V1_PROGRAM_DISK_MB) on /tmp/x/y: [Errno 1] mount tmpfs on /tmp/x/y")'
    )
    monkeypatch.setattr(
        box.subprocess, "run", lambda argv, **_: subprocess.CompletedProcess(argv, 125, "", refused + "\n")
    )
    with pytest.raises(ConfigError, match="AGL_V1_PROGRAM_DISK_MB=0 bounds its directory per file only"):
        box.probe(load_settings())
