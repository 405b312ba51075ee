"""Which connection pool each client keeps (``bridge.core.infra.http``).

The LLM client keeps one small pool per thread (``PerThreadTransport``), handed on to a later thread when its thread
ends: a shared pool is walked on every
request and every response close, a syscall per idle connection, under the GIL, and with 128 threads each
holding an LLM call open it cost a threads worker 16% of its Python time. The Store and WebShop clients,
which a thread calls now and then, share one pool so that their connections stay warm. Real ``httpx``
against a loopback server, which tells the connections apart by their client ports.
"""

from __future__ import annotations

import _thread
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx
import pytest

from bridge.core.infra import http, pooled_transport, service_client
from tests.helpers import wait_for
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


def test_each_thread_has_its_own_llm_pool_and_an_ended_threads_pool_serves_the_next_thread_warm(
    server: RecordingStore,
) -> None:
    transport = pooled_transport(max_connections=8)
    client = httpx.Client(base_url=server.url, transport=transport)
    try:
        client.get("/a")
        mine = transport.pools[threading.current_thread()]
        seen: list[httpx.HTTPTransport] = []

        def other() -> None:
            client.get("/b")
            seen.append(transport.pools[threading.current_thread()])

        _in_thread(other)
        assert seen and seen[0] is not mine  # the other thread did not use (or walk) this thread's connections
        [(_, main_port), (_, first_port)] = server.request_ports
        assert first_port != main_port

        # A thread per attempt: the next one takes the ended thread's pool with its open connection, instead of
        # opening (and with TLS negotiating) a new one for every rollout.
        _in_thread(other)
        assert seen[1] is seen[0] and server.request_ports[2] == ("/b", first_port)
        assert server.paths == ["/a", "/b", "/b"]
    finally:
        client.close()
    assert transport.pools == {} and transport.idle == []
    wait_for(lambda: not server.open_ports, 5, "closing the client closed every pool's connection")


def test_no_more_pools_are_kept_than_threads_ever_held_at_once(server: RecordingStore) -> None:
    transport = pooled_transport(max_connections=8)
    client = httpx.Client(base_url=server.url, transport=transport)
    start, stop = threading.Barrier(4), threading.Event()

    def busy() -> None:
        client.get("/busy")
        start.wait(10)
        stop.wait(10)

    try:
        threads = [threading.Thread(target=busy) for _ in range(3)]
        for thread in threads:
            thread.start()
        start.wait(10)  # three threads hold a pool at once
        stop.set()
        for thread in threads:
            thread.join(10)
        _in_thread(lambda: client.get("/next"))  # takes one of the three; the other two wait for the next threads
        assert len(transport.pools) + len(transport.idle) == 3
        assert transport.most == 3
    finally:
        client.close()


def test_threads_calling_a_service_now_and_then_share_one_warm_connection(server: RecordingStore) -> None:
    client = service_client(server.url, token=None, timeout_s=5, max_connections=8)
    try:
        for path in ("/a", "/b", "/c"):
            _in_thread(lambda path=path: client.get(path))
        # Three threads, one after another: the first one's connection served all three (a pool per thread
        # would have opened three, each idle until it expired).
        assert len({port for _, port in server.request_ports}) == 1
        assert server.paths == ["/a", "/b", "/c"]
    finally:
        client.close()


def test_a_thread_that_threading_did_not_start_keeps_its_pool_while_others_make_theirs(server: RecordingStore) -> None:
    # The pools of ended threads are closed when another thread makes its own; a thread missing from
    # threading's list (one started by C code, or one that started after the list was taken) once counted
    # as ended, and its connection was closed under its call.
    transport = pooled_transport(max_connections=8)
    client = httpx.Client(base_url=server.url, transport=transport)
    made, checked, done = threading.Event(), threading.Event(), threading.Event()

    def foreign() -> None:
        client.get("/foreign")
        made.set()
        checked.wait(10)
        client.get("/foreign-again")
        done.set()

    try:
        _thread.start_new_thread(foreign, ())
        assert made.wait(10)
        _in_thread(lambda: client.get("/other"))  # makes its own pool, closing the ended threads' pools
        checked.set()
        assert done.wait(10)
        ports = dict(server.request_ports)
        assert server.paths.count("/foreign") == 1 and server.paths.count("/foreign-again") == 1
        # Its connection was left open (the foreign thread is alive): the same warm connection served its next call.
        assert ports["/foreign-again"] == ports["/foreign"] != ports["/other"]
    finally:
        checked.set()
        client.close()


def test_a_connection_the_pool_finds_expired_is_closed_at_once_so_no_request_starts_on_it(
    server: RecordingStore,
) -> None:
    # httpcore closes an expired connection after it released the lock under which a request starts on it:
    # a request handed that connection just before could start and then lose its socket mid-read (EBADF).
    client = service_client(server.url, token=None, timeout_s=5.0, max_connections=4)
    try:
        client.get("/a")
        pool = client._transport._pool  # type: ignore[attr-defined]
        [connection] = pool.connections
        assert not connection.has_expired() and not connection.is_closed()  # idle within the keep-alive
        connection._connection._expire_at = time.monotonic() - 1.0  # now idle past it
        assert connection.has_expired() and connection.is_closed()  # found expired and closed in one step
        with pytest.raises(httpcore.ConnectionNotAvailable):  # a request handed it earlier cannot start on it
            connection.handle_request(httpcore.Request("GET", f"{server.url}/b"))
        client.get("/c")  # the pool drops it and opens another
        assert server.paths == ["/a", "/c"] and len(pool.connections) == 1 and pool.connections[0] is not connection
    finally:
        client.close()


def test_clients_built_one_after_another_share_one_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every transport of the process verifies with one TLS context: building one loads the whole CA bundle
    (about 0.8 MB and 20 ms of CPU), and a 1.0 attempt builds two gateway clients, so a prefork node grew in
    0.8 MB steps over a long run and spent 40 ms of CPU per rollout on it (docs/performance.md, "A long run of
    1.0 rollouts")."""
    built: list[ssl.SSLContext] = []
    real = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    http.default_tls.cache_clear()  # a context of its own, built under the count
    try:
        for _ in range(5):
            service_client("http://127.0.0.1:9", token=None, timeout_s=1.0, max_connections=2).close()
            pooled_transport(2).close()
    finally:
        http.default_tls.cache_clear()
    assert len(built) == 1, f"{len(built)} TLS contexts built for 10 transports"
