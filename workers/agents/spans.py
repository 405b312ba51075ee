"""Spans a LitAgent returns as its trace, re-filed under the attempt that ran it.

The Store files OTLP spans under the rollout and attempt their *resource* names, and Agent Lightning's
runner adds a returned trace to the attempt it ran. So each returned span is copied with the attempt's
resource (``AttemptTelemetry.resource``) and everything else as it was: names, ids, parents, times,
attributes (token ids included), status, events. Agent Lightning ``Span``s and ``SpanCoreFields`` are
turned into OpenTelemetry spans first, so every kind travels in the same OTLP batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentlightning.types import Span, SpanCoreFields
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from workers.telemetry.spans import AttemptTelemetry, otlp_attributes


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def _status(status: Any) -> Status:
    code = getattr(status, "status_code", "UNSET")
    codes = {"OK": StatusCode.OK, "ERROR": StatusCode.ERROR}
    mapped = codes.get(str(code), StatusCode.UNSET)
    return Status(mapped, getattr(status, "description", None) if mapped is StatusCode.ERROR else None)


def _context(trace_id: str, span_id: str) -> SpanContext:
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=False, trace_flags=TraceFlags(1))


def refile_otel(span: ReadableSpan, resource: Resource) -> ReadableSpan:
    """The same span under ``resource``."""
    return ReadableSpan(
        name=span.name,
        context=span.get_span_context(),
        parent=span.parent,
        resource=resource,
        attributes=span.attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def from_agl_span(span: Span, resource: Resource) -> ReadableSpan:
    """An Agent Lightning ``Span`` as an OpenTelemetry one under ``resource``."""
    parent = _context(span.trace_id, span.parent_id) if span.parent_id else None
    start = _ns(span.start_time)
    return ReadableSpan(
        name=span.name,
        context=_context(span.trace_id, span.span_id),
        parent=parent,
        resource=resource,
        attributes=otlp_attributes(dict(span.attributes or {})),
        events=[Event(e.name, otlp_attributes(dict(e.attributes or {})), _ns(e.timestamp)) for e in span.events],
        kind=SpanKind.INTERNAL,
        status=_status(span.status),
        start_time=start,
        end_time=_ns(span.end_time) or start,
    )


def add_returned_spans(telemetry: AttemptTelemetry, spans: Sequence[Any]) -> list[ReadableSpan]:
    """Add a returned trace (all ReadableSpan, all Span or all SpanCoreFields) to the attempt's batch.

    Returns the spans as they were filed. Raises TypeError for other kinds, ValueError for ids that are not hex.
    """
    resource = telemetry.resource
    if all(isinstance(s, ReadableSpan) for s in spans):
        converted = [refile_otel(s, resource) for s in spans]
    elif all(isinstance(s, Span) for s in spans):
        converted = [from_agl_span(s, resource) for s in spans]
    elif all(isinstance(s, SpanCoreFields) for s in spans):
        converted = []
        for fields in spans:  # no ids of their own: new spans of the attempt's tracer, as Agent Lightning does
            start = _ns(fields.start_time)
            attributes = otlp_attributes(dict(fields.attributes))
            otel = telemetry.tracer.start_span(fields.name, attributes=attributes, start_time=start)
            otel.set_status(_status(fields.status))
            otel.end(end_time=_ns(fields.end_time) or start)
            if isinstance(otel, ReadableSpan):  # the SDK's span: already in the batch through the tracer
                converted.append(otel)
        return converted
    else:
        kinds = sorted({type(s).__name__ for s in spans})
        raise TypeError(f"a list of ReadableSpan, Span or SpanCoreFields, got a list of {', '.join(kinds)}")
    telemetry.add_spans(converted)
    return converted
