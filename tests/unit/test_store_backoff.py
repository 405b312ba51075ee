"""The heartbeat thread gives a failing Store room (``workers.protocol.heartbeat.StoreBackoff``).

A Store that was stopped or starved comes back with every request it queued meanwhile still to answer. Before, each
worker process re-sent its fence read (and each attempt its span batch) every interval, 1 s under the chaos
settings, whatever the last one did: in the chaos suite's 15 s Store outage on a loaded machine the fence reads kept
failing 40 s after the Store came back, and the watchdog marked 31 attempts unresponsive. Now the thread waits after
a failure, longer after each (to ``STORE_BACKOFF_CAP_S``), and at once after a success.

Real ``HeartbeatMonitor``, ``Lease`` (this test process's Redis) and HTTP client; the Store is a loopback server that
answers 503.
"""

from __future__ import annotations

import math
import time
import uuid

import redis

from bridge.core.coordination import keys
from bridge.core.store import StoreClient
from tests.loopback import RecordingStore
from workers.protocol import heartbeat
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor, StoreBackoff
from workers.protocol.lease import Lease


def test_a_store_that_fails_is_read_less_and_less_often_not_every_interval(redis_client: redis.Redis) -> None:
    store = RecordingStore()
    client = StoreClient(store.url, retries=0, timeout_s=2)
    monitor = HeartbeatMonitor(client, redis_client)
    aid = f"at-{uuid.uuid4().hex[:8]}"
    lease = Lease(redis_client, aid, 10.0)
    try:
        assert lease.claim(60).acquired
        watch = AttemptWatch("ro-backoff", aid, lease, None, interval_s=0.25, flush_interval_s=math.inf)
        monitor.watch(watch)
        time.sleep(6.0)
        reads = sum("/rollouts" in path for path in store.paths)
        # One read per interval would be about 24; waits of 0.5, 1, 2, 4, 4 s (their upper bounds) allow 6 or 7.
        assert 2 <= reads <= 10, reads
        assert monitor.store_backoff.failures >= 2
        assert watch.stop_reason is None  # the episode goes on through the outage
    finally:
        monitor.close()
        client.close()
        store.close()
        redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid))


def test_the_wait_doubles_to_its_cap_and_a_success_ends_it() -> None:
    backoff = StoreBackoff()
    assert not backoff.waiting()
    waits = []
    for _ in range(8):
        before = time.monotonic()
        backoff.failed()
        waits.append(backoff.until - before)
    assert all(w <= heartbeat.STORE_BACKOFF_CAP_S + 0.01 for w in waits), waits
    assert waits[0] <= heartbeat.STORE_BACKOFF_BASE_S and waits[-1] >= heartbeat.STORE_BACKOFF_CAP_S / 2, waits
    assert backoff.waiting()
    backoff.succeeded()
    assert not backoff.waiting() and backoff.failures == 0
