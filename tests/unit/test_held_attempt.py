"""``HeldAttempt`` with a watch the line built (0.3's Store-fenced watch, ``HeldAttempt.follow``) in place of the
protocol's own: the lease is renewed through that watch while it is registered, its stop reasons are the attempt's,
and ``release`` stops the renewals before it drops the lease for good; a duplicate's ``release_slot`` leaves the live
execution's slot counted.

Real Redis (this test process's database) and a real ``HeartbeatMonitor`` with its threads; no Store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import keys
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.held import HeldAttempt

pytestmark = pytest.mark.cost(4)

LEASE_TTL_S = 1.0
INTERVAL_S = 0.25


@pytest.fixture
def monitor(redis_client: redis.Redis) -> Iterator[HeartbeatMonitor]:
    monitor = HeartbeatMonitor(None, redis_client)
    yield monitor
    monitor.close()


@pytest.fixture
def attempt_id(redis_client: redis.Redis) -> Iterator[str]:
    aid = f"at-held-{uuid.uuid4().hex[:8]}"
    yield aid
    redis_client.delete(keys.lease(aid), keys.owner(aid), keys.started(aid), keys.done(aid))


def _held(client: redis.Redis, monitor: HeartbeatMonitor, aid: str) -> HeldAttempt:
    return HeldAttempt(client, monitor, aid, rollout_id=f"ro-{aid}", ttl_s=LEASE_TTL_S, interval_s=INTERVAL_S)


def _line_watch(held: HeldAttempt) -> AttemptWatch:
    """A watch as 0.3 builds it: Store-fenced, its own deadline, on the held attempt's lease."""
    return AttemptWatch(
        f"ro-{held.lease_id}",
        held.lease_id,
        held.lease,
        None,
        interval_s=INTERVAL_S,
        flush_interval_s=60.0,
        deadline=time.time() + 60,
    )


def test_a_watch_the_line_built_renews_the_lease_until_release(
    redis_client: redis.Redis, monitor: HeartbeatMonitor, attempt_id: str
) -> None:
    held = _held(redis_client, monitor, attempt_id)
    with pytest.raises(RuntimeError):
        held.follow(_line_watch(held))  # nothing held yet: nothing to renew
    claim = held.claim(60.0)
    assert claim.acquired and claim.first_start and claim.done_status is None
    assert monitor.watches() == [held.watch]  # the protocol's own watch, until the line's replaces it
    time.sleep(2 * LEASE_TTL_S)  # the line reads the Store before it runs (a fence read, its resources), slowly
    assert redis_client.get(keys.lease(attempt_id)) == held.lease.token and held.stop_reason is None
    with pytest.raises(ValueError):
        held.follow(_line_watch(_held(redis_client, monitor, attempt_id)))  # a watch on another Lease object
    watch = _line_watch(held)
    held.follow(watch)
    assert monitor.watches() == [watch] and held.watch is watch

    time.sleep(2 * LEASE_TTL_S)  # renewed by the monitor's lease thread through the line's watch
    assert redis_client.get(keys.lease(attempt_id)) == held.lease.token
    assert held.stop_reason is None

    redis_client.set(keys.owner(attempt_id), "99:another-executor", ex=60)  # taken over
    deadline = time.monotonic() + 5
    while held.stop_reason is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.stop_reason is not None and "lost the execution lease" in held.stop_reason
    assert watch.stop_reason == held.stop_reason and not held.shutdown

    redis_client.set(keys.owner(attempt_id), held.lease.token, ex=60)  # ours again, to see release drop it
    redis_client.set(keys.lease(attempt_id), held.lease.token, px=60_000)
    held.release()
    assert monitor.watches() == []
    assert redis_client.exists(keys.lease(attempt_id)) == 0
    assert redis_client.get(keys.owner(attempt_id)) == f"{held.lease.token}:released"  # a renewal cannot restore it


def test_follow_replaces_the_protocols_own_watch(
    redis_client: redis.Redis, monitor: HeartbeatMonitor, attempt_id: str
) -> None:
    held = _held(redis_client, monitor, attempt_id)
    own = held.watch
    assert held.claim(60.0).acquired
    assert monitor.watches() == [own]
    watch = _line_watch(held)
    held.follow(watch)
    assert monitor.watches() == [watch]
    held.release()
    assert monitor.watches() == []


def test_a_duplicates_slot_release_leaves_the_live_executions_slot_counted(
    redis_client: redis.Redis, monitor: HeartbeatMonitor, attempt_id: str
) -> None:
    scope, queue = f"held-{uuid.uuid4().hex[:6]}", "rollouts"
    inflight = keys.inflight(scope, queue)
    redis_client.zadd(inflight, {attempt_id: time.time()})
    live, duplicate = _held(redis_client, monitor, attempt_id), _held(redis_client, monitor, attempt_id)
    try:
        assert live.claim(60.0, renew=False).acquired
        assert not duplicate.claim(60.0).acquired
        duplicate.release()
        duplicate.release_slot(scope, queue, attempt_id)
        assert redis_client.zscore(inflight, attempt_id) is not None  # the live execution still runs in it
        assert redis_client.get(keys.lease(attempt_id)) == live.lease.token
        live.release()
        live.release_slot(scope, queue, attempt_id)
        assert redis_client.zscore(inflight, attempt_id) is None
    finally:
        redis_client.delete(inflight, keys.slot_freed(scope, queue))
