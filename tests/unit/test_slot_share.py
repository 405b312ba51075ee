"""Fair sharing of one pool between the 0.3 bridge and the 1.0 dispatcher (``bridge.core.coordination.slot_share``): the
split rule as a pure function, a simulated backlog of both lines through it, and the Redis exchange (real Redis)."""

from __future__ import annotations

import heapq
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from bridge.core.coordination import capacity, keys, slot_share
from bridge.core.coordination.slot_share import V03, V1, allowance, entitlements

EQUAL = {V03: 1.0, V1: 1.0}


def test_the_split_is_weighted_max_min_fair() -> None:
    assert entitlements(4, {V03: 10, V1: 10}, EQUAL) == {V03: 2.0, V1: 2.0}
    assert entitlements(8, {V03: 10, V1: 10}, {V03: 1.0, V1: 3.0}) == {V03: 2.0, V1: 6.0}
    assert entitlements(8, {V03: 1, V1: 10}, EQUAL) == {V03: 1.0, V1: 7.0}  # what one leaves, the other gets
    assert entitlements(8, {V03: 0, V1: 3}, EQUAL) == {V03: 0.0, V1: 3.0}
    assert entitlements(0, {V03: 5, V1: 5}, EQUAL) == {V03: 0.0, V1: 0.0}


def test_a_line_alone_may_use_every_free_slot() -> None:
    # The 1.0 line wants nothing: it has none waiting and only its in-flight attempts (even above its share).
    for v1_inflight in (0, 1, 3):
        room = 4 - v1_inflight
        got = allowance(V03, total=4, room=room, inflight={V1: v1_inflight}, waiting={}, weights=EQUAL)
        assert got == room


def test_a_line_above_its_share_leaves_freed_slots_to_the_line_below_it() -> None:
    inflight, waiting = {V03: 3, V1: 0}, {V03: 20, V1: 20}  # the 0.3 line filled the pool before 1.0 work arrived
    assert allowance(V03, total=4, room=1, inflight=inflight, waiting=waiting, weights=EQUAL) == 0
    assert allowance(V1, total=4, room=1, inflight=inflight, waiting=waiting, weights=EQUAL) == 1
    assert allowance(V1, total=4, room=0, inflight={V03: 4}, waiting=waiting, weights=EQUAL) == 0  # never beyond room


def _simulate(
    claim: Callable[[str, int, dict[str, int]], int], slots: int = 4, episode: float = 1.0
) -> dict[str, float]:
    """Both lines backlogged without end on ``slots`` slots; every freed slot is offered to the 0.3 line first
    (its loop wakes on the freed-slot signal), then to the 1.0 line. Returns each line's slot-seconds."""
    inflight = {V03: 0, V1: 0}
    running: list[tuple[float, str]] = []
    used = {V03: 0.0, V1: 0.0}
    now = 0.0
    while now < 200 * episode:
        for line in (V03, V1):
            room = slots - sum(inflight.values())
            for _ in range(max(0, min(room, claim(line, room, inflight)))):
                inflight[line] += 1
                heapq.heappush(running, (now + episode * (1.1 if line == V1 else 1.0), line))
                used[line] += episode * (1.1 if line == V1 else 1.0)
        now, line = heapq.heappop(running)
        inflight[line] -= 1
    return used


@pytest.mark.parametrize("weights", [EQUAL, {V03: 1.0, V1: 3.0}, {V03: 2.0, V1: 1.0}])
def test_both_lines_backlogged_get_slot_seconds_in_proportion_to_their_weights(weights: dict[str, float]) -> None:
    waiting = {V03: 100, V1: 100}
    used = _simulate(
        lambda line, room, inflight: allowance(
            line, total=4, room=room, inflight=inflight, waiting=waiting, weights=weights
        )
    )
    for line in (V03, V1):
        share, target = used[line] / sum(used.values()), weights[line] / sum(weights.values())
        assert abs(share - target) <= 0.25 * target, (line, share, target)


