"""A worker cut off from Redis (a partition of its host) sends no spans once its lease is no longer proven.

Other hosts may still reach Redis and take the attempt over, so spans flushed when the link returns would
put a second execution into the attempt (found by ``python -m bridge cluster --scenario partition``,
docs/cluster.md). Heartbeats may still go: they read the rollout before they write. Real ``HeartbeatMonitor``
and ``Lease`` against a Redis port that nothing listens on.
"""

from __future__ import annotations

import socket
import time

import redis

from bridge.core.store import StoreClient
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_spans_wait_for_a_renewal_while_redis_is_unreachable() -> None:
    client = redis.Redis(port=_closed_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    store = StoreClient("http://127.0.0.1:9", retries=0)
    monitor = HeartbeatMonitor(store, client)
    lease = Lease(client, "at-partitioned", 4.0)
    lease.valid_until = time.monotonic() + 3.0  # renewed a second ago, before the link went down
    watch = AttemptWatch("ro-partitioned", "at-partitioned", lease, None, interval_s=1.0, flush_interval_s=1.0)
    try:
        monitor.renew([watch])
        assert watch.lease_unknown and watch.stop_reason is None  # an outage does not stop the episode
        assert monitor.flush_budget(watch) is not None  # the lease is still proven: spans may go
        lease.valid_until = time.monotonic() + 0.5  # the last proof is running out
        assert monitor.flush_budget(watch) is None
        assert monitor.store_budget(watch) is not None  # a heartbeat reads the rollout first, so it may go
    finally:
        monitor.close()
        store.close()
