"""The one outcome record both lines write (``bridge.core.task.outcome``): an error keeps its first line and its tail on
both lines, the failure-class prefix is written and read by one rule, every detail is masked, and the record
survives its codecs (1.0's kept record, 0.3's kept Store report, the task's result)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.gateway import GatewayClient, Malformed, V1State
from bridge.core.settings import load_settings
from bridge.core.store import AttemptStatus, StoreClient
from bridge.core.task import (
    DETAIL_CHARS,
    ERROR_CHARS,
    HEADLINE_CHARS,
    FailureClass,
    Outcome,
    OutcomeStatus,
    error_text,
    failed_message,
    failure_class_of,
)
from bridge_lab.chaos.v1 import _failure_class
from workers.execution import AttemptRun
from workers.lifecycle.resources import WorkerResources
from workers.protocol.attempt import Attempt, read_payload
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.protocol.reporting import PendingReport
from workers.telemetry.courier import TraceCourier

HEAD = "ValueError: the agent's tool call failed"
TAIL = "the last line the program wrote"


def _long_error() -> str:
    """A first line, a long middle, a last line: what a traceback or a program's output looks like."""
    return HEAD + "\n" + "\n".join(f"middle line {i} " + "." * 60 for i in range(200)) + "\n" + TAIL


def test_an_error_keeps_its_first_line_and_its_tail_never_its_middle() -> None:
    text = error_text(_long_error())
    assert len(text) <= ERROR_CHARS
    assert text.startswith(HEAD + "\n") and text.endswith(TAIL)
    assert "middle line 0 " not in text
    single = "x" * (ERROR_CHARS + 10)
    assert error_text(single) == single[:ERROR_CHARS]
    long_head = "h" * 1000 + "\n" + TAIL
    assert error_text(long_head) == "h" * HEADLINE_CHARS + "\n" + TAIL


def _reporter_metadata(error: str, redis_client: redis.Redis) -> dict[str, Any]:
    """The metadata a 0.3 attempt's failure report carries to the Store, as the reporter keeps it in Redis for every
    delivery (no lease is held here, so this one is withheld and nothing reaches a Store)."""
    aid = f"at-{uuid.uuid4().hex[:8]}"
    payload = {
        "rollout_id": "ro-1",
        "input": {"instruction": "buy a lamp"},
        "start_time": 1.0,
        "status": "preparing",
        "attempt": {"rollout_id": "ro-1", "attempt_id": aid, "sequence_id": 1, "start_time": 1.0},
    }
    attempt = read_payload(payload, celery_task_id=aid, expected_agent=None)
    assert isinstance(attempt, Attempt)
    url = "http://127.0.0.1:9"
    settings = load_settings(store_url=url, lease_ttl_s=4, heartbeat_interval_s=1)
    store = StoreClient(url, retries=0, timeout_s=1)
    monitor = HeartbeatMonitor(store, redis_client)
    res = WorkerResources(settings, store, redis_client, None, monitor, TraceCourier(store), 0)  # type: ignore[arg-type]
    try:
        AttemptRun(attempt, res).reporter.failure(FailureClass.AGENT, error)
        kept = PendingReport.from_json(redis_client.get(keys.pending_report(aid)))
    finally:
        redis_client.delete(keys.pending_report(aid))
        monitor.close()
        store.close()
    assert kept is not None and kept.failure_class is FailureClass.AGENT
    return {**kept.metadata, "status": str(kept.status)}


def test_a_03_failure_sends_the_store_the_errors_first_line_and_its_tail(redis_client: redis.Redis) -> None:
    metadata = _reporter_metadata(_long_error(), redis_client)
    assert metadata["status"] == "failed" and metadata["failure_class"] == "agent"
    assert metadata["error"].startswith(HEAD) and metadata["error"].endswith(TAIL), metadata["error"][-80:]
    assert len(metadata["error"]) <= ERROR_CHARS


def test_a_03_failure_is_masked_by_the_record(redis_client: redis.Redis) -> None:
    metadata = _reporter_metadata("LLM refused: api_key=sk-live-123 at https://u:pw@llm.test/v1", redis_client)
    assert "sk-live-123" not in metadata["error"] and ":pw@" not in metadata["error"], metadata["error"]


