"""The two mechanisms the performance work added, checked on their own against real Redis and the real SDK.

* ``workers.span_encoding.encode`` with token ids kept beside the spans must produce the very spans the
  SDK's encoder does with them as attributes (the Store and the trainer read them): compared attribute by
  attribute after decoding both.
* ``bridge.core.capacity.notify_freed``/``wait_for_freed``: a worker's wake-up ends the full bridge's wait,
  and without one the wait still ends at its bound.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bridge.core import capacity, keys
from tests.helpers import TEST_REDIS_URL
from workers.span_encoding import encode

TOKEN_KEYS = ("prompt_token_ids", "response_token_ids")


def _spans() -> tuple[tuple[ReadableSpan, ...], tuple[ReadableSpan, ...], dict[int, dict[str, list[int]]]]:
    """The same spans twice: token ids as ordinary attributes (the SDK's way), and kept beside the spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    lists: dict[int, dict[str, list[int]]] = {}
    for i in range(6):
        attributes = {
            "step.index": i,
            "name": "x" * i,
            "flags": [True, False] * 40,  # bools are not ints in OTLP
            "ratio": 0.5,
        }
        tokens = {"prompt_token_ids": list(range(100 * i, 100 * i + 300)), "response_token_ids": [7, 8, 9]}
        with tracer.start_as_current_span(f"span-{i}", attributes={**attributes, **tokens}) as span:
            lists[span.get_span_context().span_id] = tokens
    with tracer.start_as_current_span("no-attributes"):
        pass
    with_tokens = exporter.get_finished_spans()
    without = tuple(_without_tokens(span) for span in with_tokens)
    return with_tokens, without, lists


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
    """span id -> (attributes by key, the span without attributes, its resource, its scope)."""
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
    assert len(ours) == len(with_tokens) == 7
    assert ours == sdk
    assert _decoded(encode(without)) != sdk  # the lists really come from the side table


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(TEST_REDIS_URL, socket_timeout=5)
    try:
        connection.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    yield connection
    connection.close()


def test_a_freed_slot_wakes_the_waiting_bridge(client: redis.Redis) -> None:
    queue = f"test-wakeup-{uuid.uuid4().hex[:8]}"
    try:
        assert capacity.wait_for_freed(client, [queue], 0.1) is False  # nothing freed: the bound ends it
        capacity.notify_freed(client, queue)
        capacity.notify_freed(client, queue)
        assert capacity.wait_for_freed(client, [queue], 5.0) is True
        assert client.exists(keys.slot_freed(queue)) == 0  # a burst of wake-ups is consumed at once
        assert capacity.wait_for_freed(client, [queue], 0.1) is False
    finally:
        client.delete(keys.slot_freed(queue))
