"""Which connection pool each client keeps (``bridge.core.http``).

The LLM client keeps one small pool per thread (``PerThreadTransport``): a shared pool is walked on every
request and every response close, a syscall per idle connection, under the GIL, and with 128 threads each
holding an LLM call open it cost a threads worker 16% of its Python time. The Store and WebShop clients,
which a thread calls now and then, share one pool so that their connections stay warm. Real ``httpx``
against a loopback server; the pools' own connection counts are read from httpcore.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from bridge.core.http import pooled_transport, service_client
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


def test_each_thread_has_its_own_llm_pool_and_ended_threads_pools_are_closed(server: RecordingStore) -> None:
    transport = pooled_transport(max_connections=8)
    client = httpx.Client(base_url=server.url, transport=transport)
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


def test_threads_calling_a_service_now_and_then_share_one_warm_connection(server: RecordingStore) -> None:
    client = service_client(server.url, token=None, timeout_s=5, max_connections=8)
    transport = client._transport
    assert isinstance(transport, httpx.HTTPTransport)
    try:
        for path in ("/a", "/b", "/c"):
            _in_thread(lambda path=path: client.get(path))
        # Three threads, one after another: the first one's connection served all three (a pool per thread
        # would have opened three, each idle until it expired).
        assert len(transport._pool.connections) == 1
        assert server.paths == ["/a", "/b", "/c"]
    finally:
        client.close()
