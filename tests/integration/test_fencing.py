"""Fencing without a Store read per start and report: what the trainer sees must not change.

A worker judges its attempt on a view of the rollout at most FENCE_MAX_AGE_S old (the dequeue answer,
then every heartbeat's read). These run real workers against the real Store with a slow LLM stand-in,
so the episodes are long enough to change the rollout under them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bridge.core.store import API
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, slow_episode_stack, split_tasks

pytestmark = [pytest.mark.integration, pytest.mark.cost(17)]

LLM_LATENCY_MS = 700.0  # 7 steps or so: an episode of about 5 s


@pytest.fixture
def slow_stack(clean_store: LocalStack, tmp_path: Path) -> Iterator[LocalStack]:
    with slow_episode_stack(clean_store, tmp_path, LLM_LATENCY_MS, {"HEARTBEAT_INTERVAL_S": "1"}) as stack:
        yield stack


def _wait_started(store_url: str, rollout_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if attempts(store_url, rollout_id):
            return
        time.sleep(0.1)
    raise AssertionError(f"{rollout_id} was never dequeued")


def test_a_rollout_cancelled_mid_episode_stays_cancelled(slow_stack: LocalStack) -> None:
    store = slow_stack.store_url
    [rid] = enqueue(store, split_tasks(1))
    _wait_started(store, rid)
    time.sleep(1.5)  # running, far from its end
    httpx.post(f"{store}{API}/rollouts/{rid}", json={"status": "cancelled"}, timeout=30).raise_for_status()
    time.sleep(LLM_LATENCY_MS / 1000 * 10)  # longer than the whole episode would have taken
    view = rollout(store, rid)
    [attempt] = attempts(store, rid)
    log = "".join(worker.log_path.read_text() for worker in slow_stack.workers)
    assert view["status"] == "cancelled"  # a late `succeeded` would have flipped it (docs/store-protocol.md 6.5)
    assert attempt["status"] not in ("succeeded", "failed")  # nothing was reported
    assert "rollout is cancelled" in log
