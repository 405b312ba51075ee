"""The bridge process on its own: backpressure, clean SIGTERM, repair of rollouts stranded by a crash."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from bridge.stack import LocalStack
from tests.conftest import stack_for
from tests.helpers import API, attempts, enqueue, rollout, split_tasks, wait_finished

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
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=2)
    with stack:
        view = wait_finished(clean_store.store_url, [rid], timeout_s=60)[rid]
        bridge_log = stack.process("bridge").log_path.read_text()
    assert view["status"] == "succeeded"
    assert view["attempt"]["attempt_id"] == stranded_attempt  # same attempt, run once
    assert len(attempts(clean_store.store_url, rid)) == 1
    assert "stranded" in bridge_log
