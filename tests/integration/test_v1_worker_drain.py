"""A worker drained by SIGTERM with ``WORKER_SHUTDOWN_GRACE_S`` while it runs 1.0 programs (``workers.v1.attempt``),
under ``-P threads`` and ``-P prefork``: real worker nodes and Redis, a stub gateway (``tests/stub_gateway.py``).

At the drain's stop time each running program's process group is killed and the attempt handed over: a hand-over
record for the dispatcher (``{"state": null, "handover": true, "failure_class": "shutdown"}``), the done marker,
the slot freed, and nothing reported to the gateway; the node exits within its grace. A message such a node would
start after its drain began goes back to the broker instead: ``tests/unit/test_v1_task.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.gateway import V1_TASK_NAME, V1Rollout, attempt_key, scoped_attempt_key
from bridge_lab.stack import LocalStack
from tests.helpers import program_alive, stack_for, wait_for
from tests.stub_gateway import StubGateway

pytestmark = [pytest.mark.integration, pytest.mark.cost(40)]

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "rollouts"
GRACE_S = 9.0
SLACK_S = 1.5


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_drained_worker_hands_its_1_0_attempts_over(
    services: LocalStack, tmp_path: Path, outbox: Path, pool: str
) -> None:
    scope = f"v1drain-{uuid.uuid4().hex[:8]}"
    with StubGateway().serving() as gateway:
        env = {
            "AGL_V1_SERVER_URL": gateway.url,
            "AGL_V1_KEY": "k",
            "REDIS_KEY_SCOPE": scope,
            "WORKER_SHUTDOWN_GRACE_S": str(GRACE_S),
            "HEARTBEAT_INTERVAL_S": "1",
            "LEASE_TTL_S": "4",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        stack = stack_for(
            services, tmp_path, workers=1, concurrency=2, pool=pool, bridge=False, store=False, extra_env=env
        )
        client = coordination_client(services.redis_url or services.broker_url)
        with stack:
            rollout = gateway.add(
                f"drain-{uuid.uuid4().hex[:6]}",
                "tests.agl_v1_agents:Sleeping",
                created_at=5.0,
                task_input={"pid_file": str(outbox / "pids")},
                env_map={"PID_FILE": "input.pid_file"},  # a program's environment is clean: never the worker's
            )
            rid = rollout["rollout_id"]
            task_id = attempt_key(rid, "0")
            state_key = scoped_attempt_key(scope, V1Rollout.model_validate(rollout), "0")
            capacity.mark_inflight(client, scope, QUEUE, task_id)  # as the dispatcher publishes it
            sender = Celery(broker=stack.broker_url)
            sender.send_task(
                V1_TASK_NAME,
                kwargs={"rollout": rollout, "attempt_id": "0", "queue": QUEUE},
                task_id=task_id,
                queue=QUEUE,
            )
            pid_file = outbox / "pids"
            wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 3, 30, "the program started")
            assert client.exists(keys.lease(state_key))

            drained = stack.workers[0]
            assert drained.proc is not None
            signalled = time.monotonic()
            drained.signal(signal.SIGTERM)  # the main process only, as Kubernetes does
            drained.proc.wait(timeout=GRACE_S + 5)
            exited = time.monotonic() - signalled

            kept = client.get(keys.v1_result(state_key))
            assert kept is not None, "no hand-over record"
            record = json.loads(kept)
            assert record["state"] is None and record["handover"] is True, record
            assert record["failure_class"] == "shutdown" and f"grace {GRACE_S:g} s" in record["detail"], record
            assert client.get(keys.done(state_key)) == "handover"
            assert not client.exists(keys.lease(state_key))
            assert gateway.final_patches(rid) == []  # never reported failed
            assert not program_alive(pid_file), "the program or its child outlived the drain"
            assert capacity.inflight_count(client, scope, QUEUE) == 0, "the slot was not freed"
            sender.close()
    print(f"{pool}: exited {exited:.2f} s after SIGTERM")
    assert exited <= GRACE_S + SLACK_S
