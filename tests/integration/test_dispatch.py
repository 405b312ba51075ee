"""The bridge process on its own: backpressure, clean SIGTERM, repair of rollouts stranded by a crash
(between dequeue and publish, or between recording the slot and the broker taking the message) or left
``running`` with no live attempt by a span batch the Store took after a ``failed`` report, and time limits
the broker's visibility timeout can cover."""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.settings import Settings, load_settings
from bridge.core.store import API, AttemptedRollout, StoreClient
from bridge.core.task import DEFAULT_AGENT, hard_time_limit, longest_timeout_s, soft_time_limit
from bridge.dispatch.publisher import Publisher, Task
from bridge.dispatch.v03.dispatcher import V03Dispatcher, rollout_task
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, split_tasks, stack_for, wait_finished
from workers.telemetry.spans import AttemptTelemetry

pytestmark = [pytest.mark.integration, pytest.mark.cost(76)]


def _count(store_url: str, status: str) -> int:
    response = httpx.get(f"{store_url}{API}/rollouts", params={"status_in": status, "limit": 1}, timeout=30)
    return int(response.json()["total"])


def test_without_workers_the_bridge_leaves_rollouts_in_the_store(clean_store: LocalStack, tmp_path: Path) -> None:
    stack = stack_for(clean_store, tmp_path, workers=0)
    with stack:
        ids = enqueue(clean_store.store_url, split_tasks(50))
        time.sleep(20)
        queuing = sum(1 for rid in ids if rollout(clean_store.store_url, rid)["status"] == "queuing")
        bridge_log = stack.process("bridge").log_path.read_text()
    assert queuing >= 45, f"only {queuing} of 50 still queuing"
    assert "published" not in bridge_log


def test_sigterm_stops_the_bridge_promptly_with_exit_code_0(clean_store: LocalStack, tmp_path: Path) -> None:
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=2)
    with stack:
        bridge = stack.process("bridge")
        assert bridge.proc is not None
        enqueue(clean_store.store_url, split_tasks(4))
        time.sleep(2)
        started = time.monotonic()
        bridge.proc.send_signal(signal.SIGTERM)
        code = bridge.proc.wait(timeout=10)
        elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed < 5.0, f"took {elapsed:.1f}s"
    assert "bridge stopped" in bridge.log_path.read_text()


def test_a_rollout_stranded_between_dequeue_and_publish_is_republished(clean_store: LocalStack, tmp_path: Path) -> None:
    """Simulates a bridge that crashed right after dequeue: the attempt exists, no message carries it."""
    [rid] = enqueue(clean_store.store_url, split_tasks(1))
    claimed = httpx.post(
        f"{clean_store.store_url}{API}/queues/rollouts/dequeue",
        json={"limit": 1, "worker_id": "celery-bridge"},
        timeout=30,
    ).json()
    assert claimed and claimed[0]["rollout_id"] == rid
    stranded_attempt = claimed[0]["attempt"]["attempt_id"]
    # Heartbeats every second: reconcile confirms a stranded attempt after two heartbeats and 5 s.
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=2, extra_env={"HEARTBEAT_INTERVAL_S": "1"})
    with stack:
        view = wait_finished(clean_store.store_url, [rid], timeout_s=60)[rid]
        bridge_log = stack.process("bridge").log_path.read_text()
    assert view["status"] == "succeeded"
    assert view["attempt"]["attempt_id"] == stranded_attempt  # same attempt, run once
    assert len(attempts(clean_store.store_url, rid)) == 1
    assert "stranded" in bridge_log


class _RecordingPublisher:
    """Stands in for the broker so the test sees exactly which attempts reconcile re-publishes."""

    def __init__(self) -> None:
        self.published: list[str] = []

    agent = DEFAULT_AGENT

    def send(self, task: Task) -> None:
        self.published.append(task.task_id)  # the attempt id


