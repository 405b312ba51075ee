"""The bridge process on its own: backpressure, clean SIGTERM, repair of rollouts stranded by a crash."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from bridge.core import capacity, keys
from bridge.core.models import AttemptedRollout
from bridge.core.settings import load_settings
from bridge.core.store import API, StoreClient
from bridge.dispatch.dispatcher import Dispatcher
from bridge.tools.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, split_tasks, stack_for, wait_finished

pytestmark = pytest.mark.integration


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

    def publish(self, rollout: AttemptedRollout, queue: str) -> None:
        self.published.append(rollout.attempt.attempt_id)


def test_reconcile_spares_leased_attempts_and_repairs_the_rest_only_when_confirmed(clean_store: LocalStack) -> None:
    """No `running` mark is sent by workers: a `preparing` attempt an executor holds the lease of is running."""
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    client = redis.Redis.from_url(clean_store.broker_url)
    store = StoreClient(clean_store.store_url)
    enqueue(clean_store.store_url, split_tasks(2))
    claimed = store.dequeue(2, settings.dispatcher_id)
    running, stranded = (rollout.attempt.attempt_id for rollout in claimed)
    client.set(keys.lease(running), "some-executor", px=60_000)  # executing, no message in flight
    publisher = _RecordingPublisher()
    dispatcher = Dispatcher(settings, store, client, publisher)  # type: ignore[arg-type]
    dispatcher.confirm_s = 1.0
    try:
        assert dispatcher.reconcile() == 0  # first sight: only suspected
        assert publisher.published == []
        time.sleep(1.2)
        assert dispatcher.reconcile() == 1
        assert publisher.published == [stranded]  # never the leased one
        assert stranded in capacity.inflight_ids(client, settings.default_queue)
    finally:
        client.delete(keys.lease(running))
        client.close()
        store.close()
