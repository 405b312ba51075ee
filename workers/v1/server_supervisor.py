"""The node's 1.0 program server, seen from the worker: ``ProgramServer`` spawns it (``workers.v1.program_server``
runs in it), waits for its ready line and keeps one running with a supervisor thread that replaces a server that
dies. It dies with the node's main process (``PR_SET_PDEATHSIG`` on the supervisor thread; on SIGTERM it kills its
programs and removes its socket's directory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bridge.core.infra import ConfigError
from bridge.core.settings import WorkerSettings
from workers.v1.environment import base_environment
from workers.v1.program_client import request_program
from workers.v1.program_directories import directory_prefix, sweep_stale_directories
from workers.v1.program_server import SERVER_MARKER
from workers.v1.programs import KILL_WAIT_S, WarmProgram, bootstrap

log = logging.getLogger("workers.v1.server_supervisor")

DEFAULT_PRELOAD = ("openai", "openai.resources", "openai.types", "httpx", "httpcore", "h11", "pydantic")
"""What the program server imports at its start, each when installed: what 1.0 agent programs import. ``openai``
imports its resources and types lazily, at a client's first use (about 0.25 s of CPU, measured): they are named
too, so a program's first ``client.chat.completions.create`` imports nothing more."""
SERVER_START_TIMEOUT_S = 120.0  # the server's own start: an interpreter and its imports, on a loaded node
RESTART_BACKOFF_S = (0.5, 30.0)
UNIX_PATH_MAX = 100


class ProgramServer:
    """The node's program server and the supervisor thread that keeps one running.

    ``start`` runs the first server and waits until it is ready: ConfigError when it cannot start (the
    interpreter, a module of ``AGL_V1_PRELOAD`` or of the agents' allowlist that does not import). The server is
    spawned by the supervisor thread (``PR_SET_PDEATHSIG`` follows the thread that spawned it) with the
    programs' base environment, never the worker's secrets. ``start_program`` is what every worker process and
    thread calls; it needs only the socket's path."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.python = settings.agl_v1_agent_python or sys.executable
        self.env = base_environment(settings)
        self.required = list(settings.agl_v1_preload)
        if settings.agl_v1_preload_agents:
            self.required += [m for m in settings.agl_v1_agent_modules if m not in self.required]
        self.optional = [m for m in DEFAULT_PRELOAD if m not in self.required]
        sweep_stale_directories()
        self.directory = tempfile.mkdtemp(prefix=directory_prefix())  # mode 0700
        self.socket_path = os.path.join(self.directory, "server.sock")
        if len(self.socket_path) > UNIX_PATH_MAX:
            raise ConfigError(f"the program server's socket path is too long for a Unix socket: {self.socket_path}")
        self.owner = os.getpid()
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._first: list[str | None] = []
        self._first_ready = threading.Event()
        self.ready = threading.Event()  # a server answers (in the process that started it)
        self._thread = threading.Thread(target=self._supervise, name="agl-program-server", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._first_ready.wait(SERVER_START_TIMEOUT_S + 5):
            raise ConfigError("the 1.0 program server did not start (AGL_V1_WARM_START)")
        if self._first[0] is not None:
            self.stop()
            raise ConfigError(f"the 1.0 program server could not start: {self._first[0]}", setting="AGL_V1_PRELOAD")

    def stop(self) -> None:
        """Stop the server (its programs are killed) and the supervisor; only in the process that started it."""
        if os.getpid() != self.owner:
            return
        self._stopping.set()
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self._stopping.is_set():
            started = time.monotonic()
            error = self._spawn()
            if not self._first_ready.is_set():
                self._first.append(error)
                self._first_ready.set()
                if error is not None:
                    return
            if error is None and self.process is not None:
                self.ready.set()
                code = self.process.wait()
                self.ready.clear()
                if self._stopping.is_set():
                    return
                log.error(
                    "the 1.0 program server (pid %d) died with code %s: its programs died with it; starting another",
                    self.process.pid,
                    code,
                )
            else:
                log.error("the 1.0 program server could not start again: %s", error)
            lived = time.monotonic() - started
            backoff = RESTART_BACKOFF_S[0] if lived > 10 else min(backoff * 2, RESTART_BACKOFF_S[1])
            self.restarts += 1
            self._stopping.wait(backoff)

    def _spawn(self) -> str | None:
        """Start a server and wait for its ready line; the reason it is not ready, or None."""
        refused = self._make_directory()
        if refused is not None:
            return refused
        ready_r, ready_w = os.pipe()
        config = {
            "marker": SERVER_MARKER,
            "socket": self.socket_path,
            "ready_fd": ready_w,
            "preload": self.required,
            "optional": self.optional,
            "given": sorted(self.env),
            "worker_pid": os.getpid(),
        }
        try:
            self.process = subprocess.Popen(
                [self.python, "-c", bootstrap("server_main"), json.dumps(config)],
                env=self.env,
                stdin=subprocess.DEVNULL,
                pass_fds=(ready_w,),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(ready_r)
            return f"{self.python}: {exc}"
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            if not select.select([ready], [], [], SERVER_START_TIMEOUT_S)[0]:
                self.process.kill()
                self.process.wait()
                return f"not ready within {SERVER_START_TIMEOUT_S:.0f}s"
            line = ready.readline()
        try:
            answer: dict[str, Any] = json.loads(line) if line else {"error": f"exited: {self.process.wait()}"}
        except ValueError:
            answer = {"error": f"answered {line[:200]!r}"}
        if "error" in answer:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(KILL_WAIT_S)
            return str(answer["error"])
        for name, why in answer.get("skipped", {}).items():
            log.info("the 1.0 program server does not preload %s: %s", name, why)
        if answer.get("threads", 1) > 1:
            log.warning(
                "the 1.0 program server has %d threads after its imports: forking it is unsafe; "
                "drop the module that starts them from AGL_V1_PRELOAD",
                answer["threads"],
            )
        log.info(
            "1.0 program server ready (pid %d, %s): preloaded %s",
            self.process.pid,
            self.python,
            ", ".join(answer.get("loaded", [])) or "nothing",
        )
        return None

    def _make_directory(self) -> str | None:
        """The socket's directory as ``mkdtemp`` made it (the last server removed it at its exit): made again with
        mode 0700, or found as this user's own with no access for others; else the reason it is not used."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.directory, 0o700)
        try:
            found = os.lstat(self.directory)
        except OSError as exc:
            return f"{self.directory}: {exc}"
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            return f"{self.directory} is not a private directory of this user: not used for the server's socket"
        return None

    def start_program(
        self, agent_class: str, env: dict[str, str], box: dict[str, Any] | None = None
    ) -> WarmProgram | None:
        """``request_program`` of this node's server."""
        return request_program(self.socket_path, agent_class, env, box)
