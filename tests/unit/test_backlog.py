"""The autoscaling signal: the Store's waiting rollouts per queue (``bridge.dispatch.backlog``) and the leader's
gauges built on them (desired = waiting + held + in flight), exported by the leader only and never at the cost
of dispatch. A V03Dispatcher on this test's Redis database with a plain-object Store (no HTTP, no broker)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client import Gauge

from bridge.core.coordination import capacity, keys, line_demand
from bridge.core.infra import StoreUnavailable
from bridge.core.settings import Settings, load_settings
from bridge.core.store import AttemptedRollout, Rollout
from bridge.core.task import DEFAULT_AGENT
from bridge.dispatch import metrics
from bridge.dispatch.publisher import Task
from bridge.dispatch.v03.backlog import read_backlog, split
from bridge.dispatch.v03.dispatcher import V03Dispatcher
from bridge.dispatch.v1.backlog import gateway_backlog

QUEUES = "train=rollouts-train,val=rollouts-val,test=rollouts-val"
STORE_URL = "http://127.0.0.1:9"
SCOPE = keys.store_scope(STORE_URL)


def _settings(queue_by_mode: str = QUEUES) -> Settings:
    return load_settings(store_url=STORE_URL, broker_url="redis://127.0.0.1:9/0", queue_by_mode=queue_by_mode)


def _waiting(n: int, mode: str | None, start_time: float) -> Rollout:
    fields = {"rollout_id": f"ro-{n}", "status": "queuing", "mode": mode, "start_time": start_time}
    return Rollout.model_validate(fields)


def _claimed(n: int) -> AttemptedRollout:
    rid, aid = f"ro-c{n}", f"at-c{n}"
    attempt = {"rollout_id": rid, "attempt_id": aid, "status": "preparing", "start_time": 1.0}
    fields = {"rollout_id": rid, "status": "preparing", "mode": "train", "attempt": attempt}
    return AttemptedRollout.model_validate(fields)


class Store:
    """Answers the backlog read with ``waiting`` (oldest first, as sorted by the Store) and records each call;
    ``blocked`` holds it until set, ``error`` makes it fail. ``dequeue`` hands out ``claimable``."""

    def __init__(self, waiting: list[Rollout], *, claimable: list[AttemptedRollout] = ()) -> None:  # type: ignore[assignment]
        self.waiting = waiting
        self.claimable = list(claimable)
        self.calls: list[dict[str, Any]] = []
        self.error: Exception | None = None
        self.blocked: threading.Event | None = None

    def list_rollouts(self, **kwargs: Any) -> tuple[list[Rollout], int]:
        if "queuing" not in kwargs.get("status_in", ()):  # reconcile's read of active rollouts: none here
            return [], 0
        self.calls.append(kwargs)
        if self.blocked is not None:
            self.blocked.wait(10)
        if self.error is not None:
            raise self.error
        limit = kwargs["limit"]
        return self.waiting[: None if limit == -1 else limit], len(self.waiting)

    def dequeue(self, limit: int, worker_id: str) -> list[AttemptedRollout]:
        batch, self.claimable = self.claimable[:limit], self.claimable[limit:]
        return batch


class Publisher:
    def __init__(self) -> None:
        self.published: list[str] = []

    agent = DEFAULT_AGENT

    def send(self, task: Task) -> None:
        self.published.append(task.kwargs["rollout"]["rollout_id"])

    def close(self) -> None:
        pass


def _series(gauge: Gauge) -> dict[str, float]:
    return {sample.labels["queue"]: sample.value for metric in gauge.collect() for sample in metric.samples}


@pytest.fixture
def client(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    redis_client.flushdb()
    metrics.clear_leader_gauges()
    yield redis_client
    # A lock left held keeps its renewal thread, which clears the process-wide leader gauge once the flush below
    # takes its key: in the middle of the next test, which then read 0 from a leader it had just made.
    while _made:
        _made.pop().leader_lock.release()
    redis_client.flushdb()
    metrics.clear_leader_gauges()


_made: list[V03Dispatcher] = []


def _dispatcher(client: redis.Redis, store: Store, settings: Settings | None = None) -> V03Dispatcher:
    dispatcher = V03Dispatcher(settings or _settings(), store, client, Publisher())  # type: ignore[arg-type]
    dispatcher.next_reconcile = float("inf")  # reconcile is tested elsewhere
    _made.append(dispatcher)
    return dispatcher


# --- the computation ------------------------------------------------------------------------------


def test_each_rollout_counts_on_the_queue_its_mode_routes_to_with_the_oldest_per_queue() -> None:
    items = [_waiting(1, "val", 10.0), _waiting(2, "train", 11.0), _waiting(3, None, 12.0), _waiting(4, "test", 13.0)]
    backlog = split(items, 4, _settings())
    assert backlog.waiting == {"rollouts": 1, "rollouts-train": 1, "rollouts-val": 2}
    assert backlog.oldest == {"rollouts-val": 10.0, "rollouts-train": 11.0, "rollouts": 12.0}
    assert backlog.exact
    assert backlog.oldest_age("rollouts-val", now=25.0) == 15.0 and backlog.oldest_age("nowhere", now=25.0) == 0.0


def test_with_one_routed_queue_one_listed_rollout_and_the_total_are_exact() -> None:
    store = Store([_waiting(n, "train", float(n)) for n in range(1, 251)])
    backlog = read_backlog(store, _settings(queue_by_mode=""))  # type: ignore[arg-type]
    assert [call["limit"] for call in store.calls] == [1]
    assert store.calls[0]["sort_by"] == "start_time" and set(store.calls[0]["status_in"]) == {"queuing", "requeuing"}
    assert backlog.waiting == {"rollouts": 250} and backlog.oldest == {"rollouts": 1.0} and backlog.exact


def test_with_several_queues_the_oldest_page_is_split_exactly_and_the_rest_in_proportion() -> None:
    settings = _settings().model_copy(update={"backlog_list_limit": 4})
    store = Store([_waiting(n, ("train", "train", "train", "val")[n % 4], float(n)) for n in range(9)])
    backlog = read_backlog(store, settings)  # type: ignore[arg-type]
    assert [call["limit"] for call in store.calls] == [4]  # one request per reading, whatever the queues
    assert sum(backlog.waiting.values()) == 9 and not backlog.exact
    # Listed: 3 train, 1 val. The other 5 go 3:1, 3.75 and 1.25, the largest remainder to train.
    assert backlog.waiting == {"rollouts": 0, "rollouts-train": 7, "rollouts-val": 2}


def test_the_gateways_listing_counts_every_item_and_a_full_page_is_a_lower_bound() -> None:
    items: list[Any] = [
        {"rollout_id": "a", "status": {"state": "queuing", "created_at": 20.5}},
        {"rollout_id": "b", "status": {"state": "queuing", "created_at": 10}},
        {"rollout_id": "c", "status": {"created_at": True}},  # unreadable, waits all the same
        {"rollout_id": "d"},
        "not a rollout",
    ]
    backlog = gateway_backlog(items, "rollouts", limit=1000)
    assert backlog.waiting == {"rollouts": 5} and backlog.oldest == {"rollouts": 10.0} and backlog.exact
    assert backlog.oldest_age("rollouts", now=25.0) == 15.0
    full = gateway_backlog(items[:2], "rollouts", limit=2)
    assert full.waiting == {"rollouts": 2} and not full.exact
    empty = gateway_backlog([], "rollouts", limit=2)
    assert empty.waiting == {"rollouts": 0} and empty.oldest == {} and empty.exact


# --- the leader's gauges --------------------------------------------------------------------------


def test_the_leader_exports_waiting_slots_and_desired_as_waiting_plus_in_flight(client: redis.Redis) -> None:
    capacity.advertise(client, SCOPE, "w-train@test", ["rollouts-train"], 4)
    store = Store([_waiting(1, "train", 100.0), _waiting(2, "val", 101.0), _waiting(3, "train", 102.0)])
    store.claimable = [_claimed(1)]  # published on the first tick: in flight on rollouts-train
    dispatcher = _dispatcher(client, store)
    dispatcher.tick()
    dispatcher.backlog.read_once()
    dispatcher.next_gauges = 0.0
    dispatcher.tick()
    assert _series(metrics.STORE_WAITING) == {"rollouts": 0, "rollouts-train": 2, "rollouts-val": 1}
    assert _series(metrics.SLOTS) == {"rollouts": 0, "rollouts-train": 4, "rollouts-val": 0}
    assert _series(metrics.FREE_SLOTS)["rollouts-train"] == 3
    assert _series(metrics.DESIRED_SLOTS) == {"rollouts": 0, "rollouts-train": 3, "rollouts-val": 1}
    assert _series(metrics.STORE_OLDEST_WAITING)["rollouts-train"] > 0


def test_desired_adds_the_1_0_lines_published_backlog_and_publishes_this_lines_own(client: redis.Redis) -> None:
    """The queue both lines share: in flight (every line's) + the Store's waiting + held + the gateway's queuing
    as the 1.0 leader published it; this line's waiting + held go the other way, for the 1.0 leader's sum."""
    settings = _settings(queue_by_mode="")
    capacity.advertise(client, SCOPE, "w@test", ["rollouts"], 4)
    capacity.mark_inflight(client, SCOPE, "rollouts", "v1-r1-0")  # a 1.0 attempt on the shared slots
    line_demand.exchange(client, SCOPE, "v1", {"rollouts": 6})  # what the 1.0 leader publishes
    store = Store([_waiting(n, "train", 100.0 + n) for n in range(3)], claimable=[_claimed(1)])
    dispatcher = _dispatcher(client, store, settings)
    dispatcher.tick()  # publishes ro-c1: in flight
    dispatcher.backlog.read_once()
    dispatcher.next_gauges = 0.0
    dispatcher.tick()
    assert _series(metrics.STORE_WAITING) == {"rollouts": 3}
    assert _series(metrics.IN_FLIGHT) == {"rollouts": 2}
    assert _series(metrics.DESIRED_SLOTS) == {"rollouts": 2 + 3 + 6}
    assert client.get(keys.line_backlog(SCOPE, "rollouts", "v03")) == "3"
    client.delete(keys.line_backlog(SCOPE, "rollouts", "v1"))  # the 1.0 line stopped: its backlog expired
    dispatcher.next_gauges = 0.0
    dispatcher.tick()
    assert _series(metrics.DESIRED_SLOTS) == {"rollouts": 2 + 3}


def test_a_standby_exports_none_and_a_leader_that_loses_the_lock_clears_them(client: redis.Redis) -> None:
    store = Store([_waiting(1, "train", 100.0)])
    client.set(keys.bridge_leader(SCOPE), "another-bridge:1")
    standby = _dispatcher(client, store)
    standby.tick()
    standby.backlog.read_once()  # what its thread would do: nothing, since it does not lead
    assert store.calls == [] and standby.backlog.latest is None
    assert all(not _series(gauge) for gauge in metrics.LEADER_GAUGES)
    assert metrics.IS_LEADER.labels("v03")._value.get() == 0

    client.delete(keys.bridge_leader(SCOPE))
    leader = _dispatcher(client, store)
    leader.tick()
    leader.backlog.read_once()
    leader.next_gauges = 0.0
    leader.tick()
    assert _series(metrics.DESIRED_SLOTS)["rollouts-train"] == 1 and metrics.IS_LEADER.labels("v03")._value.get() == 1

    client.set(keys.bridge_leader(SCOPE), "another-bridge:2")  # its lock expired and another bridge took it
    leader.tick()
    assert all(not _series(gauge) for gauge in metrics.LEADER_GAUGES)
    assert leader.backlog.latest is None and metrics.IS_LEADER.labels("v03")._value.get() == 0


def test_a_failed_or_hanging_store_read_keeps_the_last_reading_and_never_stalls_dispatch(client: redis.Redis) -> None:
    capacity.advertise(client, SCOPE, "w-train@test", ["rollouts-train"], 4)
    store = Store([_waiting(1, "train", 100.0)], claimable=[_claimed(1), _claimed(2)])
    dispatcher = _dispatcher(client, store)
    dispatcher.tick()
    dispatcher.backlog.read_once()
    before = dispatcher.backlog.latest
    errors = metrics.STORE_ERRORS.labels("backlog")._value.get()
    store.error = StoreUnavailable("the Store is away")
    dispatcher.backlog.read_once()
    assert dispatcher.backlog.latest is before
    assert metrics.STORE_ERRORS.labels("backlog")._value.get() == errors + 1

    store.error, store.blocked = None, threading.Event()  # the next read hangs on its own thread
    dispatcher.backlog.start()
    try:
        dispatcher.backlog.wake()
        dispatcher.tick()
        dispatcher.tick()
        assert dispatcher.publisher.published == ["ro-c1", "ro-c2"]  # type: ignore[attr-defined]
    finally:
        store.blocked.set()
        dispatcher.backlog.close()
