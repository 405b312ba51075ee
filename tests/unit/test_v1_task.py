"""The 1.0 task (``workers.v1.task``) beside the 0.3 one: a draining node hands an unstarted message back to the
broker, and the worker's metrics count 1.0 deliveries with their failure class."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Reject
from celery.signals import task_postrun

from bridge.core.settings import Settings
from workers.lifecycle import metrics
from workers.lifecycle.steps import task_metrics
from workers.protocol import held as protocol
from workers.v1 import task as v1_task


def test_a_draining_worker_returns_an_unstarted_1_0_message_to_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(agl_v1_url="http://127.0.0.1:9", redis_key_scope="unit")
    monkeypatch.setattr(protocol, "draining", lambda client, scope, node: True)
    monkeypatch.setattr(v1_task, "get_coordination", lambda: (settings, None))
    started: list[Any] = []
    monkeypatch.setattr(v1_task, "V1Attempt", lambda *a, **k: started.append(a))
    rollout = {"rollout_id": "never", "config": {"local": {"agent_class": "tests.agl_v1_agents:Quick"}}}
    with pytest.raises(Reject) as rejected:
        v1_task.run_v1_rollout.run(rollout, "0", "rollouts")
    assert rejected.value.requeue is True
    assert started == []


def test_the_worker_metrics_count_1_0_deliveries_by_outcome_and_failure_class() -> None:
    def count() -> float:
        return metrics.ROLLOUTS.labels("failed", "agent")._value.get()

    task_metrics.TaskMetrics(None).create(None)  # hooks the task signals, as a starting worker does
    before = count()
    retval = {"status": "failed", "reason": "the agent exited with code 1", "failure_class": "agent"}
    task_postrun.send(sender=v1_task.run_v1_rollout, retval=retval, state="SUCCESS")  # as Celery sends it
    assert count() == before + 1
