"""OTLP protobuf bytes for one attempt's spans: the SDK's encoder, with a fast path for token-id lists.

Profiled (py-spy, 0 ms benchmark, prefork -c 8), ``encode_spans`` took ~23% of a worker's CPU, most
of it in the SDK encoding every element of ``prompt_token_ids``/``response_token_ids`` through its
generic per-value function (a type dispatch and a message per integer). Those long integer lists are
left out of what the SDK encodes and appended to the encoded spans here with protobuf's repeated-field
``add``, about 3x faster per integer (measured). The result is the same standard OTLP message the
Store decodes, so nothing downstream changes: only the attribute order within a span differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.sdk.trace import ReadableSpan

MIN_FAST_LENGTH = 32  # shorter lists are not worth the detour


class _SpanView:
    """An ended span as the SDK encoder sees it, minus the attributes encoded separately."""

    def __init__(self, span: ReadableSpan, attributes: dict[str, Any]) -> None:
        self._span = span
        self.attributes = attributes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._span, name)


def _int_lists(attributes: Any) -> dict[str, Sequence[int]]:
    if not attributes:
        return {}
    return {
        key: value
        for key, value in attributes.items()
        if isinstance(value, (list, tuple))
        and len(value) >= MIN_FAST_LENGTH
        and all(type(v) is int for v in value)  # not bool: OTLP keeps those a separate type
    }


def _fill(kv: KeyValue, values: Sequence[int]) -> None:
    add = kv.value.array_value.values.add
    for v in values:
        add(int_value=v)


def encode(batch: Sequence[ReadableSpan]) -> bytes:
    """One ``ExportTraceServiceRequest`` for ``batch``, serialized."""
    views: list[Any] = []
    lists: dict[bytes, dict[str, Sequence[int]]] = {}
    for span in batch:
        found = _int_lists(span.attributes)
        context = span.get_span_context()
        if not found or context is None:
            views.append(span)
            continue
        lists[context.span_id.to_bytes(8, "big")] = found
        views.append(_SpanView(span, {k: v for k, v in (span.attributes or {}).items() if k not in found}))
    request = encode_spans(views)
    if lists:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for pb_span in scope_spans.spans:
                    for key, values in lists.get(pb_span.span_id, {}).items():
                        _fill(pb_span.attributes.add(key=key), values)
    return request.SerializeToString()
