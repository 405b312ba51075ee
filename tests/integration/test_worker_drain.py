"""A worker drained by SIGTERM with ``WORKER_SHUTDOWN_GRACE_S`` shorter than its episodes (``workers.drain``),
under ``-P prefork``: real worker nodes, Store, bridge and Redis.

The node's adverts go at once, its running attempts are stopped at the grace less the reporting margin and
handed over (``failed`` with class ``shutdown`` where the Store retries that, else the rollout handed back),
the process exits within the grace, and a second node runs every rollout to ``succeeded`` exactly once, with
nothing left in the bridge's in-flight accounting. Prefork is the pool tested here: its attempts run in pool
children that only learn of the drain through Redis and are interrupted by SIGUSR1; under ``-P threads`` the
attempts run in the signalled process, and ``tests/unit/test_worker_drain.py`` covers what differs there.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bridge.core import capacity, keys
from bridge.core.coordination import coordination_client
from bridge.tools.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, stack_for, wait_finished, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cost(60)]

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "rollouts"
GRACE_S = 9.0
SLACK_S = 1.0


def test_a_drained_worker_hands_its_episodes_over_within_its_grace(clean_store: LocalStack, tmp_path: Path) -> None:
    env = {
        "AGENT": "tests.agents_for_tests:SlowFirstAgent",
        "WORKER_SHUTDOWN_GRACE_S": str(GRACE_S),
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=3, pool="prefork", extra_env=env)
    client = coordination_client(clean_store.broker_url)
    with stack:
        url = stack.store_url
        retried = {"max_attempts": 2, "retry_condition": ["failed"]}
        inputs = [{"question": "What is 1 + 1?", "reward": r, "sleep": 60} for r in (0.25, 0.5)]
        ids = enqueue(url, inputs, config=retried)
        # No retry left for a failed attempt: handed back to the Store queue instead of ending failed.
        ids += enqueue(url, [{"question": "What is 2 + 2?", "reward": 0.75, "sleep": 60}], config={"max_attempts": 1})
        rewards = dict(zip(ids, (0.25, 0.5, 0.75), strict=True))
        wait_for(lambda: all(_leased(client, url, rid) for rid in ids), 30, "every first attempt started")
        first = {rid: rollout(url, rid)["attempt"]["attempt_id"] for rid in ids}

        drained = stack.workers[0]
        assert drained.proc is not None
        signalled = time.monotonic()
        drained.signal(signal.SIGTERM)  # the main process only, as Kubernetes does
        wait_for(lambda: capacity.total_slots(client, stack.scope, QUEUE) == 0, 1.5, "the adverts gone at once")
        adverts_gone = time.monotonic() - signalled
        drained.proc.wait(timeout=GRACE_S + 5)
        exited = time.monotonic() - signalled

        stack.add_worker()
        final = wait_finished(url, ids, timeout_s=60)
        rerun = time.monotonic() - signalled
        for rid in ids:
            tried = attempts(url, rid)
            assert final[rid]["status"] == "succeeded", (final[rid], tried)
            assert final[rid]["attempt"]["metadata"]["reward"] == rewards[rid]
            assert [a["status"] for a in tried].count("succeeded") == 1, tried
            assert final[rid]["attempt"]["attempt_id"] != first[rid]  # the trainer reads the second attempt
            stopped = next(a for a in tried if a["attempt_id"] == first[rid])
            if rid in ids[:2]:
                assert stopped["status"] == "failed", stopped
                assert stopped["metadata"]["failure_class"] == "shutdown", stopped
                assert f"grace {GRACE_S:g} s" in stopped["metadata"]["error"]
            else:  # handed back: the attempt is left as the Store had it, never reported failed
                assert stopped["status"] in ("preparing", "running"), stopped
        wait_for(lambda: capacity.inflight_count(client, stack.scope, QUEUE) == 0, 10, "nothing left in flight")
    print(f"adverts gone {adverts_gone:.2f} s, exited {exited:.2f} s, all succeeded again {rerun:.2f} s after SIGTERM")
    assert exited <= GRACE_S + SLACK_S


def _leased(client: object, store_url: str, rollout_id: str) -> bool:
    attempt = rollout(store_url, rollout_id).get("attempt") or {}
    return bool(attempt.get("attempt_id")) and bool(client.exists(keys.lease(attempt["attempt_id"])))  # type: ignore[attr-defined]
