"""Execution leases in Redis: one executor per attempt, takeovers told apart from first starts, finished
attempts never leased again.

The tests use this test process's Redis (``tests/redis_for_tests.py``)."""

from __future__ import annotations

import uuid

import redis

from bridge.core.coordination import keys
from workers.protocol.lease import Claim, Lease, mark_done


def test_lease_admits_one_executor_and_survives_a_lost_key(redis_client: redis.Redis) -> None:
    attempt = f"at-{uuid.uuid4().hex[:8]}"
    mine, theirs = Lease(redis_client, attempt, 5), Lease(redis_client, attempt, 5)
    try:
        assert mine.claim(60).acquired
        assert not theirs.claim(60).acquired
        assert 0 < theirs.remaining_s() <= 5
        redis_client.delete(mine.key)  # Redis restarted without persistence: the live executor takes it back
        assert mine.renew()
        assert not theirs.renew()  # someone else's lease is never taken over by a renewal
        mine.release()
        assert theirs.claim(60).acquired
        theirs.release()
    finally:
        redis_client.delete(keys.lease(attempt), keys.started(attempt), keys.owner(attempt))


def test_claim_tells_first_starts_takeovers_held_and_finished_attempts(redis_client: redis.Redis) -> None:
    attempt = f"at-claim-{uuid.uuid4().hex[:8]}"
    try:
        first = Lease(redis_client, attempt, 5)
        assert first.claim(60) == Claim(True, first_start=True)
        assert Lease(redis_client, attempt, 5).claim(60) == Claim(False)  # held: a duplicate delivery
        first.release()
        takeover = Lease(redis_client, attempt, 5)
        assert takeover.claim(60) == Claim(True, first_start=False)  # started before: read the Store first
        takeover.release()
        mark_done(redis_client, attempt, "succeeded", 60)
        assert Lease(redis_client, attempt, 5).claim(60) == Claim(False, done_status="succeeded")
        assert redis_client.exists(keys.lease(attempt)) == 0  # a finished attempt is not leased again
    finally:
        redis_client.delete(keys.lease(attempt), keys.started(attempt), keys.done(attempt), keys.owner(attempt))


def test_a_claim_after_an_agent_began_says_so_and_a_taken_over_executor_cannot_begin(redis_client: redis.Redis) -> None:
    """``mark_ran`` under the live lease makes every later claim a ``ran_before`` one (never run again in place); an
    executor whose lease lapsed and was claimed by another cannot mark it, so its agent never begins."""
    attempt = f"at-ran-{uuid.uuid4().hex[:8]}"
    try:
        first = Lease(redis_client, attempt, 5)
        assert first.claim(60) == Claim(True, first_start=True, ran_before=False)
        assert first.mark_ran()
        redis_client.delete(first.key)  # its lease lapsed (a stalled process) while its agent's writes may be in flight
        takeover = Lease(redis_client, attempt, 5)
        assert takeover.claim(60) == Claim(True, first_start=False, ran_before=True)
        assert not first.mark_ran()  # the stalled one wakes: not its lease any more
        takeover.release()

        unmarked = f"at-ran-{uuid.uuid4().hex[:8]}"
        slow = Lease(redis_client, unmarked, 5)
        assert slow.claim(60).acquired
        redis_client.delete(slow.key)  # lapsed before its agent began
        other = Lease(redis_client, unmarked, 5)
        assert other.claim(60) == Claim(True, first_start=False, ran_before=False)  # nothing of it ran: run it
        assert not slow.mark_ran()
        assert redis_client.exists(keys.ran(unmarked)) == 0
        other.release()
    finally:
        for key in redis_client.scan_iter("agl:*at-ran-*"):
            redis_client.delete(key)
