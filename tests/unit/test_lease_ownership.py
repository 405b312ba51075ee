"""Lease ownership outlives the lease: an executor that was taken over can never take its attempt back, a
reported attempt is renewed by nobody, Redis data loss is repaired by the live owner's next renewal (started
marker included), and only an executor that holds an attempt frees its in-flight slot.

Real Redis (this test process's, ``tests/redis_for_tests.py``), real expiry.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import capacity, keys, markers
from workers.protocol.lease import Lease, Renewal, free_slot, mark_done, renew_all

TTL_S = 0.3  # short, so the tests watch a real expiry
SCOPE = keys.store_scope("http://store.test:4747")  # the deployment whose in-flight set the slot is in


@pytest.fixture
def attempt(redis_client: redis.Redis) -> Iterator[str]:
    aid = f"at-own-{uuid.uuid4().hex[:8]}"
    yield aid
    redis_client.delete(
        keys.lease(aid), keys.owner(aid), keys.started(aid), keys.done(aid), keys.inflight(SCOPE, "q-own")
    )


def _expire(lease: Lease) -> None:
    """Wait out the lease's TTL: its holder stalled (GC pause, hung Store call, stopped VM)."""
    time.sleep(lease.ttl_s + 0.1)


def test_a_holder_whose_lease_expired_cannot_take_the_attempt_back(redis_client: redis.Redis, attempt: str) -> None:
    a, b = Lease(redis_client, attempt, TTL_S), Lease(redis_client, attempt, 5)
    assert a.claim(60).acquired
    _expire(a)
    claim = b.claim(60)
    assert claim.acquired and not claim.first_start  # a takeover
    assert not a.renew()  # A learns at its next renewal that the attempt is not its own
    assert a.valid_until == 0.0
    assert b.renew()
    b.release()  # B stopped (e.g. the fence withheld its report): the lease key is gone, B still owns it
    assert redis_client.exists(keys.lease(attempt)) == 0
    assert not a.renew()  # an unconditional renewal would re-create the key and let A write again
    assert redis_client.exists(keys.lease(attempt)) == 0
    a.release()  # and A's release touches nothing of B's


def test_a_renewal_in_flight_when_the_holder_releases_does_not_bring_the_lease_back(
    redis_client: redis.Redis, attempt: str
) -> None:
    """The heartbeat renews from a snapshot of its watches: a renewal sent just after the attempt released its lease
    restored it (as after Redis data loss), and the Celery retry of that very attempt found it held for a TTL."""
    a = Lease(redis_client, attempt, 5)
    assert a.claim(60).acquired
    a.release()
    assert renew_all(redis_client, [a]) == [Renewal.LOST]
    assert redis_client.exists(keys.lease(attempt)) == 0
    retry = Lease(redis_client, attempt, 5).claim(60)
    assert retry.acquired and not retry.first_start  # the next delivery takes it at once, one epoch higher
    assert not a.renew()


def test_after_the_done_marker_no_renewal_succeeds(redis_client: redis.Redis, attempt: str) -> None:
    a, b = Lease(redis_client, attempt, TTL_S), Lease(redis_client, attempt, 5)
    assert a.claim(60).acquired
    _expire(a)
    assert b.claim(60).acquired
    mark_done(redis_client, attempt, "succeeded", 60)  # B reported
    assert not b.renew()
    assert not a.renew()
    b.release()
    assert not a.renew()
    assert renew_all(redis_client, [a, b]) == [Renewal.DONE, Renewal.DONE]
    assert redis_client.exists(keys.lease(attempt)) == 0
    assert Lease(redis_client, attempt, 5).claim(60).done_status == "succeeded"


def test_a_renewal_after_redis_data_loss_restores_lease_owner_and_started_marker(
    redis_client: redis.Redis, attempt: str
) -> None:
    lease = Lease(redis_client, attempt, 5)
    assert lease.claim(60).first_start
    redis_client.delete(keys.lease(attempt), keys.owner(attempt), keys.started(attempt))  # FLUSHDB, for this attempt
    assert markers.read_markers(redis_client, [attempt])[attempt] == markers.LeaseMarkers(False, False, None)
    assert lease.renew()
    # The bridge's reconcile reads these two: without the started marker a live `running` attempt that lost its
    # in-flight entry too would look like one the bridge never published.
    assert markers.read_markers(redis_client, [attempt])[attempt] == markers.LeaseMarkers(True, True, None)
    assert 50 < int(redis_client.ttl(keys.started(attempt))) <= 60
    assert redis_client.get(keys.owner(attempt)) == lease.token


def test_after_data_loss_the_later_claim_wins_whoever_renews_first(redis_client: redis.Redis, attempt: str) -> None:
    stale, live = Lease(redis_client, attempt, TTL_S), Lease(redis_client, attempt, 5)
    assert stale.claim(60).acquired
    _expire(stale)
    assert live.claim(60).acquired
    redis_client.delete(keys.lease(attempt), keys.owner(attempt), keys.started(attempt))
    assert stale.renew()  # nothing left in Redis tells it otherwise ...
    assert live.renew()  # ... until the later claim renews: its epoch is higher
    assert not stale.renew()
    assert live.renew()


def test_only_an_executor_that_holds_the_attempt_frees_its_slot(redis_client: redis.Redis, attempt: str) -> None:
    queue = "q-own"
    capacity.mark_inflight(redis_client, SCOPE, queue, attempt)
    stale, live = Lease(redis_client, attempt, TTL_S), Lease(redis_client, attempt, 5)
    assert stale.claim(60).acquired
    _expire(stale)
    assert live.claim(60).acquired
    assert not free_slot(redis_client, SCOPE, queue, attempt)  # a duplicate delivery that never held it
    assert not free_slot(redis_client, SCOPE, queue, attempt, stale.token)  # the executor that was taken over
    assert capacity.inflight_ids(redis_client, SCOPE, queue) == {attempt}
    assert free_slot(redis_client, SCOPE, queue, attempt, live.token)  # the live executor, even before its release
    capacity.mark_inflight(redis_client, SCOPE, queue, attempt)
    live.release()
    assert free_slot(redis_client, SCOPE, queue, attempt)  # nobody holds it any more (e.g. the executor died)
    assert capacity.inflight_ids(redis_client, SCOPE, queue) == set()
