"""A duplicate delivery of a running attempt leaves the live execution's slot counted.

The in-flight entry the bridge counts slots with is keyed by attempt id, shared by every delivery of the
attempt. A duplicate message that the worker discards (expired in the broker: a Celery retry keeps the
original ``expires``, so a duplicate that waited out the live lease arrives expired) must not clear it while
another executor runs the attempt, or the bridge would claim one rollout more than the workers can run.

Real Redis, Store, worker and bridge; the duplicate is a real Celery message with the attempt's task id.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from celery import Celery

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.task import TASK_NAME
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, slow_episode_stack, split_tasks, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(14)]

LLM_LATENCY_MS = 700.0  # an episode of about 5 s


@pytest.fixture
def slow_stack(clean_store: LocalStack, tmp_path: Path) -> Iterator[LocalStack]:
    env = {"HEARTBEAT_INTERVAL_S": "1", "SPAN_FLUSH_INTERVAL_S": "0.5"}
    with slow_episode_stack(clean_store, tmp_path, LLM_LATENCY_MS, env) as stack:
        yield stack


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _queue_of(client: redis.Redis, scope: str, attempt_id: str) -> str | None:
    for name in client.scan_iter(match=keys.inflight(scope, "*")):
        queue = name.removeprefix(keys.inflight(scope, ""))
        if attempt_id in capacity.inflight_ids(client, scope, queue):
            return queue
    return None


def test_an_expired_duplicate_of_a_running_attempt_keeps_its_slot(slow_stack: LocalStack) -> None:
    store, client = slow_stack.store_url, coordination_client(slow_stack.broker_url)
    [rid] = enqueue(store, split_tasks(1))
    _wait(lambda: attempts(store, rid) and attempts(store, rid)[-1]["status"] == "running", 60, "a running attempt")
    view = rollout(store, rid)
    aid = view["attempt"]["attempt_id"]
    scope = slow_stack.scope
    queue = _queue_of(client, scope, aid)
    assert queue is not None and client.exists(keys.lease(aid))
    app = Celery("duplicate", broker=slow_stack.broker_url)
    app.conf.update(task_serializer="json", accept_content=["json"], task_create_missing_queues=True)
    app.send_task(
        TASK_NAME,
        kwargs={"rollout": view, "queue": queue},
        task_id=aid,
        queue=queue,
        expires=datetime.now(UTC) - timedelta(seconds=5),
    )
    log = slow_stack.workers[0].log_path
    _wait(lambda: f"Discarding revoked task: {TASK_NAME}[{aid}]" in log.read_text(), 20, "the duplicate discarded")
    if client.exists(keys.lease(aid)):  # the live execution still runs: its slot must still be counted
        assert aid in capacity.inflight_ids(client, scope, queue)
    else:
        pytest.fail("the episode ended before the duplicate was discarded: make the LLM slower")
    finished = wait_finished(store, [rid], timeout_s=120)
    assert finished[rid]["status"] == "succeeded"
    assert len(attempts(store, rid)) == 1
    assert aid not in capacity.inflight_ids(client, scope, queue)  # freed by the executor that ran it
