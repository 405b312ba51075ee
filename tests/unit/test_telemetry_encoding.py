"""Telemetry encoding: token ids kept beside the spans (``bridge.core.patches.otlp_token_ids.encode``, written as
wire bytes) must give the very OTLP payload the SDK's encoder gives with them as attributes (the Store and the trainer
read them): compared attribute by attribute after decoding both, for every varint length, spans in order,
over several resources and scopes."""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bridge.core.patches import otlp_token_ids as span_encoding
from bridge.core.patches.otlp_token_ids import encode

TOKEN_KEYS = ("prompt_token_ids", "response_token_ids")


# Each varint length's edges (1 to 10 bytes), a vocabulary-sized id, and int64's extremes.
EDGES = [0, 1, 127, 128, 16_383, 16_384, 151_643, 2_097_151, 2_097_152, 2**35, 2**63 - 1, -1, -(2**63)]


def _spans() -> tuple[tuple[ReadableSpan, ...], tuple[ReadableSpan, ...], dict[int, dict[str, list[int]]]]:
    """The same spans twice: token ids as ordinary attributes (the SDK's way), and kept beside the spans."""
    exporter = InMemorySpanExporter()
    lists: dict[int, dict[str, list[int]]] = {}
    for attempt in ("at-1", "at-2"):  # two resources in one batch, each with two scopes
        provider = TracerProvider(resource=Resource.create({"agentlightning.attempt_id": attempt}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _record(provider.get_tracer("test"), lists)
        _record(provider.get_tracer("other-scope"), lists)
    with_tokens = exporter.get_finished_spans()
    without = tuple(_without_tokens(span) for span in with_tokens)
    return with_tokens, without, lists


def _record(tracer: Any, lists: dict[int, dict[str, list[int]]]) -> None:
    for i in range(6):
        attributes: dict[str, Any] = {
            "step.index": i,
            "name": "x" * i,
            "flags": [True, False] * 40,  # bools are not ints in OTLP
            "ratio": 0.5,
        }
        tokens = {
            "prompt_token_ids": list(range(100 * i, 100 * i + 300)) + EDGES,
            "response_token_ids": [7, 8, 9] if i else [],
        }
        with tracer.start_as_current_span(f"span-{i}", attributes={**attributes, **tokens}) as span:
            lists[span.get_span_context().span_id] = tokens
    with tracer.start_as_current_span("no-attributes"):
        pass


def _without_tokens(span: ReadableSpan) -> ReadableSpan:
    attributes = {k: v for k, v in (span.attributes or {}).items() if k not in TOKEN_KEYS}
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def _decoded(payload: bytes) -> dict[bytes, tuple[dict[str, bytes], bytes, bytes, bytes]]:
    """span id -> (attributes by key, the span without attributes, its resource, its scope), in the order the
    spans come in the payload."""
    out = {}
    for resource_spans in ExportTraceServiceRequest.FromString(payload).resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {kv.key: kv.value.SerializeToString() for kv in span.attributes}
                rest = type(span)()
                rest.CopyFrom(span)
                del rest.attributes[:]
                out[span.span_id] = (
                    attributes,
                    rest.SerializeToString(),
                    resource_spans.resource.SerializeToString(),
                    scope_spans.scope.SerializeToString(),
                )
    return out


def test_token_ids_kept_beside_spans_encode_as_the_sdk_encodes_attributes() -> None:
    with_tokens, without, lists = _spans()
    ours, sdk = _decoded(encode(without, lists)), _decoded(encode_spans(with_tokens).SerializeToString())
    assert len(ours) == len(with_tokens) == 28
    assert ours == sdk
    assert list(ours) == list(sdk)  # the same order of spans
    assert _decoded(encode(without)) != sdk  # the lists really come from the side table


def test_integers_past_the_remembered_limit_are_still_written_and_not_kept() -> None:
    """Elements are remembered per integer up to a bound, so an unbounded range of ids cannot grow a worker."""
    elements = span_encoding.IntElements(limit=50)
    values = list(range(1_000, 1_100)) + EDGES
    expected = ArrayValue(values=[AnyValue(int_value=v) for v in values]).SerializeToString()
    assert elements.encode(values) == expected
    assert elements.encode(values) == expected  # the same from memory and not
    assert len(elements) == 50
