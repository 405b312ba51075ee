"""What a LitAgent's returned trace becomes (``workers.agents.litagent._interpret``): every kind keeps its
reward, and spans the worker cannot file fail the attempt with class ``agent``."""

from __future__ import annotations

import pytest
from agentlightning.types import Span, SpanCoreFields

from workers.agents.capture import AttemptCapture
from workers.agents.litagent import _interpret
from workers.protocol.failures import AgentError

REWARD_KEY = "agentlightning.reward.0.value"


def _core(name: str, attributes: dict[str, object]) -> SpanCoreFields:
    return SpanCoreFields.model_validate(
        {"name": name, "attributes": attributes, "start_time": 1.0, "end_time": 2.0, "status": {"status_code": "OK"}}
    )


def _agl(span_id: str) -> Span:
    return Span.model_validate(
        {
            "rollout_id": "ro-r",
            "attempt_id": "at-r",
            "sequence_id": 0,
            "trace_id": "0af7651916cd43dd8448eb211c80319c",
            "span_id": span_id,
            "parent_id": None,
            "name": "agentlightning.annotation",
            "status": {"status_code": "OK"},
            "attributes": {REWARD_KEY: 0.75},
            "events": [],
            "links": [],
            "start_time": 1.0,
            "end_time": 2.0,
            "context": None,
            "parent": None,
            "resource": {"attributes": {}, "schema_url": ""},
        }
    )


def test_returned_span_core_fields_keep_their_reward(capture: AttemptCapture) -> None:
    result, added = _interpret(
        [_core("step", {}), _core("agentlightning.annotation", {REWARD_KEY: 0.25})], capture, "a"
    )
    assert result.result_kind == "spans" and result.reward == 0.25
    assert [s.name for s in added] == ["step", "agentlightning.annotation"]
    assert capture.telemetry.pending == 2  # filed once, through the attempt's tracer


def test_returned_agent_lightning_spans_keep_their_reward(capture: AttemptCapture) -> None:
    result, _ = _interpret([_agl("b7ad6b7169203331")], capture, "a")
    assert result.reward == 0.75


def test_spans_with_ids_that_are_not_hex_fail_with_class_agent(capture: AttemptCapture) -> None:
    with pytest.raises(AgentError, match="ids cannot be read"):
        _interpret([_agl("not-a-hex-id!!!!")], capture, "a")
