"""Service clients keep one small connection pool per thread (``bridge.core.http.PerThreadTransport``).

A shared pool is walked on every request and every response close, a syscall per idle connection, under the
GIL: with 128 threads it cost a threads worker 16% of its Python time. Real ``httpx`` against a loopback
server; the pools' own connection counts are read from httpcore.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from bridge.core.http import PerThreadTransport, service_client
from tests.loopback import RecordingStore


@pytest.fixture
def server() -> Iterator[RecordingStore]:
    recorder = RecordingStore()
    yield recorder
    recorder.close()


def _in_thread(action: object) -> None:
    thread = threading.Thread(target=action)  # type: ignore[arg-type]
    thread.start()
    thread.join(timeout=10)


def test_each_thread_has_its_own_pool_and_ended_threads_pools_are_closed(server: RecordingStore) -> None:
    client = service_client(server.url, token=None, timeout_s=5, max_connections=8)
    transport = client._transport
    assert isinstance(transport, PerThreadTransport)
    try:
        client.get("/a")
        mine = transport._pools[threading.get_ident()]
        seen: list[object] = []

        def other() -> None:
            client.get("/b")
            seen.append(transport._pools[threading.get_ident()])

        _in_thread(other)
        assert seen and seen[0] is not mine  # the other thread did not use (or walk) this thread's connections
        assert len(mine._pool.connections) == 1

        _in_thread(lambda: client.get("/c"))  # a new thread: the ended one's pool is closed and dropped
        assert seen[0] not in transport._pools.values()
        assert seen[0]._pool.connections == []  # type: ignore[attr-defined]
        assert server.paths == ["/a", "/b", "/c"]
    finally:
        client.close()
    assert transport._pools == {} and mine._pool.connections == []
