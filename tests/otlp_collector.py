"""Shared pieces of the trace tests: a loopback OTLP/HTTP collector and small span look-ups.

The collector is what an operator's Jaeger/Tempo would be (``OTEL_EXPORTER_OTLP_ENDPOINT``), or a
stand-in for ``AGENT_LIGHTNING_OTLP_ENDPOINT`` that refuses the reward span on purpose. It decodes
real OTLP protobuf, so it proves what the processes actually sent. No tests live here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

REWARD_SPAN = "agentlightning.annotation"


@dataclass(frozen=True)
class CollectedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpCollector:
    """``ThreadingHTTPServer`` on 127.0.0.1 taking ``POST /v1/traces``; ``reject`` decides a 500 per request."""

    def __init__(self, reject: Callable[[list[CollectedSpan]], bool] | None = None) -> None:
        self.spans: list[CollectedSpan] = []
        self.rejected: list[CollectedSpan] = []
        self.requests = 0
        self._reject = reject
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = collector._receive(self.path, body)
                payload = ExportTraceServiceResponse().SerializeToString() if status == 200 else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes it (the exporter appends ``/v1/traces``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _receive(self, path: str, body: bytes) -> int:
        if path != "/v1/traces":
            return 404
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception:  # a malformed body is the sender's bug: answer like a collector would
            return 400
        batch: list[CollectedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    batch.append(
                        CollectedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            resource=resource,
                        )
                    )
        with self._lock:
            self.requests += 1
            if self._reject is not None and self._reject(batch):
                self.rejected.extend(batch)
                return 500
            self.spans.extend(batch)
        return 200

    def snapshot(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float) -> list[CollectedSpan]:
        """Bounded wait: the SDK's batch processor exports every few seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.25)


def rejects_reward(batch: list[CollectedSpan]) -> bool:
    return any(span.name == REWARD_SPAN for span in batch)


def reward_value(span: dict[str, Any]) -> float | None:
    """The primary reward of a Store span in section 8's format, or None if it is not a reward span."""
    attributes = span.get("attributes") or {}
    if span.get("name") != REWARD_SPAN or attributes.get("agentlightning.reward.0.name") != "primary":
        return None
    return float(attributes["agentlightning.reward.0.value"])
