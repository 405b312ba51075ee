"""The one dispatcher's behaviour (``bridge.dispatch.dispatcher``), each test run against both lines: a 0.3 line
(``V03Dispatcher`` with a Store and a publisher as plain objects) and a 1.0 line (``V1Dispatcher`` with a fake gateway
behind the real ``GatewayClient`` and a fake Celery app), on this test's Redis database.

What each test proves, for either line: a standby publishes nothing; a new leader reconciles at once; an error a tick
lets out is counted by kind, the loop backs off (Redis, the line's upstream) or pauses (a bug) and a reconcile is due
by then; a scan schedules the next after ``BRIDGE_RECONCILE_INTERVAL_S`` and the earliest request wins; the line
starts no more than its share of the slots while the other line waits; a refused publish leaves no in-flight entry;
every freed slot wakes the line on its own list; shutdown releases the lock.
"""

from __future__ import annotations

import time

import pytest
import redis

from bridge.core.coordination import capacity, keys, slot_share
from bridge.dispatch import metrics
from bridge.dispatch.leader import STANDBY_RETRY_S
from tests.fakes.lines import QUEUE, SLOTS, Line
from tests.helpers import line_of


def _slots_free(line: Line) -> None:
    """Let the tick's dequeue or listing through without a reconcile in the way (tested on its own below)."""
    line.dispatcher.next_reconcile = float("inf")
    line.dispatcher.leader_lock.ensure()


def test_a_standby_publishes_nothing(line: Line, redis_client: redis.Redis) -> None:
    redis_client.set(line.dispatcher.leader_lock.key, "another-dispatcher:token", px=60_000)
    line.add_waiting(2)
    assert line.dispatcher.tick_surviving() == STANDBY_RETRY_S
    assert line.published() == []


def test_a_new_leader_reconciles_at_once(line: Line, monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[float] = []

    def record() -> int:
        scans.append(time.monotonic())
        return 0

    def scan() -> int:
        return line.dispatcher.scan(record)

    monkeypatch.setattr(line.dispatcher, "reconcile", scan)
    line.dispatcher.next_reconcile = float("inf")
    line.dispatcher.tick_surviving()
    assert len(scans) == 1
    line.dispatcher.tick_surviving()  # still leading: the schedule, not the lead, says when the next is due
    assert len(scans) == 1


def _count(series: object) -> float:
    return series._value.get()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["bug", "redis", "upstream"])
def test_an_error_a_tick_lets_out_is_counted_and_a_reconcile_is_due_by_the_next(
    line: Line, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One policy for both lines: a bug waits the line's pause; a Redis error and an error of the line's upstream
    (the Store, the gateway) back off from 0.5 s and 1 s, each counted in its series."""
    dispatcher = line.dispatcher
    upstream_series, upstream_kind = dispatcher.upstream_counter
    error, counter, (low, high) = {
        "bug": (RuntimeError("a bug in the tick"), metrics.LOOP_ERRORS, (dispatcher.error_wait_s,) * 2),
        "redis": (redis.ConnectionError("Redis went away"), metrics.BROKER_ERRORS, (0.5, 1.0)),
        "upstream": (dispatcher.upstream_errors[0]("upstream away"), upstream_series.labels(upstream_kind), (1.0, 2.0)),
    }[kind]

    def broken() -> float:
        raise error

    monkeypatch.setattr(dispatcher, "tick", broken)
    dispatcher.next_reconcile = float("inf")
    before = _count(counter)
    started = time.monotonic()
    wait = dispatcher.tick_surviving()
    assert low <= wait <= high
    assert _count(counter) == before + 1
    assert dispatcher.next_reconcile <= started + wait + 1.0


def test_a_scan_schedules_the_next_after_the_interval_and_the_earliest_request_wins(line: Line) -> None:
    dispatcher = line.dispatcher
    started = time.monotonic()
    dispatcher.reconcile()
    interval = dispatcher.settings.reconcile_interval_s
    assert started + interval - 1.0 <= dispatcher.next_reconcile <= time.monotonic() + interval
    dispatcher.reconcile_by(started + 1.0)
    dispatcher.reconcile_by(started + 5.0)
    assert dispatcher.next_reconcile == started + 1.0


def test_while_the_other_line_waits_a_line_starts_no_more_than_its_share(line: Line, redis_client: redis.Redis) -> None:
    scope = line.dispatcher.scope
    capacity.mark_inflight(redis_client, scope, QUEUE, line.other_line_key(1))
    other = slot_share.V1 if line.dispatcher.line == slot_share.V03 else slot_share.V03
    slot_share.exchange(redis_client, scope, QUEUE, other, 10, 1.0)  # the other line's leader: 10 waiting
    line.add_waiting(5)
    _slots_free(line)
    for _ in range(3):
        line.dispatcher.tick_surviving()
    assert len(line.published()) == SLOTS // 2  # 3 slots free, but half the pool is the other line's
    lines = [line_of(key) for key in capacity.inflight_ids(redis_client, scope, QUEUE)]
    assert lines.count(line.dispatcher.line) == SLOTS // 2


def test_a_line_alone_uses_every_free_slot(line: Line) -> None:
    line.add_waiting(SLOTS + 2)
    _slots_free(line)
    for _ in range(3):
        line.dispatcher.tick_surviving()
    assert len(line.published()) == SLOTS


def test_a_refused_publish_leaves_no_in_flight_entry(line: Line, redis_client: redis.Redis) -> None:
    first, second = line.add_waiting(2)
    line.refuse(first)
    _slots_free(line)
    line.dispatcher.tick_surviving()
    assert line.published() == [second]
    assert len(capacity.inflight_ids(redis_client, line.dispatcher.scope, QUEUE)) == 1


def test_every_freed_slot_wakes_the_line_on_its_own_list(line: Line, redis_client: redis.Redis) -> None:
    scope = line.dispatcher.scope
    capacity.notify_freed(redis_client, scope, QUEUE)
    other = slot_share.V1 if line.dispatcher.line == slot_share.V03 else slot_share.V03
    assert capacity.wait_for_freed(redis_client, scope, [QUEUE], 0.5, other)  # the other line took its wake-up
    assert line.dispatcher.wait_for_freed([QUEUE], 1.0)  # and this line still hears of the slot
    assert not line.dispatcher.wait_for_freed([QUEUE], 0.1)
    assert not redis_client.exists(keys.slot_freed(scope, QUEUE, line.dispatcher.line))


def test_shutdown_releases_the_lock(line: Line, redis_client: redis.Redis) -> None:
    _slots_free(line)
    assert redis_client.exists(line.dispatcher.leader_lock.key)
    line.dispatcher.stop.set()  # type: ignore[attr-defined]
    line.dispatcher.run()
    assert not redis_client.exists(line.dispatcher.leader_lock.key)
    assert not line.dispatcher.leader_lock.held
