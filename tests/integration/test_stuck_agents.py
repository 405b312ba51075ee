"""An agent that blocks outside its LLM calls, under ``-P threads`` (``workers.lifecycle.stuck``): real worker, Store,
bridge and Redis.

The agent waits forever on an event when its input says ``block``. At the attempt's deadline the worker
reports it ``failed`` (``timeout``) without waiting for the thread; on a cancel it stops without reporting.
Each abandoned thread takes one slot off the node's advert and shows in ``status``, and at
``MAX_STUCK_AGENT_THREADS`` (2 here) the worker drains and re-executes itself, after which it has its slots
back and runs rollouts again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.ops import status
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, cancel_unfinished, enqueue, rollout, stack_for, wait_finished, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cost(70)]

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 2
QUEUE = "rollouts"


def test_a_blocking_agent_is_abandoned_counted_and_the_worker_restarts_itself(
    clean_store: LocalStack, tmp_path: Path
) -> None:
    env = {
        "AGENT": "tests.agents_for_tests:BlockingAgent",
        "MAX_STUCK_AGENT_THREADS": "2",
        "HEARTBEAT_INTERVAL_S": "1",
        "LLM_RETURN_TOKEN_IDS": "true",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=SLOTS, pool="threads", extra_env=env)
    client = coordination_client(clean_store.broker_url)
    with stack:
        url = stack.store_url
        # 1. At the deadline: failed (timeout) at once, one slot fewer advertised.
        [blocked] = enqueue(url, [{"block": True}], config={"max_attempts": 1, "timeout_seconds": 10})
        final = wait_finished(url, [blocked], timeout_s=30)[blocked]
        meta = final["attempt"]["metadata"] or {}
        assert final["status"] == "failed" and meta.get("failure_class") == "timeout", final
        assert "its thread was abandoned" in meta["error"], meta
        wait_for(lambda: capacity.total_slots(client, stack.scope, QUEUE) == SLOTS - 1, 15, "one slot fewer advertised")
        settings = load_settings(store_url=url, broker_url=clean_store.broker_url)
        with StoreClient.from_settings(settings) as store:
            report = status.collect(settings, store, client, inspect=False)
        [node] = report["workers"]
        assert node["stuck_threads"] == 1, node
        assert "! 1 agent threads stuck past their deadline" in status.render(report)

        # The worker goes on with the slot it has left.
        [fine] = enqueue(url, [{"question": "What is 1 + 1?", "reward": 0.5}])
        assert wait_finished(url, [fine], timeout_s=30)[fine]["status"] == "succeeded"

        # 2. On a cancel: stops unreported; the second stuck thread reaches the threshold: drain and restart.
        [cancelled] = enqueue(url, [{"block": True}], config={"max_attempts": 1, "timeout_seconds": 600})
        wait_for(lambda: _leased(client, url, cancelled), 20, "the blocking attempt started")
        cancel_unfinished(url)
        log = tmp_path / "worker1.log"
        wait_for(lambda: "draining this worker and restarting it" in log.read_text(), 20, "the worker drains")
        wait_for(lambda: log.read_text().count(f"offers {SLOTS} slots") >= 2, 60, "the worker came back")
        wait_for(lambda: capacity.total_slots(client, stack.scope, QUEUE) == SLOTS, 15, "all its slots back")
        assert stack.workers[0].alive()  # the same process, re-executed

        [after] = enqueue(url, [{"question": "What is 2 + 2?", "reward": 0.25}])
        done = wait_finished(url, [after], timeout_s=60)[after]
        assert done["status"] == "succeeded" and done["attempt"]["metadata"]["reward"] == 0.25
    assert rollout(url, cancelled)["status"] == "cancelled"
    assert [a["status"] for a in attempts(url, cancelled)] == ["preparing"]  # never reported into


def _leased(client: redis.Redis, store_url: str, rollout_id: str) -> bool:
    attempt = rollout(store_url, rollout_id).get("attempt") or {}
    return bool(attempt.get("attempt_id")) and bool(client.exists(keys.lease(attempt["attempt_id"])))
