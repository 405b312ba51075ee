"""How a 1.0 agent program's process starts: a fresh interpreter (cold) or a fork of the node's program server
(warm, ``AGL_V1_WARM_START``), behind one handle, ``Program`` (docs/agl-v1.md, "Warm starts").

Contract, the same for both starts (``workers.v1.program_server`` runs in the program's process):

* the program leads its own session, with exactly the environment it is given, the worker's cwd, stdin on
  /dev/null and its stdout and stderr on one pipe, ``output_fd``, read by the attempt in bounded chunks;
* it dies with the worker: cold, by ``PR_SET_PDEATHSIG`` on the worker; warm, on its server, which stops with the
  node's main process the same way (SIGTERM: it kills its programs and removes its socket's directory), and the
  server kills the program's group when the worker process that asked for it closes its connection (it died);
* ``wait`` returns the exit code (``Popen.returncode``) or None; ``kill`` kills the whole process group and reaps
  the leader, and is safe to repeat; the group is killed at the leader's exit too (its children with it);
* warm: ``ProgramLost`` from ``wait`` when the server died under the program (the program died with it; ``kill``
  then kills the rest of its group), or from the start when the server died or hung with the request (a server
  that does not answer within ``REPLY_TIMEOUT_S`` is killed, to be replaced). The node's ``ProgramServer`` is
  started once per worker node, before a prefork pool forks (``node_server``); a supervisor thread replaces a
  server that dies, and while none answers a program starts cold.

The server's channel is one Unix stream connection per program, its socket in a 0700 directory of its own: no
state is shared between the threads of a ``-P threads`` worker or the processes of a prefork one.

The directory's name says who owns it: ``agl-v1-programs-<pid namespace>.<pid>-<random>``, the worker process
that made it (its PID, and the inode of its PID namespace, ``/proc/self/ns/pid``, in hex; 0 where there is none). A
worker SIGKILLed before its server removed the directory leaves it in TMPDIR, so each ``ProgramServer`` first
sweeps TMPDIR (``sweep_stale_directories``): it removes a directory of this pattern only when it is this user's
(not a link), names this process's PID namespace, and no process of that PID exists. A live worker's directory
is never removed (its PID exists); one named by another PID namespace (another container sharing TMPDIR) is never
touched; a dead worker's directory whose PID was reused since is left until that process is gone too.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from bridge.core.errors import ConfigError
from bridge.core.settings import Settings
from workers.v1.environment import base_environment
from workers.v1.program_server import SERVER_MARKER

log = logging.getLogger("workers.v1.launch")

DEFAULT_PRELOAD = ("openai", "openai.resources", "openai.types", "httpx", "httpcore", "h11", "pydantic")
"""What the program server imports at its start, each when installed: what 1.0 agent programs import. ``openai``
imports its resources and types lazily, at a client's first use (about 0.25 s of CPU, measured): they are named
too, so a program's first ``client.chat.completions.create`` imports nothing more."""
SERVER_FILE = Path(__file__).with_name("program_server.py")
KILL_WAIT_S = 5.0
SERVER_START_TIMEOUT_S = 120.0  # the server's own start: an interpreter and its imports, on a loaded node
CONNECT_WAIT_S = 5.0  # while a server is being replaced; then the program starts cold
REPLY_TIMEOUT_S = 30.0  # for the server's "forked" answer
RESTART_BACKOFF_S = (0.5, 30.0)
UNIX_PATH_MAX = 100
DIRECTORY_PREFIX = "agl-v1-programs-"
_DIRECTORY_NAME = re.compile(re.escape(DIRECTORY_PREFIX) + r"(?P<namespace>[0-9a-f]+)\.(?P<pid>\d+)-[^/]+")


def pid_namespace() -> int:
    """The inode of this process's PID namespace (PIDs mean something only within it); 0 where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def directory_prefix() -> str:
    """``mkdtemp``'s prefix for a program server's directory made by this process: its owner in the name."""
    return f"{DIRECTORY_PREFIX}{pid_namespace():x}.{os.getpid()}-"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def sweep_stale_directories(tmpdir: str | None = None) -> list[str]:
    """Remove the program servers' directories in ``tmpdir`` (default: ``tempfile.gettempdir()``) whose owner is
    gone, by the rule of this module's docstring; the paths removed."""
    root = tmpdir or tempfile.gettempdir()
    namespace, uid = pid_namespace(), os.getuid()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _DIRECTORY_NAME.fullmatch(name)
        if match is None or int(match["namespace"], 16) != namespace:
            continue
        pid = int(match["pid"])
        if _pid_exists(pid):  # ours included
            continue
        path = os.path.join(root, name)
        try:
            found = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.info("removed %d program server directories of dead workers: %s", len(removed), ", ".join(removed))
    return removed


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

    def wait(self, timeout: float) -> int | None: ...

    def kill(self) -> None: ...