def _quick_dispatcher(
    settings: Settings, store: StoreClient, client: redis.Redis
) -> tuple[V03Dispatcher, _RecordingPublisher]:
    """A dispatcher publishing to a recorder, confirming a suspect on a second scan 1 s after the first."""
    publisher = _RecordingPublisher()
    dispatcher = V03Dispatcher(settings, store, client, publisher)  # type: ignore[arg-type]
    dispatcher.confirm_s = 1.0
    return dispatcher, publisher


def test_reconcile_spares_leased_attempts_and_repairs_the_rest_only_when_confirmed(clean_store: LocalStack) -> None:
    """No `running` mark is sent by workers: a `preparing` attempt an executor holds the lease of is running."""
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    client = coordination_client(clean_store.broker_url)
    store = StoreClient(clean_store.store_url)
    enqueue(clean_store.store_url, split_tasks(2))
    claimed = store.dequeue(2, settings.dispatcher_id)
    running, stranded = (rollout.attempt.attempt_id for rollout in claimed)
    client.set(keys.lease(running), "some-executor", px=60_000)  # executing, no message in flight
    dispatcher, publisher = _quick_dispatcher(settings, store, client)
    try:
        assert dispatcher.reconcile() == 0  # first sight: only suspected
        assert publisher.published == []
        time.sleep(1.2)
        assert dispatcher.reconcile() == 1
        assert publisher.published == [stranded]  # never the leased one
        assert stranded in capacity.inflight_ids(client, dispatcher.scope, settings.default_queue)
    finally:
        client.delete(keys.lease(running))
        client.close()
        store.close()


def test_reconcile_frees_in_flight_entries_no_message_carries_and_hands_their_attempts_back(
    clean_store: LocalStack,
) -> None:
    """A bridge killed between recording the slot and the broker taking the message (or a failed publish
    whose clean-up failed too) leaves an in-flight entry with no message, no started marker, no lease."""
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    client = coordination_client(clean_store.broker_url)
    store = StoreClient(clean_store.store_url)
    queue, old = settings.default_queue, time.time() - settings.max_queue_wait_s - 5
    enqueue(clean_store.store_url, split_tasks(4))
    killed, cleanup_failed, young, running = store.dequeue(4, settings.dispatcher_id)
    store.update_rollout(cleanup_failed.rollout_id, status="requeuing")  # its hand-back went through
    for item, recorded in ((killed, old), (cleanup_failed, old), (young, time.time()), (running, old)):
        client.zadd(keys.inflight(clean_store.scope, queue), {item.attempt.attempt_id: recorded})
    client.set(keys.started(running.attempt.attempt_id), "1", px=60_000)
    client.set(keys.lease(running.attempt.attempt_id), "some-executor", px=60_000)
    dispatcher, publisher = _quick_dispatcher(settings, store, client)
    try:
        assert dispatcher.reconcile() == 0  # first sight: only suspected
        time.sleep(1.2)
        assert dispatcher.reconcile() == 1
        # The killed publish is repaired by the rule for stranded attempts: re-published while its attempt is
        # young enough to start in time (here, where only the entry was aged), else handed back.
        assert publisher.published == [killed.attempt.attempt_id]
        entries = capacity.inflight_entries(client, dispatcher.scope, queue)
        assert set(entries) == {killed.attempt.attempt_id, young.attempt.attempt_id, running.attempt.attempt_id}
        assert entries[killed.attempt.attempt_id] > old + 5  # recorded again by the new publish
        assert rollout(clean_store.store_url, cleanup_failed.rollout_id)["status"] == "requeuing"  # left alone
        assert rollout(clean_store.store_url, young.rollout_id)["status"] == "preparing"
        # the young entry's turn comes when it reaches the longest queue wait, not a minute later
        assert dispatcher.next_reconcile - time.monotonic() <= settings.max_queue_wait_s + 2
    finally:
        client.delete(keys.lease(running.attempt.attempt_id), keys.started(running.attempt.attempt_id))
        client.close()
        store.close()


RETRIES = {"max_attempts": 3, "retry_condition": ["failed"]}