def test_without_the_share_the_line_that_claims_first_starves_the_other() -> None:
    used = _simulate(lambda line, room, inflight: room)  # what both dispatchers did: claim every free slot
    assert used[V1] == 0


def test_the_exchange_counts_in_flight_attempts_by_line_and_publishes_demand(redis_client: redis.Redis) -> None:
    scope, queue = f"share-{uuid.uuid4().hex[:8]}", "rollouts"
    for attempt in ("at-1", "at-2", "v1-r1-0", "v1-r2-0", "v1-r3-1"):
        capacity.mark_inflight(redis_client, scope, queue, attempt)
    try:
        slot_share.exchange(redis_client, scope, queue, V1, 7, 3.0)
        reading = slot_share.exchange(redis_client, scope, queue, V03, 2, 1.0)
        assert reading.inflight == {V03: 2, V1: 3}
        assert reading.waiting == {V03: 2, V1: 7} and reading.weights == {V03: 1.0, V1: 3.0}
        assert 0 < redis_client.ttl(keys.slot_demand(scope, queue, V1)) <= slot_share.DEMAND_TTL_S
        # 8 slots, v1 weighs 3 and wants 10: the 0.3 line may hold 2 and already does.
        got = slot_share.claimable(
            redis_client, scope, queue, V03, total=8, room=3, waiting=2, weights={V03: 1.0, V1: 1.0}
        )
        assert got == 0  # the 1.0 line's own weight counts, whatever this dispatcher's settings say of it
        redis_client.delete(keys.slot_demand(scope, queue, V1))  # the 1.0 leader stopped: its demand lapsed
        assert slot_share.claimable(redis_client, scope, queue, V03, total=8, room=3, waiting=2, weights=EQUAL) == 3
    finally:
        redis_client.delete(keys.inflight(scope, queue), *(keys.slot_demand(scope, queue, line) for line in (V03, V1)))


def test_a_line_ahead_in_slot_seconds_leaves_freed_slots_to_the_other_until_it_caught_up() -> None:
    waiting = {V03: 10, V1: 10}
    level = {V03: 2, V1: 2}  # max-min alone would split a freed slot by the count in flight
    ahead = {V03: 12.0, V1: 0.0}  # the 0.3 line held every slot for one 3 s episode before 1.0 work arrived
    for line, want in ((V03, 0), (V1, 1)):
        got = allowance(line, total=4, room=1, inflight=level, waiting=waiting, weights=EQUAL, usage=ahead, episode_s=3)
        assert got == want, line
    # Two slots free: each goes in turn to the lower projected usage (usage + one episode per attempt running).
    even = {V03: 6.0, V1: 6.0}
    split = [
        allowance(line, total=4, room=2, inflight=level, waiting=waiting, weights=EQUAL, usage=even, episode_s=3)
        for line in (V03, V1)
    ]
    assert split == [1, 1]
    # Work-conserving: the line behind gets no more than it has waiting, the rest goes to the other.
    got = allowance(V03, total=4, room=3, inflight={V03: 1}, waiting={V1: 1}, weights=EQUAL, usage=ahead, episode_s=3)
    assert got == 2


def _contended_run(use_usage: bool, episode: float = 3.0, slots: int = 4, rounds: int = 4) -> dict[str, float]:
    """The 0.3 line fills every slot, then both lines stay backlogged for ``rounds`` episodes; freed slots are
    offered to the 0.3 line first. Usage integrates each line's slot-seconds as ``slot_share._READ`` does."""
    inflight = {V03: slots, V1: 0}
    running = [(episode, V03) for _ in range(slots)]
    used = {V03: 0.0, V1: 0.0}
    waiting = {V03: 100, V1: 100}
    now = 0.0
    while running[0][0] <= rounds * episode:
        at, line = heapq.heappop(running)
        for other in (V03, V1):
            used[other] += inflight[other] * (at - now)
        now = at
        inflight[line] -= 1
        for claimer in (V03, V1):
            room = slots - sum(inflight.values())
            got = allowance(
                claimer,
                total=slots,
                room=room,
                inflight=inflight,
                waiting=waiting,
                weights=EQUAL,
                usage=dict(used) if use_usage else None,
                episode_s=episode,
            )
            for _ in range(min(room, got)):
                inflight[claimer] += 1
                heapq.heappush(running, (now + episode, claimer))
    return used


