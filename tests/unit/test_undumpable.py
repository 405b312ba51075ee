"""A process that holds the keys keeps processes of its own user out (``bridge.core.infra.undumpable``): its
environment cannot be read through ``/proc`` by a process of the same uid that is not root, and a fork
keeps the flag. The processes here leave root for an unprivileged uid (and their capabilities with it) by
``setresuid``, as a worker in the image runs as uid 1000."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bridge.core.infra.undumpable import _prctl, is_dumpable, make_undumpable
from tests.prerequisites import missing

UID = 65534  # nobody


def _become(uid: int) -> None:
    """Leave root for ``uid`` (its group too), and every capability with it."""
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _target(undumpable: bool) -> int:
    """A fork of this process (its environment block is this process's), as ``UID``, undumpable or not; its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _become(UID)
            if undumpable:
                make_undumpable("test target")
            else:
                _prctl(4, 1)  # a change of uid clears the flag: set it back, as an ordinary process has it
            os.write(ready_w, b"1" if is_dumpable() else b"0")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == (b"0" if undumpable else b"1")
    os.close(ready_r)
    return pid


def _read_environ_as(uid: int, pid: int) -> str:
    """What a process of ``uid`` (no capabilities) reads of ``/proc/<pid>/environ``: its text, or the error."""
    out_r, out_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            _become(uid)
            with open(f"/proc/{pid}/environ", "rb") as environ:
                os.write(out_w, environ.read())
        except OSError as exc:
            os.write(out_w, f"error: {exc.strerror}".encode())
        finally:
            os._exit(0)
    os.close(out_w)
    chunks = []
    while chunk := os.read(out_r, 65536):
        chunks.append(chunk)
    os.close(out_r)
    os.waitpid(child, 0)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("undumpable", [False, True], ids=["ordinary", "undumpable"])
def test_a_process_of_the_same_user_reads_the_environment_of_an_ordinary_process_only(undumpable: bool) -> None:
    if os.geteuid() != 0:
        missing("needs root, to run the processes as an unprivileged uid of their own")
    target = _target(undumpable)
    try:
        seen = _read_environ_as(UID, target)
    finally:
        os.kill(target, signal.SIGKILL)
        os.waitpid(target, 0)
    if undumpable:
        assert seen == "error: Permission denied"
    else:
        assert seen and not seen.startswith("error:")  # the control: without the flag the same reader reads it


def test_a_fork_keeps_the_flag() -> None:
    before = is_dumpable()
    out_r, out_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            make_undumpable("test parent")
            grandchild = os.fork()
            if grandchild == 0:
                os.write(out_w, b"0" if is_dumpable() else b"1")
                os._exit(0)
            os.waitpid(grandchild, 0)
        finally:
            os._exit(0)
    os.close(out_w)
    deadline = time.monotonic() + 10
    answer = b""
    while not answer and time.monotonic() < deadline:
        answer = os.read(out_r, 1)
    os.close(out_r)
    os.waitpid(child, 0)
    assert answer == b"1" and is_dumpable() == before  # the fork's fork is undumpable, this process untouched
