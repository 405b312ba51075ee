"""OTLP protobuf bytes for one attempt's spans: the SDK's encoder, plus token-id lists added here.

Token ids are the bulk of what a worker ships (hundreds of integers per LLM call, every call). Profiled
(0 ms benchmark), carrying them as ordinary span attributes cost twice: the SDK cleans every element
when the attribute is set, then its generic encoder dispatches on the type of every element again.
So they never become attributes: the telemetry keeps them beside the span (``IntLists``, by span id)
and they are appended to the encoded span here with protobuf's repeated-field ``add``. The result is
the standard OTLP message the Store decodes (an ``array_value`` of ``int_value``s), so nothing
downstream changes; only the attribute order within a span differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.sdk.trace import ReadableSpan

IntLists = Mapping[int, Mapping[str, Sequence[int]]]  # span id -> attribute name -> integers


def _fill(kv: KeyValue, values: Sequence[int]) -> None:
    add = kv.value.array_value.values.add
    for v in values:
        add(int_value=v)


def encode(batch: Sequence[ReadableSpan], int_lists: IntLists | None = None) -> bytes:
    """One ``ExportTraceServiceRequest`` for ``batch``, serialized, each span with its integer lists."""
    request = encode_spans(batch)
    if int_lists:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for pb_span in scope_spans.spans:
                    for key, values in int_lists.get(int.from_bytes(pb_span.span_id, "big"), {}).items():
                        _fill(pb_span.attributes.add(key=key), values)
    return request.SerializeToString()