def test_a_head_start_is_paid_back_in_slot_seconds() -> None:
    without = _contended_run(use_usage=False)
    assert without[V1] / sum(without.values()) < 0.4  # max-min on the count in flight keeps the head start
    with_usage = _contended_run(use_usage=True)
    assert abs(with_usage[V1] / sum(with_usage.values()) - 0.5) <= 0.05, with_usage


def test_every_line_hears_every_freed_slot(redis_client: redis.Redis) -> None:
    scope, queue = f"wake-{uuid.uuid4().hex[:8]}", "rollouts"
    try:
        capacity.notify_freed(redis_client, scope, queue)
        assert capacity.wait_for_freed(redis_client, scope, [queue], 1.0, V03) is True
        assert capacity.wait_for_freed(redis_client, scope, [queue], 1.0, V1) is True  # the 0.3 wake took nothing
        assert capacity.wait_for_freed(redis_client, scope, [queue], 0.1, V1) is False
    finally:
        redis_client.delete(*(keys.slot_freed(scope, queue, line) for line in (V03, V1)))


def test_the_exchange_integrates_slot_seconds_while_both_lines_wait(redis_client: redis.Redis) -> None:
    scope, queue = f"usage-{uuid.uuid4().hex[:8]}", "rollouts"
    for attempt in ("at-1", "at-2", "at-3", "v1-r1-0"):
        capacity.mark_inflight(redis_client, scope, queue, attempt)
    try:
        first = slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0)
        assert first.usage == {V03: 0.0, V1: 0.0}  # the 1.0 line published no demand: nothing contended
        slot_share.exchange(redis_client, scope, queue, V1, 5, 1.0)
        time.sleep(0.5)
        reading = slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0)
        assert 3 * 0.4 <= reading.usage[V03] <= 3 * 1.5 and 0.4 <= reading.usage[V1] <= 1.5, reading.usage
        assert reading.inflight == {V03: 3, V1: 1}
    finally:
        redis_client.delete(
            keys.inflight(scope, queue),
            keys.slot_usage(scope, queue),
            *(keys.slot_demand(scope, queue, line) for line in (V03, V1)),
        )


def test_an_idle_queue_forgets_the_lines_usage_but_a_gap_between_rounds_does_not(redis_client: redis.Redis) -> None:
    scope, queue = f"usage-{uuid.uuid4().hex[:8]}", "rollouts"
    capacity.mark_inflight(redis_client, scope, queue, "v1-r1-0")
    try:
        slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0)
        slot_share.exchange(redis_client, scope, queue, V1, 5, 1.0)
        time.sleep(0.3)
        ahead = slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0).usage[V1]
        assert ahead > 0
        capacity.clear_inflight(redis_client, scope, queue, "v1-r1-0")
        # Every episode of a round ended at once and both lines still wait: the 1.0 line stays ahead.
        between = slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0).usage
        assert between[V03] == 0.0 and ahead * 0.99 <= between[V1] <= ahead, between
        # The 1.0 line has nothing more waiting and nothing runs: the queue is idle, the contest over.
        slot_share.exchange(redis_client, scope, queue, V1, 0, 1.0)
        assert slot_share.exchange(redis_client, scope, queue, V03, 5, 1.0).usage == {V03: 0.0, V1: 0.0}
    finally:
        redis_client.delete(
            keys.inflight(scope, queue),
            keys.slot_usage(scope, queue),
            *(keys.slot_demand(scope, queue, line) for line in (V03, V1)),
        )
