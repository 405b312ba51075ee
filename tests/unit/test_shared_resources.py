"""Resources shared through Redis: one Store read per TTL for every worker process, never staler than one process.

Three ``StoreClient``s stand for three prefork processes, each with its own ``RedisResources`` on one real
Redis, against a small HTTP server that serves ``GET /v1/agl/resources/{id}`` and counts the reads.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.store import StoreClient
from tests.loopback import LoopbackServer
from workers.lifecycle.shared_resources import RedisResources


class ResourcesServer(LoopbackServer):
    """Serves ``GET /v1/agl/resources/{id}`` with ``model`` as its LLM and records the ids read."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.model = "model-v1"

        def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
            resources_id = path.rsplit("/", 1)[-1]
            self.reads.append(resources_id)
            llm = {"resource_type": "llm", "endpoint": "http://llm", "model": self.model}
            body = {"resources_id": resources_id, "version": 1, "resources": {"main_llm": llm}}
            return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()

        super().__init__(answer)


@pytest.fixture
def server() -> Iterator[ResourcesServer]:
    srv = ResourcesServer()
    yield srv
    srv.close()


def _processes(server: ResourcesServer, client: redis.Redis, ttl_s: float, n: int = 3) -> list[StoreClient]:
    stores = []
    for _ in range(n):
        store = StoreClient(server.url, retries=0, resources_ttl_s=ttl_s)
        store.shared_resources = RedisResources(client, keys.store_scope(server.url))
        stores.append(store)
    return stores


def test_processes_share_one_read_per_ttl_and_never_serve_past_it(
    server: ResourcesServer, redis_client: redis.Redis
) -> None:
    resources_id = f"rs-{uuid.uuid4().hex[:8]}"
    stores = _processes(server, redis_client, ttl_s=1.0)
    try:
        for store in stores:
            update = store.get_resources(resources_id)
            assert update is not None and update.resources["main_llm"]["model"] == "model-v1"
        assert server.reads == [resources_id], "each process read the Store for the same update"

        server.model = "model-v2"  # the trainer published new resources under the same id
        time.sleep(1.1)  # past the TTL counted from the one fetch: neither Redis nor a process may serve v1
        models = [store.get_resources(resources_id).resources["main_llm"]["model"] for store in stores]  # type: ignore[union-attr]
        assert models == ["model-v2"] * 3
        assert server.reads == [resources_id] * 2
    finally:
        for store in stores:
            store.close()
        redis_client.delete(keys.shared_resources(keys.store_scope(server.url), resources_id))


def test_without_redis_each_process_reads_for_itself(server: ResourcesServer) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    stores = _processes(server, dead, ttl_s=30.0)
    try:
        for store in stores:
            assert store.get_resources("rs-down") is not None
            assert store.get_resources("rs-down") is not None  # the process's own cache still works
        assert server.reads == ["rs-down"] * 3
    finally:
        for store in stores:
            store.close()


def test_a_damaged_entry_reads_as_a_miss(server: ResourcesServer, redis_client: redis.Redis) -> None:
    resources_id = f"rs-{uuid.uuid4().hex[:8]}"
    key = keys.shared_resources(keys.store_scope(server.url), resources_id)
    redis_client.set(key, b"{not json", ex=30)
    (store,) = _processes(server, redis_client, ttl_s=30.0, n=1)
    try:
        assert store.get_resources(resources_id) is not None
        assert server.reads == [resources_id]
    finally:
        store.close()
        redis_client.delete(key)