class ColdProgram:
    """A program in a fresh interpreter, the worker's own child."""

    start = "cold"

    def __init__(self, python: str, agent_class: str, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [python, "-c", bootstrap("cold_main"), agent_class, str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.pid, self.output_fd = self.process.pid, self.process.stdout.fileno()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        kill_group(self.pid)
        try:
            self.process.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("agent process %d did not exit within %.0fs of SIGKILL", self.pid, KILL_WAIT_S)


class WarmProgram:
    """A program forked by the node's server: its connection carries the exit code and the kill."""

    start = "warm"

    def __init__(self, sock: socket.socket, pid: int, output_fd: int, received: bytes = b"") -> None:
        self.sock, self.pid, self.output_fd = sock, pid, output_fd
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
    """SIGKILL the process group ``pid`` leads; nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class ProgramServer:
    """The node's program server and the supervisor thread that keeps one running.

    ``start`` runs the first server and waits until it is ready: ConfigError when it cannot start (the
    interpreter, a module of ``AGL_V1_PRELOAD`` or of the agents' allowlist that does not import). The server is
    spawned by the supervisor thread (``PR_SET_PDEATHSIG`` follows the thread that spawned it) with the
    programs' base environment, never the worker's secrets. ``start_program`` is what every worker process and
    thread calls; it needs only the socket's path."""

    def __init__(self, settings: Settings) -> None:
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

    def start_program(self, agent_class: str, env: dict[str, str]) -> WarmProgram | None:
        """``request_program`` of this node's server."""
        return request_program(self.socket_path, agent_class, env)


def request_program(socket_path: str, agent_class: str, env: dict[str, str]) -> WarmProgram | None:
    """Ask the server at ``socket_path`` to fork ``agent_class`` with ``env``; None when no server answers within
    ``CONNECT_WAIT_S`` (nothing was asked: the caller starts it cold). ProgramLost when the server took the
    request and then died or did not answer (the program may have started: never start it again here)."""
    sock = _connect(socket_path)
    if sock is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        request = {"agent_class": agent_class, "env": env, "cwd": os.getcwd(), "worker_pid": os.getpid()}
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [write_fd])
        os.close(write_fd)
        write_fd = -1
        sock.settimeout(REPLY_TIMEOUT_S)
        reply = b""
        while b"\n" not in reply:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                _kill_hung_server(sock)
                raise ProgramLost(f"the program server did not answer within {REPLY_TIMEOUT_S:.0f}s") from None
            if not chunk:
                raise ProgramLost("the program server died before it started the program")
            reply += chunk
        # A program that ends at once has its exit line sent right behind the "forked" one: one read may hold both.
        line, _, rest = reply.partition(b"\n")
        answer = json.loads(line)
        if "error" in answer:
            raise ProgramLost(f"the program server refused it: {answer['error']}")
        sock.settimeout(None)
        return WarmProgram(sock, int(answer["pid"]), read_fd, rest)
    except (OSError, ValueError, KeyError) as exc:
        sock.close()
        os.close(read_fd)
        raise ProgramLost(f"the program server did not start it: {exc!r}") from exc
    except ProgramLost:
        sock.close()
        os.close(read_fd)
        raise
    finally:
        if write_fd >= 0:
            os.close(write_fd)


def _kill_hung_server(sock: socket.socket) -> None:
    """SIGKILL the server at the other end of ``sock`` (the kernel's word for its pid, ``SO_PEERCRED``): the
    node's supervisor starts another, and the programs it held die with it."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        log.error("the 1.0 program server (pid %d) did not answer within %.0fs: killed", pid, REPLY_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)
    except (OSError, struct.error) as exc:
        log.error("could not kill the 1.0 program server that did not answer: %r", exc)


def _connect(socket_path: str) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED) or time.monotonic() >= deadline:
                log.warning("no 1.0 program server at %s (%s): the program starts cold", socket_path, exc)
                return None
        time.sleep(0.1)


_server_lock = threading.Lock()
_server: ProgramServer | None = None
_failed: str | None = None  # why this process's lazy start failed: not tried again for every program


def node_server(settings: Settings) -> ProgramServer:
    """This node's program server: the one ``worker_init`` started in the main process (a prefork pool
    process inherits it and only connects), else one started now, in this process. ConfigError when it cannot
    start."""
    global _server, _failed
    with _server_lock:
        if _server is None:
            if _failed is not None:
                raise ConfigError(_failed, setting="AGL_V1_PRELOAD")
            server = ProgramServer(settings)
            try:
                server.start()
            except ConfigError as exc:
                _failed = exc.message
                raise
            _server = server
            atexit.register(stop_node_server)
        return _server


def stop_node_server() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server = None


def start_program(settings: Settings, agent_class: str, env: dict[str, str]) -> Program:
    """Start ``agent_class`` with ``env`` as ``AGL_V1_WARM_START`` says. ProgramLost: a warm start's server died
    with the request."""
    python = settings.agl_v1_agent_python or sys.executable
    if settings.agl_v1_warm_start:
        try:
            server = node_server(settings)
        except ConfigError as exc:
            log.error("%s: the program starts cold", exc.message)
        else:
            program = server.start_program(agent_class, env)
            if program is not None:
                return program
    return ColdProgram(python, agent_class, env)
