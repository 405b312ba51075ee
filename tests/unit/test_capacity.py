"""Dispatch capacity: a worker's slot-freed wake-up ends the full bridge's wait at once
(``bridge.core.coordination.capacity.notify_freed``/``wait_for_freed``), and without one the wait ends at its bound.

Uses this test process's Redis (``tests/redis_for_tests.py``)."""

from __future__ import annotations

import uuid

import redis

from bridge.core.coordination import capacity, keys

SCOPE = keys.store_scope("http://store.test:4747")  # the deployment these keys belong to


def test_a_freed_slot_wakes_the_waiting_bridge(redis_client: redis.Redis) -> None:
    queue = f"test-wakeup-{uuid.uuid4().hex[:8]}"
    try:
        assert capacity.wait_for_freed(redis_client, SCOPE, [queue], 0.1) is False  # nothing freed: the bound ends it
        capacity.notify_freed(redis_client, SCOPE, queue)
        capacity.notify_freed(redis_client, SCOPE, queue)
        assert capacity.wait_for_freed(redis_client, SCOPE, [queue], 5.0) is True
        assert redis_client.exists(keys.slot_freed(SCOPE, queue)) == 0  # a burst of wake-ups is consumed at once
        assert capacity.wait_for_freed(redis_client, SCOPE, [queue], 0.1) is False
    finally:
        redis_client.delete(keys.slot_freed(SCOPE, queue))
