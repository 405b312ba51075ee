"""The 1.0 dispatcher's I/O (``bridge.dispatch.v1``) against an in-process fake of the gateway's HTTP API (behind
the real ``GatewayClient``), a fake Celery app that records or refuses publishes, and this test's Redis database.

What each test proves: a rollout the models reject fails alone with the field named, the others go on; a bad
attempt id stops no other repair; a refused publish is retried with backoff without blocking the rollouts
behind it and fails the rollout after ``AGL_V1_PUBLISH_GIVE_UP_S``; an error no retry cures fails it at once;
time limits are clamped to the broker's redelivery window; a hand-over runs the rollout again without using a
re-run; a rollout finished or deleted between the listing and its re-run keeps its attempt and is not published
(the fake refuses a write that is no state transition, and takes the other fields on a finished rollout, as
``agl-server`` does); a kept failure names its failure class on the gateway; the leader exports the gateway's
backlog and the queue's desired slots with the 0.3 line's backlog added, and its dispatch series under ``line="v1"``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu.exceptions import EncodeError, OperationalError

from bridge.core.coordination import capacity, keys, line_demand
from bridge.core.gateway import scoped_attempt_key
from bridge.dispatch import metrics
from bridge.dispatch.v1 import dispatcher as v1_module
from bridge.dispatch.v1.dispatcher import V1Dispatcher
from tests.fakes.v1 import QUEUE, FakeGateway, v1_dispatcher
from tests.helpers import TEST_REDIS_URL

FINISHED = ("succeeded", "failed")


class Clock:
    """``bridge.dispatch.v1``'s ``time``: epoch seconds the test moves on, and the real monotonic clock."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def rid() -> str:
    """A prefix for this test's rollout ids: attempt keys (leases, markers, records) are not scoped."""
    return f"t{uuid.uuid4().hex[:8]}"


def _state(dispatcher: V1Dispatcher, rollout_id: str, attempt_id: str) -> str:
    """Where the workers keep that attempt's markers and record: its deployment-scoped name."""
    rollout = dispatcher.gateway.get_rollout(rollout_id)
    assert rollout is not None
    return scoped_attempt_key(dispatcher.scope, rollout, attempt_id)


@pytest.fixture
def cleanup(redis_client: redis.Redis) -> Iterator[list[str]]:
    """Attempt keys whose markers the test set: deleted afterwards."""
    names: list[str] = []
    yield names
    for key in names:
        redis_client.delete(keys.lease(key), keys.started(key), keys.done(key), keys.v1_result(key))


# --- listings -------------------------------------------------------------------------------------------


def test_a_rollout_the_models_reject_is_failed_naming_the_field_and_the_others_go_on(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str
) -> None:
    gateway.add(f"{rid}-bad", timeout_seconds=1.5)  # not an integer number of seconds
    gateway.add(f"{rid}-good")
    dispatcher, app = v1_dispatcher(gateway, redis_client)
    dispatcher.tick()
    assert app.task_ids() == [f"v1-{rid}-good-0"]
    assert gateway.status(f"{rid}-good")["state"] == "running"
    bad = gateway.status(f"{rid}-bad")
    assert bad["state"] == "failed" and "config.timeout_seconds" in bad["error_message"]


def test_a_malformed_running_rollout_does_not_stop_the_reconcile(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, cleanup: list[str]
) -> None:
    gateway.add(f"{rid}-bad", state="running", attempt="0", local={"agent_class": "a:B", "env_map": {"X": 1}})
    gateway.add(f"{rid}-kept", state="running", attempt="0")
    dispatcher, _ = v1_dispatcher(gateway, redis_client)
    kept = _state(dispatcher, f"{rid}-kept", "0")
    cleanup.append(kept)
    redis_client.set(keys.v1_result(kept), json.dumps({"state": "succeeded", "detail": "exit 0"}))
    dispatcher.reconcile()
    assert gateway.status(f"{rid}-kept")["state"] == "succeeded"
    bad = gateway.status(f"{rid}-bad")
    assert bad["state"] == "failed" and "config.local.env_map.X" in bad["error_message"]


# --- the reconcile's I/O --------------------------------------------------------------------------------


