"""The desired slots of a queue that both dispatch lines share (``bridge.core.coordination.line_demand``): in flight
once, each line's backlog once, on this test's Redis database. Two leaders of different lines each see the other's
backlog and so export the same whole figure; a line that stops writing stops counting."""

from __future__ import annotations

import uuid

import redis

from bridge.core.coordination import keys, line_demand
from bridge.core.coordination.slot_share import V03, V1


def test_desired_is_in_flight_once_plus_each_lines_backlog() -> None:
    assert line_demand.desired_slots(4, 5, {V1: 2}) == 11
    assert line_demand.desired_slots(4, 5, {}) == 9  # the other line stopped, or never ran
    assert line_demand.desired_slots(0, 0, {V1: 0}) == 0
    assert line_demand.desired_slots(-1, -2, {V1: -3}) == 0  # nothing negative counts


def test_a_published_backlog_is_read_only_when_it_is_a_count() -> None:
    assert line_demand.parse_backlog("7") == 7 and line_demand.parse_backlog("0") == 0
    for garbage in ("", "-1", "7 1", "x", None):
        assert line_demand.parse_backlog(garbage) is None


def test_two_leaders_of_different_lines_export_the_same_whole_figure(redis_client: redis.Redis) -> None:
    scope = f"ld-{uuid.uuid4().hex[:8]}"
    in_flight = 4  # both read the one in-flight set of the queue
    v03 = line_demand.BacklogExchange(redis_client, scope, V03)
    v1 = line_demand.BacklogExchange(redis_client, scope, V1)
    assert v03.others({"rollouts": 5, "rollouts-val": 1}) == {}  # the 1.0 line has published nothing yet
    seen_by_v1 = v1.others({"rollouts": 2})
    seen_by_v03 = v03.others({"rollouts": 5, "rollouts-val": 1})
    assert seen_by_v1 == {"rollouts": {V03: 5}} and seen_by_v03 == {"rollouts": {V1: 2}}
    assert line_demand.desired_slots(in_flight, 2, seen_by_v1["rollouts"]) == 11
    assert line_demand.desired_slots(in_flight, 5, seen_by_v03["rollouts"]) == 11
    key = keys.line_backlog(scope, "rollouts", V1)
    assert 0 < redis_client.ttl(key) <= line_demand.BACKLOG_TTL_S  # a stopped line's backlog expires on its own
    redis_client.delete(key)  # as it does after BACKLOG_TTL_S
    assert v03.others({"rollouts": 5}) == {}
    redis_client.set(key, "not a count")
    assert v03.others({"rollouts": 5}) == {}
    redis_client.delete(*redis_client.keys(f"*{scope}*"))


def test_a_redis_failure_keeps_the_last_exchange(redis_client: redis.Redis) -> None:
    scope = f"ld-{uuid.uuid4().hex[:8]}"
    line_demand.exchange(redis_client, scope, V1, {"rollouts": 3})
    v03 = line_demand.BacklogExchange(redis_client, scope, V03)
    assert v03.others({"rollouts": 1}) == {"rollouts": {V1: 3}}
    v03.client = redis.Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.5)  # nothing listens there
    assert v03.others({"rollouts": 1}) == {"rollouts": {V1: 3}}
    v03.forget()
    assert v03.others({"rollouts": 1}) == {}
    redis_client.delete(*redis_client.keys(f"*{scope}*"))