def _post_span(store: StoreClient, claimed: AttemptedRollout, name: str) -> None:
    """One OTLP/HTTP span batch for ``claimed``'s attempt, encoded as the workers encode theirs."""
    telemetry = AttemptTelemetry(
        store, rollout_id=claimed.rollout_id, attempt_id=claimed.attempt.attempt_id, service_name="test"
    )
    try:
        with telemetry.span(name):
            pass
        telemetry.flush()
    finally:
        telemetry.close()


def _revive_after_failed_report(store: StoreClient, claimed: AttemptedRollout) -> None:
    """The hazard: a worker's span, its ``failed`` report (the retry policy requeues the rollout), then a span
    batch for the same attempt that the Store takes late (one the worker gave up on after a timeout)."""
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    _post_span(store, claimed, "step")
    store.update_attempt(rid, aid, status="failed")
    assert rollout(store.base_url, rid)["status"] == "requeuing"
    _post_span(store, claimed, "late")
    view = rollout(store.base_url, rid)
    assert (view["status"], view["attempt"]["attempt_id"], view["attempt"]["status"]) == ("running", aid, "failed")


def test_the_store_strands_a_rollout_a_late_span_revives_after_its_failed_report(clean_store: LocalStack) -> None:
    """The Store's side alone (docs/store-protocol.md 6.5): the late span makes the rollout ``running`` while its
    only attempt stays ``failed``, and no dequeue ever returns it; nothing in the Store finishes it."""
    store = StoreClient(clean_store.store_url)
    try:
        [rid] = enqueue(clean_store.store_url, [{"instruction": "x"}], config=RETRIES)
        [claimed] = store.dequeue(1, "some-worker")
        _revive_after_failed_report(store, claimed)
        assert store.dequeue(10, "some-worker") == []
        assert [a.status for a in store.list_attempts(rid)] == ["failed"]
        assert rollout(clean_store.store_url, rid)["status"] == "running"
    finally:
        store.close()


def test_reconcile_requeues_a_rollout_a_late_span_revived_and_spares_leased_and_cancelled_ones(
    clean_store: LocalStack,
) -> None:
    """Three rollouts revived by a late span: one nobody holds goes back to ``requeuing`` (what the retry policy
    had decided) once two scans saw it, and is dequeued for its second attempt; one whose attempt an executor
    still leases is left alone; one the trainer cancels between the scans stays cancelled."""
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    client = coordination_client(clean_store.broker_url)
    store = StoreClient(clean_store.store_url)
    enqueue(clean_store.store_url, [{"instruction": str(n)} for n in range(3)], config=RETRIES)
    revived, leased, cancelled = store.dequeue(3, "some-worker")
    for claimed in (revived, leased, cancelled):
        _revive_after_failed_report(store, claimed)
    client.set(keys.lease(leased.attempt.attempt_id), "some-executor", px=60_000)
    dispatcher, publisher = _quick_dispatcher(settings, store, client)
    try:
        assert dispatcher.reconcile() == 0  # first sight: only suspected
        assert rollout(clean_store.store_url, revived.rollout_id)["status"] == "running"
        store.update_rollout(cancelled.rollout_id, status="cancelled")
        time.sleep(1.2)
        assert dispatcher.reconcile() == 1
        assert rollout(clean_store.store_url, revived.rollout_id)["status"] == "requeuing"
        assert rollout(clean_store.store_url, leased.rollout_id)["status"] == "running"
        assert rollout(clean_store.store_url, cancelled.rollout_id)["status"] == "cancelled"
        assert publisher.published == []
        [retry] = store.dequeue(10, "some-worker")
        assert retry.rollout_id == revived.rollout_id and retry.attempt.sequence_id == 2
    finally:
        client.delete(keys.lease(leased.attempt.attempt_id))
        client.close()
        store.close()