def test_an_attempt_id_that_is_not_a_number_stops_no_other_repair(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, cleanup: list[str]
) -> None:
    """First in the listing: a rollout whose attempt id is not ours to number, its worker lost."""
    gateway.add(f"{rid}-odd", state="running", attempt="job-7")
    gateway.add(f"{rid}-kept", state="running", attempt="0")
    dispatcher, app = v1_dispatcher(gateway, redis_client)
    odd_key, kept_key = _state(dispatcher, f"{rid}-odd", "job-7"), _state(dispatcher, f"{rid}-kept", "0")
    cleanup += [odd_key, kept_key]
    redis_client.set(keys.started(odd_key), "x")
    record = {"state": "failed", "detail": "Traceback ...", "failure_class": "agent", "handover": False}
    redis_client.set(keys.v1_result(kept_key), json.dumps(record))
    dispatcher.reconcile()
    kept = gateway.status(f"{rid}-kept")
    assert kept["state"] == "failed" and kept["error_message"] == "[failure class: agent] Traceback ..."
    assert redis_client.get(keys.v1_result(kept_key)) is None
    odd = gateway.status(f"{rid}-odd")
    assert odd["state"] == "failed" and "'job-7' was lost" in odd["error_message"]
    assert app.sent == []


def test_a_hand_over_runs_the_rollout_again_without_using_a_rerun(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, cleanup: list[str]
) -> None:
    gateway.add(rid, state="running", attempt="0")
    dispatcher, app = v1_dispatcher(gateway, redis_client, agl_v1_max_reruns=1)
    first, second, third = (_state(dispatcher, rid, aid) for aid in "012")
    cleanup += [first, second, third]
    record = {"state": None, "detail": "worker draining", "failure_class": "shutdown", "handover": True}
    redis_client.set(keys.done(first), "1")
    redis_client.set(keys.v1_result(first), json.dumps(record))
    dispatcher.reconcile()
    assert gateway.status(rid) == {"state": "running", "last_attempt_id": "1"}
    assert app.task_ids() == [f"v1-{rid}-1"]
    assert redis_client.get(keys.v1_result(first)) is None
    assert redis_client.smembers(keys.v1_handovers(dispatcher.scope, rid)) == {"0"}
    dispatcher.reconcile()  # the record is gone: nothing counted or published twice
    assert app.task_ids() == [f"v1-{rid}-1"]

    redis_client.set(keys.started(second), "x")  # attempt 1's worker is lost: the one re-run is owed
    dispatcher.reconcile()
    assert gateway.status(rid)["last_attempt_id"] == "2"
    assert app.task_ids() == [f"v1-{rid}-1", f"v1-{rid}-2"]
    redis_client.set(keys.started(third), "x")  # and now it is used
    dispatcher.reconcile()
    status = gateway.status(rid)
    assert status["state"] == "failed" and "AGL_V1_MAX_RERUNS=1" in status["error_message"]
    redis_client.delete(keys.v1_handovers(dispatcher.scope, rid))


@pytest.mark.parametrize(
    ("window", "final", "writes"),
    [
        ("list", "failed", []),  # seen by the re-run's own read: nothing written
        ("read", "succeeded", [{"last_attempt_id": "1"}, {"last_attempt_id": "0"}]),  # seen in the write's answer
    ],
)
def test_a_rollout_finished_between_the_listing_and_its_re_run_keeps_its_attempt_and_nothing_is_published(
    gateway: FakeGateway,
    redis_client: redis.Redis,
    rid: str,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
    window: str,
    final: str,
    writes: list[dict[str, Any]],
) -> None:
    """Its worker lost (started, no lease), the rollout is finished by the trainer or a late report right after
    the dispatcher's listing (``list``) or right after the re-run's read (``read``)."""
    gateway.add(rid, state="running", attempt="0")
    dispatcher, app = v1_dispatcher(gateway, redis_client, agl_v1_max_reruns=1)
    lost = _state(dispatcher, rid, "0")
    cleanup += [lost, _state(dispatcher, rid, "1")]
    redis_client.set(keys.started(lost), "x")
    capacity.mark_inflight(redis_client, dispatcher.scope, QUEUE, f"v1-{rid}-0")
    gateway.meanwhile[window] = lambda: gateway.rollouts[rid]["status"].update(state=final)
    with caplog.at_level("INFO", logger="bridge.v1"):
        dispatcher.reconcile()
    assert gateway.status(rid) == {"state": final, "last_attempt_id": "0"}  # the trainer reads attempt 0's events
    assert [fields for _, fields in gateway.writes] == writes
    assert app.sent == []
    assert capacity.inflight_entries(redis_client, dispatcher.scope, QUEUE) == {}
    assert f"[v1 rollout={rid}] not run again, nothing to re-run: rollout {rid}" in caplog.text
    assert final in caplog.text


