"""The worker's side of the program server's channel: one Unix stream connection per program, its socket in a
0700 directory of its own, so no state is shared between the threads of a ``-P threads`` worker or the processes
of a prefork one. ``request_program`` asks the server to fork a program and hands back its ``WarmProgram``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import struct
import time
from typing import Any

from workers.v1.programs import ProgramLost, WarmProgram

log = logging.getLogger("workers.v1.program_client")

CONNECT_WAIT_S = 5.0  # while a server is being replaced; then the program starts cold
REPLY_TIMEOUT_S = 30.0  # for the server's "forked" answer


def request_program(
    socket_path: str, agent_class: str, env: dict[str, str], box: dict[str, Any] | None = None
) -> WarmProgram | None:
    """Ask the server at ``socket_path`` to fork ``agent_class`` with ``env`` in ``box``; None when no server
    answers within ``CONNECT_WAIT_S`` (nothing was asked: the caller starts it cold). ProgramLost when the server
    took the request and then died or did not answer (the program may have started: never start it again here)."""
    sock = _connect(socket_path)
    if sock is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        request = {"agent_class": agent_class, "env": env, "cwd": os.getcwd(), "worker_pid": os.getpid(), "box": box}
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
        return WarmProgram(sock, int(answer["pid"]), read_fd, rest, box)
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