def test_the_bridge_process_recovers_a_rollout_a_late_span_revived_and_a_worker_runs_its_retry(
    clean_store: LocalStack, tmp_path: Path
) -> None:
    """End to end: the hazard made against the real Store, then a bridge and a worker started; the bridge's
    reconcile requeues the rollout and the worker runs its second attempt to the end."""
    store = StoreClient(clean_store.store_url)
    try:
        [rid] = enqueue(clean_store.store_url, split_tasks(1), config=RETRIES)
        [claimed] = store.dequeue(1, "some-worker")
        _revive_after_failed_report(store, claimed)
    finally:
        store.close()
    # Heartbeats every second: reconcile confirms after two heartbeats and 5 s.
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=2, extra_env={"HEARTBEAT_INTERVAL_S": "1"})
    with stack:
        view = wait_finished(clean_store.store_url, [rid], timeout_s=90)[rid]
        bridge_log = stack.process("bridge").log_path.read_text()
    assert view["status"] == "succeeded", view
    assert [a["status"] for a in attempts(clean_store.store_url, rid)] == ["failed", "succeeded"]
    assert "as the Store's retry policy would" in bridge_log


def test_a_timeout_the_broker_cannot_cover_is_clamped_at_publish(clean_store: LocalStack) -> None:
    """A rollout whose hard limit plus the queue wait would pass the visibility timeout would be handed to a
    second worker while it runs: its message carries the longest timeout the broker covers instead."""
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    client = redis.Redis.from_url(clean_store.broker_url)
    store = StoreClient(clean_store.store_url)
    enqueue(clean_store.store_url, split_tasks(2), config={"timeout_seconds": 20_000})
    enqueue(clean_store.store_url, split_tasks(1), config={"timeout_seconds": 600})
    queue = f"test-clamp-{uuid.uuid4().hex[:8]}"
    try:
        for claimed in store.dequeue(3, settings.dispatcher_id):
            Publisher(settings).send(rollout_task(claimed, queue, settings, settings.agent))
        messages = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
        assert len(messages) == 3
        for message in messages:
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            timeout = kwargs["rollout"]["config"]["timeout_seconds"]
            hard, soft = message["headers"]["timelimit"]  # Celery message protocol 2: [time_limit, soft]
            assert hard + settings.max_queue_wait_s < settings.visibility_timeout_s
            assert hard == hard_time_limit(settings, timeout) and soft == soft_time_limit(settings, timeout)
        assert sorted(
            json.loads(base64.b64decode(m["body"]))[1]["rollout"]["config"]["timeout_seconds"] for m in messages
        ) == [
            600,
            pytest.approx(longest_timeout_s(settings)),
            pytest.approx(longest_timeout_s(settings)),
        ]
    finally:
        client.delete(queue)
        client.close()
        store.close()


def test_the_bridge_warns_at_start_when_online_workers_run_another_agent(
    clean_store: LocalStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A bridge left at the built-in agent beside LitAgent workers (or the reverse) says so when it starts."""
    from bridge.dispatch.v03.service import _warn_about_other_agents

    client = coordination_client(clean_store.broker_url)
    nodes = {f"celery@test-{uuid.uuid4().hex[:6]}": agent for agent in ("pkg.agents:CalcAgent", "webshop")}
    try:
        for node, agent in nodes.items():
            capacity.advertise(client, clean_store.scope, node, ["rollouts"], 2)
            client.set(keys.worker_agent(clean_store.scope, node), agent, ex=60)
        for bridge_agent, named in (("webshop", "pkg.agents:CalcAgent"), ("pkg.agents:make_agent", "'webshop'")):
            caplog.clear()
            settings = load_settings(
                store_url=clean_store.store_url, broker_url=clean_store.broker_url, agent=bridge_agent
            )
            with caplog.at_level("WARNING", logger="bridge"):
                _warn_about_other_agents(client, settings)
            [record] = [r.getMessage() for r in caplog.records if "set the same AGENT" in r.getMessage()]
            assert f"AGENT={bridge_agent}" in record and named in record and record.count(" runs ") == 1, record
    finally:
        for node in nodes:
            capacity.withdraw(client, clean_store.scope, node, ["rollouts"])
            client.delete(keys.worker_agent(clean_store.scope, node))
