"""The 1.0 program server's directories in TMPDIR (``workers.v1.program_directories``): each names its owner, and a
server's start sweeps those whose owner died (a worker SIGKILLed before its server removed its directory), never a live
worker's nor one of another PID namespace. A fake TMPDIR; no server is started."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.core.settings import load_settings
from workers.v1 import program_directories
from workers.v1.program_directories import directory_prefix, pid_namespace, sweep_stale_directories
from workers.v1.server_supervisor import ProgramServer


@pytest.fixture
def tmpdir_(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TMPDIR of its own, short enough for the server's socket path."""
    root = Path(tempfile.mkdtemp(prefix="sweep-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def owned(root: Path, pid: int, namespace: int | None = None) -> Path:
    path = root / f"agl-v1-programs-{pid_namespace() if namespace is None else namespace:x}.{pid}-x1y2z3"
    path.mkdir(mode=0o700)
    (path / "server.sock").write_text("")
    return path


def test_the_sweep_removes_only_directories_of_dead_owners_of_this_pid_namespace(tmpdir_: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            dead = owned(tmpdir_, dead_pid())
            keep = [
                owned(tmpdir_, live.pid),  # a live worker of this host
                owned(tmpdir_, os.getpid()),  # this process's own
                owned(tmpdir_, os.getppid()),
                owned(tmpdir_, dead_pid(), namespace=pid_namespace() + 1),  # another container's, sharing TMPDIR
            ]
            unnamed = tmpdir_ / "agl-v1-programs-abc123"  # no owner in its name (made before the rule)
            unnamed.mkdir()
            not_a_dir = tmpdir_ / f"agl-v1-programs-{pid_namespace():x}.{dead_pid()}-file"
            not_a_dir.write_text("")
            target = tmpdir_ / "elsewhere"
            target.mkdir()
            link = tmpdir_ / f"agl-v1-programs-{pid_namespace():x}.{dead_pid()}-link"
            link.symlink_to(target)
            other = tmpdir_ / "unrelated-dir"
            other.mkdir()

            assert sweep_stale_directories(str(tmpdir_)) == [str(dead)]

            assert not dead.exists()
            for path in [*keep, unnamed, not_a_dir, link, target, other]:
                assert os.path.lexists(path), path
            assert sweep_stale_directories(str(tmpdir_)) == []
        finally:
            live.kill()


def test_a_directory_of_another_user_is_never_removed(tmpdir_: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = owned(tmpdir_, dead_pid())
    uid = os.getuid()
    monkeypatch.setattr(program_directories.os, "getuid", lambda: uid + 1)
    assert sweep_stale_directories(str(tmpdir_)) == [] and stale.exists()


def test_a_program_server_names_its_owner_and_sweeps_dead_workers_directories_first(tmpdir_: Path) -> None:
    """The directory of a worker that died between making it and starting its server is gone at the next
    server's start on the host; the new directory's name says which process owns it."""
    stale = owned(tmpdir_, dead_pid())
    server = ProgramServer(load_settings())  # not started: the directory is made in the constructor
    try:
        assert not stale.exists()
        directory = Path(server.directory)
        assert directory.parent == tmpdir_ and directory.name.startswith(directory_prefix())
        assert directory_prefix() == f"agl-v1-programs-{pid_namespace():x}.{os.getpid()}-"
        assert sweep_stale_directories(str(tmpdir_)) == [] and directory.exists()  # its owner lives
    finally:
        shutil.rmtree(server.directory, ignore_errors=True)
