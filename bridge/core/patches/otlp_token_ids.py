"""OTLP protobuf bytes for one attempt's spans: the SDK's encoder, plus token-id lists written here as bytes.

Token ids are the bulk of what a worker ships; as ordinary span attributes the SDK cleans and encodes them
element by element. So the telemetry keeps them beside the span (by span id), each span is serialized by
the SDK's encoder, and its token-id attributes are appended as protobuf bytes (fields may come in any order
and repeated fields concatenate), framed into the scope and resource messages here. The result decodes to
the standard OTLP message, exactly what the SDK's encoder would give. It relies on the OTLP exporter's
``encode_spans``; figures: docs/performance.md, "The worker's CPU". Registered in
``bridge.core.patches``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.trace import ReadableSpan

IntLists = Mapping[int, Mapping[str, Sequence[int]]]  # span id -> attribute name -> integers

_LEN = 2  # wire type of length-delimited fields (messages, strings, bytes)
_VARINT = 0


def _tag(message: type, field: str, wire_type: int) -> bytes:
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)  # type: ignore[attr-defined]


def _varint(value: int) -> bytes:
    value &= 0xFFFF_FFFF_FFFF_FFFF  # int64 as protobuf writes it: a negative is its 64-bit two's complement
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_RESOURCE_SPANS = _tag(ExportTraceServiceRequest, "resource_spans", _LEN)
_SCOPE_SPANS = _tag(ResourceSpans, "scope_spans", _LEN)
_SPANS = _tag(ScopeSpans, "spans", _LEN)
_ATTRIBUTES = _tag(Span, "attributes", _LEN)
_KEY = _tag(KeyValue, "key", _LEN)
_VALUE = _tag(KeyValue, "value", _LEN)
_ARRAY_VALUE = _tag(AnyValue, "array_value", _LEN)
_VALUES = _tag(ArrayValue, "values", _LEN)
_INT_VALUE = _tag(AnyValue, "int_value", _VARINT)
assert len(_VALUES) == len(_INT_VALUE) == 1  # IntElements writes each as one byte
_V, _I = _VALUES[0], _INT_VALUE[0]


def _framed(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


class IntElements(dict[int, bytes]):
    """Each integer's ``ArrayValue.values`` element (its tag, its length, the ``int_value`` tag, its varint),
    made once: a vocabulary's worth of token ids recurs in every prompt, so a list is written by looking its
    elements up (``b"".join`` over a C-level map) rather than computed again. Remembers at most ``limit``
    integers (the default about 6 MB); others are computed each time, so an unbounded range of ids cannot grow
    a worker."""

    def __init__(self, limit: int = 65_536) -> None:
        super().__init__()
        self.limit = limit

    def __missing__(self, value: int) -> bytes:
        varint = _varint(value)
        item = bytes((_V, len(varint) + 1, _I)) + varint
        if len(self) < self.limit:
            self[value] = item
        return item

    def encode(self, values: Sequence[int]) -> bytes:
        """``ArrayValue.values`` elements, each an AnyValue holding ``int_value``, for every integer at once."""
        return b"".join(map(self.__getitem__, values))


ELEMENTS = IntElements()  # shared by the process's encoders: a cache, never cleared


def int_list_attribute(key: str, values: Sequence[int]) -> bytes:
    """A ``Span.attributes`` field (tag included) holding ``key`` = an array of ints, as protobuf encodes it."""
    array = ELEMENTS.encode(values) if len(values) else b""
    pair = _framed(_KEY, key.encode()) + _framed(_VALUE, _framed(_ARRAY_VALUE, array))
    return _framed(_ATTRIBUTES, pair)


def encode(batch: Sequence[ReadableSpan], int_lists: IntLists | None = None) -> bytes:
    """One ``ExportTraceServiceRequest`` for ``batch``, serialized, each span with its integer lists."""
    request = encode_spans(batch)
    if not int_lists:
        return request.SerializeToString()
    out = []
    for resource_spans in request.resource_spans:
        scopes = []
        for scope_spans in resource_spans.scope_spans:
            spans = []
            for span in scope_spans.spans:
                extra = int_lists.get(int.from_bytes(span.span_id, "big"))
                body = span.SerializeToString()
                if extra:
                    body += b"".join(int_list_attribute(key, values) for key, values in extra.items())
                spans.append(_framed(_SPANS, body))
            del scope_spans.spans[:]
            scopes.append(_framed(_SCOPE_SPANS, scope_spans.SerializeToString() + b"".join(spans)))
        del resource_spans.scope_spans[:]
        out.append(_framed(_RESOURCE_SPANS, resource_spans.SerializeToString() + b"".join(scopes)))
    return b"".join(out)
