"""The handles of a running 1.0 agent program, the same for both starts: ``Program``, ``ColdProgram`` (a fresh
interpreter, the worker's own child) and ``WarmProgram`` (a fork of the node's program server, reached through
its connection).

* ``wait`` returns the exit code (``Popen.returncode``) or None; ``kill`` kills the whole process group and reaps
  the leader, and is safe to repeat; the group is killed at the leader's exit too (its children with it);
* warm: ``ProgramLost`` from ``wait`` when the server died under the program (the program died with it; ``kill``
  then kills the rest of its group).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

from workers.v1.program_server import box_uid, sweep_box

log = logging.getLogger("workers.v1.programs")

SERVER_FILE = Path(__file__).with_name("program_server.py")
KILL_WAIT_S = 5.0


def bootstrap(entry: str) -> str:
    """The ``python -c`` source that runs ``entry`` of the program-server file as the module ``agl_program``."""
    path = str(SERVER_FILE)
    return (
        "import sys, types; m = types.ModuleType('agl_program'); sys.modules[m.__name__] = m; "
        f"m.__file__ = {path!r}; exec(compile(open(m.__file__).read(), m.__file__, 'exec'), m.__dict__); "
        f"del sys, types; m.{entry}()"
    )


class ProgramLost(RuntimeError):
    """The program's server died under it, or did not answer: the program is gone, its exit code unknown."""


class Program(Protocol):
    start: str  # "warm" or "cold"
    pid: int
    output_fd: int
    box: dict[str, Any] | None  # the box it runs in (workers.v1.box), None when not isolated

    def wait(self, timeout: float) -> int | None: ...

    def kill(self) -> None: ...


class ColdProgram:
    """A program in a fresh interpreter, the worker's own child."""

    start = "cold"

    def __init__(self, python: str, agent_class: str, env: dict[str, str], box: dict[str, Any] | None = None) -> None:
        self.box = box
        self._swept = False
        self.process = subprocess.Popen(
            [python, "-c", bootstrap("cold_main"), agent_class, str(os.getpid()), json.dumps(box)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.pid, self.output_fd = self.process.pid, self.process.stdout.fileno()

    def wait(self, timeout: float) -> int | None:
        if self.box is None or self.process.returncode is not None:
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        # Boxed: the box is swept while the leader is still unreaped, so its pid (and with it the uid) stays taken.
        deadline, pause = time.monotonic() + timeout, 0.001
        while os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
        self._sweep()
        return self.process.wait()

    def _sweep(self) -> None:
        if self.box is not None and not self._swept and self.process.returncode is None:
            self._swept = True
            sweep_box(box_uid(int(self.box["uid_base"]), self.pid), str(self.box["directory"]))

    def kill(self) -> None:
        kill_group(self.pid)
        self._sweep()
        try:
            self.process.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("agent process %d did not exit within %.0fs of SIGKILL", self.pid, KILL_WAIT_S)


class WarmProgram:
    """A program forked by the node's server: its connection carries the exit code and the kill."""

    start = "warm"

    def __init__(
        self, sock: socket.socket, pid: int, output_fd: int, received: bytes = b"", box: dict[str, Any] | None = None
    ) -> None:
        self.sock, self.pid, self.output_fd, self.box = sock, pid, output_fd, box
        self.code: int | None = None
        self.lost = False
        self._buffer = received  # what came after the "forked" line: the exit line of a program already done

    def wait(self, timeout: float) -> int | None:
        if self.code is not None:
            return self.code
        if self.lost:
            raise ProgramLost("its program server died")
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                self.lost = True
                raise ProgramLost("its program server died")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        self.code = int(json.loads(line)["exit"])
        return self.code

    def kill(self) -> None:
        try:
            if self.code is None and not self.lost:
                with contextlib.suppress(OSError):
                    self.sock.sendall(b'{"kill": true}\n')
                with contextlib.suppress(ProgramLost):
                    if self.wait(KILL_WAIT_S) is None:
                        log.warning("agent process %d did not exit within %.0fs of SIGKILL", self.pid, KILL_WAIT_S)
            if self.lost:  # the server died: the leader with it (PR_SET_PDEATHSIG), the rest of its group here
                kill_group(self.pid)
        finally:
            self.sock.close()


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads; nothing if it is gone. ValueError for a pid below 1: killpg(0) would
    be the caller's own group."""
    if pid < 1:
        raise ValueError(f"no process group {pid}")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
