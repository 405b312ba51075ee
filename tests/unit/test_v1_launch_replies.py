"""The worker's side of the program server's channel (``workers.v1.program_client.request_program``) against a fake
server on a Unix socket: how the replies' lines are read, whatever way the kernel splits or joins them."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from workers.v1.program_client import request_program
from workers.v1.programs import ProgramLost

Reply = Callable[[socket.socket], None]


@pytest.fixture
def serve(request: pytest.FixtureRequest) -> Iterator[Callable[[Reply], str]]:
    """``serve(reply)``: a fake server that takes one request (closing the output pipe it was sent) and answers
    with ``reply``; returns its socket's path."""
    root = Path(tempfile.mkdtemp(prefix="fake-server-", dir="/tmp"))  # short: a Unix socket's path is bounded
    threads: list[threading.Thread] = []

    def start(reply: Reply) -> str:
        path = str(root / "server.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def answer() -> None:
            with listener, listener.accept()[0] as sock:
                _, fds, _, _ = socket.recv_fds(sock, 65536, 4)
                for fd in fds:
                    os.close(fd)
                reply(sock)
                sock.recv(4096)  # until the worker closes its end

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    for thread in threads:
        thread.join(5)
    shutil.rmtree(root, ignore_errors=True)


def started(path: str) -> tuple[int, int | None]:
    """A program asked of the server at ``path``: its pid and exit code (None if none came within 5 s)."""
    program = request_program(path, "some.module:Agent", {})
    assert program is not None
    try:
        return program.pid, program.wait(5.0)
    finally:
        program.kill()
        os.close(program.output_fd)


def test_a_program_that_ended_before_the_forked_line_was_read_gets_its_exit_code(
    serve: Callable[[Reply], str],
) -> None:
    """A program that exits at once: the server sends its exit line right behind the "forked" one, and one read
    can hold both. Reading the two lines as one JSON document failed a program that had run (seen in a long run:
    3 of 2,000 short rollouts failed "the program server did not start it: JSONDecodeError('Extra data ...')")."""
    assert started(serve(lambda sock: sock.sendall(b'{"pid": 4242}\n{"exit": 3}\n'))) == (4242, 3)


def test_replies_split_across_reads_are_joined(serve: Callable[[Reply], str]) -> None:
    def dribble(sock: socket.socket) -> None:
        for part in (b'{"pi', b'd": 7}', b"\n", b'{"exit"', b": 0}\n"):
            sock.sendall(part)

    assert started(serve(dribble)) == (7, 0)


def test_a_refusal_is_a_lost_program(serve: Callable[[Reply], str]) -> None:
    path = serve(lambda sock: sock.sendall(b'{"error": "malformed request"}\n'))
    with pytest.raises(ProgramLost, match="refused it: malformed request"):
        request_program(path, "some.module:Agent", {})