def test_a_10_failure_sends_the_gateway_the_errors_first_line_and_its_tail() -> None:
    """Both ways a 1.0 failure reaches the gateway: ``finish`` (a worker's, a dispatcher's) and ``fail_malformed``."""
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            rollout = {"rollout_id": "r1", "status": {"state": "running", "last_attempt_id": "0"}}
            return httpx.Response(200, json={"rollout": rollout})
        sent.append(json.loads(request.content)["status"])
        return httpx.Response(200, json={"rollout_id": "r1", "status": {"state": "failed"}})

    http = httpx.Client(base_url="http://gateway.test", transport=httpx.MockTransport(answer))
    client = GatewayClient("http://gateway.test", key=None, retries=0, http=http)
    try:
        reason = "invalid rollout: " + _long_error()
        assert client.fail_malformed(Malformed("r1", "queuing", reason))
        assert client.finish("r1", "0", V1State.FAILED, _long_error())
    finally:
        client.close()
    malformed, finished = (status["error_message"] for status in sent)
    assert malformed.startswith("invalid rollout: " + HEAD) and malformed.endswith(TAIL)
    assert finished.startswith(HEAD) and finished.endswith(TAIL)
    assert max(len(malformed), len(finished)) <= ERROR_CHARS


@pytest.mark.parametrize("failure_class", list(FailureClass))
def test_the_failure_class_prefix_is_written_and_read_by_one_rule(failure_class: FailureClass) -> None:
    outcome = Outcome(OutcomeStatus.FAILED, _long_error(), failure_class)
    message = outcome.message()
    assert message.startswith(f"[failure class: {failure_class}] {HEAD}") and message.endswith(TAIL)
    assert len(message) <= ERROR_CHARS
    assert failure_class_of(message) == failure_class and _failure_class(message) == failure_class
    assert message == failed_message(str(failure_class), outcome.detail)  # the dispatcher's wording is the worker's


def test_a_message_without_a_class_names_none() -> None:
    assert failure_class_of("the agent exited with code 1") is None
    assert failure_class_of(failed_message(None, "boom")) is None
    assert Outcome(OutcomeStatus.SUCCEEDED, "the agent exited with code 0").message() == "the agent exited with code 0"


def test_every_detail_is_masked_and_bounded_when_the_record_is_made() -> None:
    outcome = Outcome(OutcomeStatus.SKIPPED, "not run: token=abc123 at redis://:hunter2@cache:6379/0")
    assert "abc123" not in outcome.detail and "hunter2" not in outcome.detail, outcome.detail
    assert "abc123" not in json.dumps(outcome.as_dict()) and "hunter2" not in outcome.to_json()
    long = Outcome(OutcomeStatus.FAILED, "x" * 3 * DETAIL_CHARS, FailureClass.AGENT)
    assert len(long.detail) == DETAIL_CHARS


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome(OutcomeStatus.SUCCEEDED, "the agent exited with code 0", reward=0.5),
        Outcome(OutcomeStatus.FAILED, _long_error(), FailureClass.TIMEOUT),
        Outcome(OutcomeStatus.SKIPPED, "worker draining", FailureClass.SHUTDOWN, handover=True),
    ],
    ids=["succeeded", "failed", "handover"],
)
def test_the_10_kept_record_round_trips(outcome: Outcome) -> None:
    raw = outcome.to_json()
    assert Outcome.parse(raw) == outcome and Outcome.parse(raw.encode()) == outcome
    data = json.loads(raw)
    assert data["state"] == (None if outcome.handover else str(outcome.status))
    assert data["handover"] is outcome.handover


def test_the_03_kept_report_round_trips_into_the_same_record() -> None:
    failed = Outcome(OutcomeStatus.FAILED, _long_error(), FailureClass.LLM)
    metadata = {"error": error_text(failed.detail), "failure_class": str(FailureClass.LLM)}
    report = PendingReport(AttemptStatus.FAILED, metadata, deadline=5.0)
    kept = PendingReport.from_json(report.to_json())
    assert kept == report and kept.outcome().failure_class is FailureClass.LLM
    assert kept.outcome().detail.startswith(HEAD) and kept.outcome().detail.endswith(TAIL)
    won = PendingReport.from_json(PendingReport(AttemptStatus.SUCCEEDED, {"reward": 1.0}, deadline=5.0).to_json())
    assert won is not None and won.outcome() == Outcome(OutcomeStatus.SUCCEEDED, reward=1.0)
    # Both lines' task results are the same record's: one shape for Flower and the worker's metrics.
    assert kept.outcome().as_dict().keys() == Outcome.parse(failed.to_json()).as_dict().keys()


def test_a_record_that_is_not_one_is_refused() -> None:
    for bad in ("{", "[]", '{"state": "cancelled"}', '{"state": "failed", "failure_class": 3}', '{"reward": "1"}'):
        with pytest.raises(ValueError):
            Outcome.parse(bad)
