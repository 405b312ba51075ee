"""The dispatch loop survives the unexpected, and holds what it cannot place: a V03Dispatcher on this test's Redis
database with a Store and a publisher that misbehave on purpose (``tests.fakes.v03``: no HTTP, no broker)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import capacity, keys
from bridge.core.infra import PublishError
from bridge.core.settings import load_settings
from bridge.dispatch import metrics
from bridge.dispatch.v03.dispatcher import UNEXPECTED_ERROR_WAIT_S, V03Dispatcher
from bridge.dispatch.v03.hold import Hold
from tests.fakes.v03 import Publisher, Store, attempted_rollout

QUEUES = "train=rollouts-train,val=rollouts-val"
SCOPE = keys.store_scope("http://127.0.0.1:9")  # the V03Dispatcher's Redis key scope: its settings' store_url


@pytest.fixture
def client(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    redis_client.flushdb()
    capacity.advertise(redis_client, SCOPE, "w-train@test", ["rollouts-train"], 4)
    yield redis_client
    redis_client.flushdb()


def _dispatcher(client: redis.Redis, store: Store, publisher: Publisher) -> V03Dispatcher:
    settings = load_settings(
        store_url="http://127.0.0.1:9", broker_url="redis://127.0.0.1:9/0", queue_by_mode=QUEUES, max_held=2
    )
    dispatcher = V03Dispatcher(settings, store, client, publisher)  # type: ignore[arg-type]
    dispatcher.next_reconcile = float("inf")  # this test drives the ticks; reconcile is tested elsewhere
    return dispatcher


def test_an_unexpected_publish_error_hands_that_rollout_back_and_the_batch_goes_on(client: redis.Redis) -> None:
    store = Store([attempted_rollout(1), attempted_rollout(2), attempted_rollout(3)])
    publisher = Publisher(fail={"ro-2"})
    errors = metrics.LOOP_ERRORS._value.get()
    dispatcher = _dispatcher(client, store, publisher)
    dispatcher.tick_surviving()
    dispatcher.tick_surviving()  # two a tick: the hold keeps room for val rollouts, whose queue nobody consumes
    assert publisher.published == [("ro-1", "rollouts-train"), ("ro-3", "rollouts-train")]
    assert store.requeued == ["ro-2"]
    assert capacity.inflight_ids(client, SCOPE, "rollouts-train") == {"at-1", "at-3"}  # its slot is not kept busy
    assert metrics.LOOP_ERRORS._value.get() == errors + 1


def test_a_refused_publish_is_handed_back_as_before(client: redis.Redis) -> None:
    store = Store([attempted_rollout(1)])
    _dispatcher(client, store, Publisher(fail={"ro-1"}, error=PublishError("broker said no"))).tick_surviving()
    assert store.requeued == ["ro-1"]


def test_an_error_anywhere_in_a_tick_is_counted_and_the_loop_goes_on(client: redis.Redis) -> None:
    store = Store([attempted_rollout(1)], dequeue_error=RuntimeError("a bug in the dequeue path"))
    publisher = Publisher()
    dispatcher = _dispatcher(client, store, publisher)
    errors = metrics.LOOP_ERRORS._value.get()
    assert dispatcher.tick_surviving() == UNEXPECTED_ERROR_WAIT_S
    assert metrics.LOOP_ERRORS._value.get() == errors + 1
    dispatcher.tick_surviving()
    assert publisher.published == [("ro-1", "rollouts-train")]


def test_rollouts_for_an_unserved_queue_are_held_while_the_others_go_on_and_the_hold_is_bounded(
    client: redis.Redis,
) -> None:
    store = Store(
        [
            attempted_rollout(1, "val"),
            attempted_rollout(2),
            attempted_rollout(3, "val"),
            attempted_rollout(4),
            attempted_rollout(5),
        ]
    )
    publisher = Publisher()
    dispatcher = _dispatcher(client, store, publisher)
    for _ in range(3):
        dispatcher.tick_surviving()
    dispatcher.next_gauges = 0.0  # the gauges are read at the start of a tick, once a second
    dispatcher.tick_surviving()
    assert publisher.published == [("ro-2", "rollouts-train")]
    assert [r.rollout_id for r in store.queue] == ["ro-4", "ro-5"]  # two held (BRIDGE_MAX_HELD=2): no more claims
    assert store.requeued == []  # held, not cycled through hand-backs
    assert metrics.HELD.labels("rollouts-val")._value.get() == 2
    assert metrics.UNSERVED.labels("rollouts-val")._value.get() == 1
    assert capacity.read_held(client, SCOPE) == ({"rollouts-val": 2}, ["rollouts-val"])

    capacity.advertise(client, SCOPE, "w-val@test", ["rollouts-val"], 1)  # a val worker with one slot comes
    dispatcher.tick_surviving()
    dispatcher.tick_surviving()
    # ro-1 goes out (oldest first); ro-3 now waits for a consumed, full queue: nothing more is claimed.
    assert publisher.published[1:] == [("ro-1", "rollouts-val")]
    assert [r.rollout_id for r in store.queue] == ["ro-4", "ro-5"]
    dispatcher.stop.set()  # type: ignore[attr-defined]
    dispatcher.run()  # shutdown hands back what it still holds, if still live
    assert store.requeued == ["ro-3"]


def test_the_hold_releases_oldest_first_and_only_into_room() -> None:
    hold = Hold(capacity=3)
    for n, queue in [(1, "a"), (2, "b"), (3, "a")]:
        hold.add(attempted_rollout(n), queue)
    assert hold.room() == 0
    rooms = {"a": 1, "b": 0}
    assert [h.rollout.rollout_id for h in hold.placeable(rooms, served={"a", "b"})] == ["ro-1"]
    assert rooms == {"a": 0, "b": 0}
    assert hold.overdue(served={"a"}, max_wait_s=-1) and hold.by_queue() == {"b": 1}  # b unserved: kept
    assert [h.attempt_id for h in hold.discard(["at-2"])] == ["at-2"] and len(hold) == 0


def test_a_tick_whose_reconcile_republished_claims_that_many_fewer(client: redis.Redis) -> None:
    """A stranded attempt re-published by reconcile takes a slot the same tick's dequeue must not claim."""
    capacity.withdraw(client, SCOPE, "w-train@test", ["rollouts-train"])
    capacity.advertise(client, SCOPE, "w-train@test", ["rollouts-train", "rollouts-val"], 2)
    stranded = attempted_rollout(1, start_time=time.time(), worker_id="celery-bridge")  # ours, in no message, no lease
    store = Store([attempted_rollout(2), attempted_rollout(3)])
    store.rollouts[stranded.rollout_id] = stranded
    publisher = Publisher()
    dispatcher = _dispatcher(client, store, publisher)
    dispatcher.next_reconcile = 0.0
    dispatcher.suspects = {"at-1": time.monotonic() - dispatcher.confirm_s}  # seen stranded one scan ago
    dispatcher.tick_surviving()
    assert publisher.published == [("ro-1", "rollouts-train"), ("ro-2", "rollouts-train")]
    assert [r.rollout_id for r in store.queue] == ["ro-3"]
