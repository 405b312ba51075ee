"""The attempt's description is read once from the payload and never changes; outcomes and kept reports carry
enums whose JSON is the plain strings the Store, Flower and ``workers.lifecycle.metrics`` read."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest
import redis
from kombu.utils.json import dumps as kombu_dumps

from bridge.core.settings import load_settings
from bridge.core.store import AttemptStatus, StoreClient
from bridge.core.task import Outcome, OutcomeStatus
from workers.execution import AttemptRun
from workers.lifecycle.resources import WorkerResources
from workers.protocol import clock
from workers.protocol.attempt import Attempt, Rejected, read_payload
from workers.protocol.failures import FailureClass
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.protocol.reporting import PendingReport
from workers.telemetry.courier import TraceCourier


def _payload(start: float) -> dict[str, Any]:
    return {
        "rollout_id": "ro-1",
        "input": {"instruction": "buy a lamp"},
        "start_time": start,
        "status": "preparing",
        "attempt": {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "start_time": start},
    }


def test_the_attempt_is_read_once_from_the_payload_and_cannot_change() -> None:
    start = time.time() - 30.0
    attempt = read_payload(_payload(start), celery_task_id="at-1", expected_agent="webshop")
    assert isinstance(attempt, Attempt)
    assert (attempt.rollout_id, attempt.attempt_id, attempt.expected_agent) == ("ro-1", "at-1", "webshop")
    assert attempt.rollout is not None and attempt.rollout.attempt.sequence_id == 1
    assert attempt.dequeued_at == pytest.approx(clock.to_local(start))
    assert attempt.started >= attempt.dequeued_at
    with pytest.raises(dataclasses.FrozenInstanceError):
        attempt.dequeued_at = time.time()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        attempt.expected_agent = "other"  # type: ignore[misc]


def test_a_run_and_its_collaborators_share_the_one_attempt() -> None:
    attempt = read_payload(_payload(time.time()), celery_task_id="at-1", expected_agent=None)
    assert isinstance(attempt, Attempt)
    url = "http://127.0.0.1:9"
    settings = load_settings(store_url=url, lease_ttl_s=4, heartbeat_interval_s=1)
    store = StoreClient(url, retries=0, timeout_s=1)
    client = redis.Redis(port=9)  # never reached: building a run talks to nobody
    res = WorkerResources(settings, store, client, None, HeartbeatMonitor(store, client), TraceCourier(store), 0)  # type: ignore[arg-type]
    try:
        run = AttemptRun(attempt, res)
        assert run.reporter.attempt is attempt and run.guard.attempt is attempt
        assert run.guard.lease is run.lease and run.lease.lease_id == "at-1"
        assert run.reporter.guard is run.guard
        unparsed = dataclasses.replace(attempt, rollout=None)
        with pytest.raises(ValueError):
            AttemptRun(unparsed, res)
    finally:
        res.monitor.close()
        store.close()


def test_a_payload_that_is_no_rollout_is_rejected_with_its_ids_when_it_names_them() -> None:
    named = read_payload(
        {"rollout_id": "ro-1", "attempt": {"attempt_id": "at-1"}}, celery_task_id="t", expected_agent=None
    )
    assert isinstance(named, Rejected) and named.attempt is not None
    assert (named.attempt.rollout_id, named.attempt.attempt_id, named.attempt.rollout) == ("ro-1", "at-1", None)
    assert named.message.startswith("task payload is not an AttemptedRollout")
    anonymous = read_payload(["not", "a", "dict"], celery_task_id="t", expected_agent=None)
    assert isinstance(anonymous, Rejected) and anonymous.attempt is None


def test_the_task_result_is_plain_json_strings() -> None:
    outcome = Outcome(OutcomeStatus.FAILED, "bad input", FailureClass.INPUT)
    result = outcome.as_dict()
    assert result == {"status": "failed", "reason": "bad input", "failure_class": "input"}
    assert all(type(value) is str for value in result.values())  # no enum objects reach Celery or Flower
    expected = '{"status": "failed", "reason": "bad input", "failure_class": "input"}'
    assert json.dumps(result) == expected and kombu_dumps(result) == expected
    assert Outcome(OutcomeStatus.SUCCEEDED, reward=0.0).as_dict() == {"status": "succeeded", "reward": 0.0}
    assert Outcome(OutcomeStatus.SKIPPED, "duplicate").as_dict() == {"status": "skipped", "reason": "duplicate"}


def test_a_kept_report_round_trips_with_its_failure_class() -> None:
    metadata = {"error": "boom", "failure_class": str(FailureClass.LLM)}
    report = PendingReport(AttemptStatus.FAILED, metadata, deadline=123.5)
    assert (
        report.to_json()
        == '{"status": "failed", "metadata": {"error": "boom", "failure_class": "llm"}, "deadline": 123.5}'
    )
    kept = PendingReport.from_json(report.to_json())
    assert kept == report and kept.failure_class is FailureClass.LLM
    assert kept.outcome() == Outcome(OutcomeStatus.FAILED, "boom", FailureClass.LLM)
    succeeded = PendingReport(AttemptStatus.SUCCEEDED, {"reward": 1.0}, deadline=1.0)
    assert succeeded.failure_class is None and succeeded.outcome() == Outcome(OutcomeStatus.SUCCEEDED, reward=1.0)
