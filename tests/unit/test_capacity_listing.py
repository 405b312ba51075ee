"""How the bridge finds the workers' slot adverts (``bridge.core.coordination.capacity``): through each queue's node
listing, never by walking the keyspace, which long runs fill with per-attempt markers (a SCAN per tick cost
0.2 ms with an empty Redis and 780 ms with a million keys, docs/performance.md). The slot keys still decide
who is alive. Real Redis: this test process's (``tests/redis_for_tests.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bridge.core.coordination import capacity, keys
from tests.helpers import drop_adverts

SCOPE = keys.store_scope("http://store.test:4747")  # the deployment these keys belong to


class NoKeyspaceWalk(redis.Redis):
    """A client that fails the test if anything scans or lists the keyspace."""

    def scan(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("walked the keyspace (SCAN)")

    def keys(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("walked the keyspace (KEYS)")


@pytest.fixture
def queue(redis_client: redis.Redis) -> Iterator[str]:
    name = f"rollouts-{uuid.uuid4().hex[:8]}"
    yield name
    drop_adverts(redis_client, SCOPE, name)
    redis_client.delete(keys.inflight(SCOPE, name))


def test_slots_and_in_flight_are_read_without_walking_the_keyspace(redis_client: redis.Redis, queue: str) -> None:
    other = f"other-{uuid.uuid4().hex[:8]}"
    markers = [keys.done(f"attempt-{uuid.uuid4().hex}") for _ in range(2_000)]
    redis_client.mset(dict.fromkeys(markers, "succeeded"))
    try:
        capacity.advertise(redis_client, SCOPE, "a@host", [queue], 8)
        capacity.advertise(redis_client, SCOPE, "b@host", [queue, other], 4)
        capacity.mark_inflight(redis_client, SCOPE, queue, "attempt-1")
        client = NoKeyspaceWalk(connection_pool=redis_client.connection_pool)
        view = capacity.read_slots(client, SCOPE, [queue])
        assert view.nodes == {"a@host": (8, frozenset({queue})), "b@host": (4, frozenset({queue}))}
        assert view.inflight == {queue: 1} and view.rooms() == {queue: 11}
        assert capacity.total_slots(client, SCOPE, queue) == 12 and capacity.total_slots(client, SCOPE, other) == 4
    finally:
        redis_client.delete(*markers)
        capacity.withdraw(redis_client, SCOPE, "b@host", [other])


def test_a_node_whose_slot_key_expired_is_not_counted_and_a_withdrawn_one_is_unlisted(
    redis_client: redis.Redis, queue: str
) -> None:
    capacity.advertise(redis_client, SCOPE, "a@host", [queue], 8)
    capacity.advertise(redis_client, SCOPE, "b@host", [queue], 4)
    redis_client.delete(keys.capacity(SCOPE, queue, "a@host"))  # as when a dead node's key expires
    assert capacity.read_slots(redis_client, SCOPE, [queue]).nodes == {"b@host": (4, frozenset({queue}))}
    capacity.withdraw(redis_client, SCOPE, "b@host", [queue])
    assert redis_client.zrange(keys.capacity_nodes(SCOPE, queue), 0, -1) == ["a@host"]
    assert capacity.read_slots(redis_client, SCOPE, [queue]).nodes == {}
    capacity.advertise(redis_client, SCOPE, "a@host", [queue], 8)  # back: its next advertisement counts again
    assert capacity.total_slots(redis_client, SCOPE, queue) == 8


def test_nodes_silent_for_the_listing_period_are_dropped_at_the_next_advertisement(
    redis_client: redis.Redis, queue: str
) -> None:
    long_gone = time.time() - capacity.NODE_LISTING_S - 1
    redis_client.zadd(keys.capacity_nodes(SCOPE, queue), {"gone@host": long_gone, "recent@host": time.time() - 60})
    capacity.advertise(redis_client, SCOPE, "a@host", [queue], 2)
    listed = set(redis_client.zrange(keys.capacity_nodes(SCOPE, queue), 0, -1))
    assert listed == {"recent@host", "a@host"}  # skewed clocks or a pause below the period keep a node listed
    assert 0 < redis_client.ttl(keys.capacity_nodes(SCOPE, queue)) <= capacity.NODE_LISTING_S
