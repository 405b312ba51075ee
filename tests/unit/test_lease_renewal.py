"""The heartbeat's lease renewals do not wait for the Store: with a Store that answers slowly, every lease of
a process with many attempts stays alive, and an attempt that is no longer ours gets no Store call at all.

Real Redis (this test process's, ``tests/redis_for_tests.py``), real ``StoreClient`` and ``HeartbeatMonitor``; the Store
is a local HTTP endpoint that answers after a delay, as a Store does under load.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.store import StoreClient
from tests.loopback import RecordingStore
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease, mark_done

ATTEMPTS = 40
LEASE_TTL_S = 2.0
INTERVAL_S = 0.5  # heartbeat interval: a fence read per attempt every half second
STORE_DELAY_S = 1.5  # every Store answer takes this long: one round over 40 attempts would take a minute


@pytest.fixture
def slow_store() -> Iterator[RecordingStore]:
    server = RecordingStore(delay_s=STORE_DELAY_S)
    yield server
    server.close()


def _watch(lease: Lease) -> AttemptWatch:
    return AttemptWatch(f"ro-{lease.lease_id}", lease.lease_id, lease, None, interval_s=INTERVAL_S, flush_interval_s=60)


def test_many_leases_stay_alive_while_the_store_is_slow(redis_client: redis.Redis, slow_store: RecordingStore) -> None:
    run = uuid.uuid4().hex[:6]
    leases = [Lease(redis_client, f"at-slow-{run}-{i}", LEASE_TTL_S) for i in range(ATTEMPTS)]
    store = StoreClient(slow_store.url, retries=0)
    monitor = HeartbeatMonitor(store, redis_client)
    lapses: set[str] = set()
    try:
        for lease in leases:
            assert lease.claim(60).acquired
        watches = [_watch(lease) for lease in leases]
        for watch in watches:
            monitor.watch(watch)
        end = time.monotonic() + 3 * LEASE_TTL_S
        while time.monotonic() < end:
            pipe = redis_client.pipeline(transaction=False)
            for lease in leases:
                pipe.get(lease.key)
            for lease, holder in zip(leases, pipe.execute(), strict=True):
                if holder != lease.token:
                    lapses.add(lease.lease_id)
            time.sleep(0.1)
        assert len(slow_store.paths) >= 2  # the Store was really called, slowly
        assert not lapses, f"{len(lapses)} of {ATTEMPTS} leases lapsed while the Store was slow"
        assert [w.stop_reason for w in watches if w.stop_reason] == []
    finally:
        monitor.close()
        store.close()
        for lease in leases:
            aid = lease.lease_id
            redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid))


def test_an_attempt_reported_by_another_executor_stops_without_a_store_call(
    redis_client: redis.Redis, slow_store: RecordingStore
) -> None:
    aid = f"at-stale-{uuid.uuid4().hex[:6]}"
    stale, taker = Lease(redis_client, aid, 0.3), Lease(redis_client, aid, 5)
    store = StoreClient(slow_store.url, retries=0)
    monitor = HeartbeatMonitor(store, redis_client)
    try:
        assert stale.claim(60).acquired
        time.sleep(0.4)  # the stale executor stalled past its lease ...
        assert taker.claim(60).acquired  # ... a redelivery took over, ran and reported the attempt
        mark_done(redis_client, aid, "succeeded", 60)
        taker.release()
        watch = _watch(stale)
        watch.next_beat = time.monotonic()  # a beat is due at once
        monitor.watch(watch)
        deadline = time.monotonic() + 3.0
        while watch.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert watch.stop_reason is not None and "reported" in watch.stop_reason
        assert slow_store.paths == []  # no fence read, no heartbeat: nothing touched the taken-over attempt
        assert redis_client.exists(keys.lease(aid)) == 0  # and the lease was not re-created
        assert watch.lease.valid_until == 0.0
    finally:
        monitor.close()
        store.close()
        redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid), keys.done(aid))


def test_the_lease_thread_repairs_redis_data_loss_within_one_interval(
    redis_client: redis.Redis, slow_store: RecordingStore
) -> None:
    aid = f"at-loss-{uuid.uuid4().hex[:6]}"
    lease = Lease(redis_client, aid, 5)
    store = StoreClient(slow_store.url, retries=0)
    monitor = HeartbeatMonitor(store, redis_client)
    try:
        assert lease.claim(60).acquired
        watch = _watch(lease)
        monitor.watch(watch)
        redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid))  # FLUSHDB, for this attempt
        time.sleep(INTERVAL_S + 0.3)
        # The bridge's reconcile looks at both: a started attempt without a lease is an orphan, a leased one is live.
        assert redis_client.get(keys.lease(aid)) == lease.token
        assert redis_client.exists(keys.started(aid), keys.owner(aid)) == 2
        assert watch.stop_reason is None
    finally:
        monitor.close()
        store.close()
        redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid))