def test_a_rollout_deleted_between_the_listing_and_its_re_run_is_not_published(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, cleanup: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    gateway.add(rid, state="running", attempt="0")
    dispatcher, app = v1_dispatcher(gateway, redis_client, agl_v1_max_reruns=1)
    lost = _state(dispatcher, rid, "0")
    cleanup.append(lost)
    redis_client.set(keys.started(lost), "x")
    gateway.meanwhile["list"] = gateway.rollouts.clear  # the trainer deletes it
    with caplog.at_level("INFO", logger="bridge.v1"):
        dispatcher.reconcile()
    assert gateway.writes == [] and app.sent == []
    assert f"[v1 rollout={rid}] not run again: the gateway no longer has it" in caplog.text


# --- publishing -----------------------------------------------------------------------------------------


def test_a_refused_publish_backs_off_without_blocking_the_rollouts_behind_it_then_fails(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(1_700_000_000.0)
    monkeypatch.setattr(v1_module, "time", clock)
    gateway.add(f"{rid}-a")
    gateway.add(f"{rid}-b")
    dispatcher, app = v1_dispatcher(gateway, redis_client, slots=1, agl_v1_publish_give_up_s=120.0, publish_retries=0)
    app.refuse[f"{rid}-a"] = OperationalError("connection refused")
    dispatcher.tick()
    assert app.sent == [] and gateway.status(f"{rid}-a")["state"] == "queuing"
    assert capacity.inflight_entries(redis_client, dispatcher.scope, QUEUE) == {}
    dispatcher.tick()  # a waits for its next try; b, behind it, takes the one slot
    assert app.task_ids() == [f"v1-{rid}-b-0"]
    redis_client.delete(keys.inflight(dispatcher.scope, QUEUE))  # b's worker finished

    clock.now += 60  # a's next try is due: refused again, still within the bound
    dispatcher.tick()
    assert gateway.status(f"{rid}-a")["state"] == "queuing"
    clock.now += 61
    dispatcher.tick()
    status = gateway.status(f"{rid}-a")
    assert status["state"] == "failed"
    assert "broker did not take the rollout for 121s: connection refused" in status["error_message"]


def test_a_refused_re_publish_of_a_running_rollout_is_bounded_too(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconcile's re-publish of a message that never started, refused on every scan: the ticks between
    the scans keep its refusal clock, and it fails after the bound."""
    clock = Clock(1_700_000_000.0)
    monkeypatch.setattr(v1_module, "time", clock)
    gateway.add(rid, state="running", attempt="0")
    dispatcher, app = v1_dispatcher(gateway, redis_client, agl_v1_publish_give_up_s=120.0, publish_retries=0)
    app.refuse[rid] = OperationalError("connection refused")
    dispatcher.reconcile()
    assert gateway.status(rid)["state"] == "running"
    clock.now += 130
    dispatcher.tick()
    dispatcher.reconcile()
    status = gateway.status(rid)
    assert status["state"] == "failed" and "for 130s: connection refused" in status["error_message"]


def test_refusals_back_off_give_up_and_are_forgotten_when_nobody_retries() -> None:
    refusals = v1_module.PublishRefusals(give_up_s=100.0, stale_after_s=200.0)
    first = refusals.refused("r", 0.0)
    assert first is not None and 0.5 <= first <= 1.0 and refusals.waiting("r", first - 0.01)
    second = refusals.refused("r", 50.0)
    assert second is not None and 1.0 <= second <= 2.0 and not refusals.waiting("r", 50.0 + second)
    assert refusals.refused("r", 100.0) is None and len(refusals) == 0  # gave up: forgotten
    refusals.refused("s", 0.0)
    refusals.forget_stale(150.0)
    assert len(refusals) == 1
    refusals.forget_stale(205.0)
    assert len(refusals) == 0


def test_a_publish_no_retry_can_cure_fails_the_rollout_at_once(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str
) -> None:
    gateway.add(rid)
    dispatcher, app = v1_dispatcher(gateway, redis_client)
    app.refuse[rid] = EncodeError("Object of type bytes is not JSON serializable")
    dispatcher.tick()
    status = gateway.status(rid)
    assert status["state"] == "failed" and "EncodeError: Object of type bytes" in status["error_message"]
    assert capacity.inflight_entries(redis_client, dispatcher.scope, QUEUE) == {}


SECRET = "s3cr3t-value-42"


@pytest.mark.parametrize(
    ("error", "masked"),
    [
        (  # no retry cures it: failed at once
            EncodeError(f"cannot encode for amqp://bridge:{SECRET}@rabbit//: api_key={SECRET}"),
            "could not be published: EncodeError: cannot encode for amqp://bridge:***@rabbit//: api_key=***",
        ),
        (  # refused, logged, tried again, and failed after AGL_V1_PUBLISH_GIVE_UP_S
            OperationalError(f"Error connecting to redis://:{SECRET}@broker:6379/0"),
            "did not take the rollout for 61s: Error connecting to redis://:***@broker:6379/0",
        ),
    ],
)
def test_a_publish_error_is_redacted_on_the_gateway_and_in_the_log(
    gateway: FakeGateway,
    redis_client: redis.Redis,
    rid: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    masked: str,
) -> None:
    """What the broker client says may hold a URL's password or a token: the gateway's ``error_message`` and the
    dispatcher's log get it masked, as 0.3 masks every error it reports."""
    clock = Clock(1_700_000_000.0)
    monkeypatch.setattr(v1_module, "time", clock)
    gateway.add(rid)
    dispatcher, app = v1_dispatcher(gateway, redis_client, agl_v1_publish_give_up_s=60.0, publish_retries=0)
    app.refuse[rid] = error
    with caplog.at_level(logging.INFO):
        dispatcher.tick()
        clock.now += 61
        dispatcher.tick()
    status = gateway.status(rid)
    assert status["state"] == "failed", status
    assert masked in status["error_message"]
    assert SECRET not in status["error_message"] and SECRET not in caplog.text


def test_time_limits_are_clamped_to_what_rabbitmq_covers(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str
) -> None:
    """RabbitMQ's 30-minute consumer timeout against 1.0's default 3,600 s budget (hard limit 3,690 s)."""
    gateway.add(rid, timeout_seconds=3600)
    dispatcher, app = v1_dispatcher(
        gateway, redis_client, broker_url="amqp://guest:guest@127.0.0.1:5672//", redis_url=TEST_REDIS_URL
    )
    dispatcher.tick()
    (task,) = app.sent
    budget = task["kwargs"]["rollout"]["config"]["timeout_seconds"]
    assert budget == 1800 - 300 - 1 - (30 + 60)  # consumer timeout, queue wait, spare, the worker's margin
    assert task["time_limit"] + dispatcher.settings.max_queue_wait_s < 1800
    assert task["time_limit"] > task["soft_time_limit"] > budget  # the worker kills the program first


def test_a_budget_the_broker_covers_is_published_as_asked(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str
) -> None:
    gateway.add(rid, timeout_seconds=3600)
    dispatcher, app = v1_dispatcher(gateway, redis_client)  # Redis: a 7,200 s visibility timeout
    dispatcher.tick()
    assert app.sent[0]["kwargs"]["rollout"]["config"]["timeout_seconds"] == 3600
    assert app.sent[0]["time_limit"] == 3600 + 30 + 60


# --- metrics --------------------------------------------------------------------------------------------


def _gauge(gauge: Any) -> dict[str, float]:
    return {sample.labels["queue"]: sample.value for metric in gauge.collect() for sample in metric.samples}


def test_the_leader_exports_the_gateways_backlog_and_the_queues_whole_demand(
    gateway: FakeGateway, redis_client: redis.Redis, rid: str
) -> None:
    gateway.add(f"{rid}-bad", timeout_seconds=1.5)  # failed by the dispatcher: class input
    for n in range(5):
        gateway.add(f"{rid}-{n}")
    gateway.rollouts[f"{rid}-4"]["status"]["created_at"] = time.time() - 30.0
    dispatcher, _app = v1_dispatcher(gateway, redis_client, slots=2)
    line_demand.exchange(redis_client, dispatcher.scope, "v03", {QUEUE: 4})  # what the 0.3 leader publishes
    published = metrics.PUBLISHED.labels(QUEUE, "v1")._value.get()
    failed = metrics.FAILED.labels("input")._value.get()
    metrics.clear_leader_gauges()
    dispatcher.tick()  # leads; lists two (two slots): fails the malformed one, publishes the first
    dispatcher.backlog.read_once()  # what its thread does: four queuing
    dispatcher.next_gauges = 0.0
    dispatcher.tick()  # the gauges, then publishes the second
    assert metrics.PUBLISHED.labels(QUEUE, "v1")._value.get() == published + 2
    assert metrics.FAILED.labels("input")._value.get() == failed + 1
    assert metrics.IS_LEADER.labels("v1")._value.get() == 1
    assert _gauge(metrics.GATEWAY_WAITING) == {QUEUE: 4} and _gauge(metrics.IN_FLIGHT) == {QUEUE: 1}
    assert _gauge(metrics.GATEWAY_OLDEST_WAITING)[QUEUE] >= 30.0
    assert _gauge(metrics.DESIRED_SLOTS) == {QUEUE: 1 + 4 + 4}
    assert redis_client.get(keys.line_backlog(dispatcher.scope, QUEUE, "v1")) == "4"  # for the 0.3 leader's sum

    redis_client.set(dispatcher.leader_lock.key, "another-dispatcher:1")  # its lock lapsed and a standby took it
    dispatcher.tick()
    assert all(not _gauge(gauge) for gauge in metrics.LEADER_GAUGES)
    assert metrics.IS_LEADER.labels("v1")._value.get() == 0 and dispatcher.backlog.latest is None
    redis_client.delete(dispatcher.leader_lock.key)


# Every agl_bridge_* series the 1.0 dispatcher sets (bridge/dispatch/v1/ and what it calls: the leader lock,
# the gateway's backlog reader, the publisher's timeout clamp), and so may export.
V1_SETS = {
    "agl_bridge_published_total",
    "agl_bridge_republished_total",
    "agl_bridge_stranded_in_flight_total",
    "agl_bridge_is_leader",
    "agl_bridge_reruns_total",
    "agl_bridge_failed_total",
    "agl_bridge_gateway_errors_total",
    "agl_bridge_loop_errors_total",
    "agl_bridge_broker_errors_total",
    "agl_bridge_timeouts_clamped_total",
    "agl_bridge_in_flight",
    "agl_bridge_total_slots",
    "agl_bridge_desired_slots",
    "agl_bridge_gateway_waiting_rollouts",
    "agl_bridge_gateway_oldest_waiting_seconds",
}

# A process of its own, as ``python -m bridge v1`` is (no 0.3 bridge ever ran in it): a leading dispatcher that
# published, failed one rollout and read the backlog; its answer is what its /metrics serves, by series name.
SCRAPE_V1 = """
import json, uuid
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
import bridge.cli, bridge.dispatch.v1.dispatcher  # what the 1.0 dispatcher's process imports
from bridge.core.coordination import coordination_client
from tests.helpers import TEST_REDIS_URL
from tests.fakes.v1 import FakeGateway, v1_dispatcher
gateway, rid = FakeGateway(), f"m{uuid.uuid4().hex[:8]}"
gateway.add(f"{rid}-bad", timeout_seconds=1.5)
for n in range(3):
    gateway.add(f"{rid}-{n}")
dispatcher, _app = v1_dispatcher(gateway, coordination_client(TEST_REDIS_URL, socket_timeout=5), slots=2)
dispatcher.tick()
dispatcher.backlog.read_once()
dispatcher.next_gauges = 0.0
dispatcher.tick()
names = set()
for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
    suffix = "_total" if family.type == "counter" else ""
    names |= {family.name + suffix for sample in family.samples if not sample.name.endswith("_created")}
print(json.dumps(sorted(name for name in names if name.startswith("agl_bridge_"))))
"""


def test_the_1_0_dispatchers_metrics_export_only_series_it_sets() -> None:
    """No 0.3 bridge series (dequeued, handed back, Store errors, the dequeue-to-publish histogram...) served as
    zeros the 1.0 dispatcher never measured."""
    env = {**os.environ, "TEST_REDIS_URL": TEST_REDIS_URL, "PYTEST_XDIST_WORKER": "gw0"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", SCRAPE_V1], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    exported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert exported <= V1_SETS, sorted(exported - V1_SETS)
    assert {"agl_bridge_published_total", "agl_bridge_failed_total", "agl_bridge_desired_slots"} <= exported
