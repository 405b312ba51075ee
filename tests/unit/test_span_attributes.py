"""Span attributes by every door into an attempt's spans: the built-in agent's (``AttemptTelemetry.span``), Agent
Lightning's emitters (``WorkerTracer.create_span``) and a LitAgent's returned trace (``add_returned_spans``). Each
is cleaned by one rule, OpenTelemetry's: a str, bool, int or float as it is, a list of one of those types
(a bool is no int) as a list, None dropped, anything else as its string."""

from __future__ import annotations

from typing import Any

from agentlightning.types import SpanCoreFields
from opentelemetry.sdk.trace import ReadableSpan

from workers.agents import capture as capture_module
from workers.agents.capture import AttemptCapture
from workers.agents.spans import add_returned_spans
from workers.agents.tracer import WorkerTracer
from workers.telemetry.spans import AttemptTelemetry

ATTRIBUTES: dict[str, Any] = {
    "str": "x",
    "int": 3,
    "float": 0.5,
    "bool": True,
    "none": None,
    "strs": ["a", "b"],
    "ints": [1, 2],
    "floats": [0.25, 1.5],
    "bools": [True, False],
    "tuple": (4, 5),
    "empty": [],
    "mixed": [1, "a"],
    "ints_and_bools": [1, True],
    "ints_and_floats": [1, 0.5],
    "dicts": [{"a": 1}],
    "nones": [None],
    "dict": {"a": 1},
}
EXPECTED: dict[str, Any] = {
    "str": "x",
    "int": 3,
    "float": 0.5,
    "bool": True,
    "strs": ("a", "b"),
    "ints": (1, 2),
    "floats": (0.25, 1.5),
    "bools": (True, False),
    "tuple": (4, 5),
    "empty": (),
    "mixed": "[1, 'a']",
    "ints_and_bools": "[1, True]",
    "ints_and_floats": "[1, 0.5]",
    "dicts": "[{'a': 1}]",
    "nones": "[None]",
    "dict": "{'a': 1}",
}
AGENT_LIGHTNING_TAKES = ("str", "int", "float", "bool", "strs", "ints", "floats", "bools", "tuple", "empty")


def _last_span(telemetry: AttemptTelemetry) -> ReadableSpan:
    return telemetry.unsent_spans()[-1]


def test_every_door_into_an_attempts_spans_keeps_opentelemetrys_lists_alike(capture: AttemptCapture) -> None:
    """Agent Lightning's models (``SpanCoreFields``, ``Span``) take only OpenTelemetry's attribute values, so the
    three doors are compared on those: lists of floats and of bools stay lists by each."""
    valid = {key: value for key, value in ATTRIBUTES.items() if key in AGENT_LIGHTNING_TAKES}
    expected = {key: value for key, value in EXPECTED.items() if key in AGENT_LIGHTNING_TAKES}
    telemetry = capture.telemetry
    with telemetry.span("built-in", valid):
        pass
    built_in = _last_span(telemetry)
    with capture_module.capturing(capture):
        WorkerTracer().create_span("emitted", attributes=valid)
    emitted = _last_span(telemetry)
    core = SpanCoreFields.model_validate(
        {"name": "returned", "attributes": valid, "start_time": 1.0, "end_time": 2.0, "status": {"status_code": "OK"}}
    )
    (returned,) = add_returned_spans(telemetry, [core])
    assert [built_in.name, emitted.name, returned.name] == ["built-in", "emitted", "returned"]
    for span in (built_in, emitted, returned):
        assert dict(span.attributes or {}) == expected, span.name


def test_what_opentelemetry_refuses_becomes_its_string_and_none_is_dropped(capture: AttemptCapture) -> None:
    """The built-in agent's door takes any value: mixed lists (a bool is no int), lists of dicts or of None, and
    dicts are kept as their strings, as OpenTelemetry's SDK keeps a value of a type it does not take."""
    with capture.telemetry.span("built-in", ATTRIBUTES):
        pass
    assert dict(_last_span(capture.telemetry).attributes or {}) == EXPECTED
