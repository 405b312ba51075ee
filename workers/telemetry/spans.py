"""Spans for one attempt, delivered to the Store where the trainer reads them (docs/store-protocol.md 7-8).

Each attempt gets its own tracer whose resource names the rollout and the attempt, so the Store files every
span under the right attempt. Ended spans are buffered and sent as one OTLP/HTTP protobuf request per flush
through the shared Store client, to ``AGENT_LIGHTNING_OTLP_ENDPOINT`` or the Store's ``/v1/traces``: one batch
before the report, earlier only when the heartbeat monitor flushes (``unresponsive_seconds``, streaming, a full
buffer). The tracer is built without a ``TracerProvider``, samples everything, and holds no thread or socket
of its own. No span carries a local sequence id: the Store assigns them in arrival order, which reward
matching relies on (7.2). Why: docs/architecture.md, "What the trainer receives" and "Design choices".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    ReadableSpan,
    Span,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    Tracer,
    sampling,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationInfo, InstrumentationScope
from opentelemetry.trace import Status, StatusCode

from bridge.core.infra import StoreError, TelemetryError, redact_url
from bridge.core.patches import otlp_token_ids as span_encoding
from bridge.core.store import TRACES, StoreClient
from workers.telemetry.courier import TraceCourier

log = logging.getLogger("workers.telemetry.spans")

REWARD_SPAN = "agentlightning.annotation"
LLM_SPAN = "openai.chat.completion"
TRACER_NAME = "agl_celery_bridge.workers"
_ID_GENERATOR = RandomIdGenerator()
_SCOPE = InstrumentationScope(TRACER_NAME)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the Tracer still takes the pre-1.11 form too
    _SCOPE_INFO = InstrumentationInfo(TRACER_NAME)


class _BufferingProcessor(SpanProcessor):
    """Collects ended spans; the owner decides when to ship them."""

    def __init__(self, sink: AttemptTelemetry) -> None:
        self._sink = sink

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        self._sink._collect(span)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@functools.lru_cache(maxsize=8)
def _service_resource(service_name: str) -> Resource:
    """The process's resource (SDK attributes, ``OTEL_RESOURCE_ATTRIBUTES``, the service name), detected once:
    ``Resource.create`` runs its detectors on every call, which per attempt would cost a many-thread worker a
    share of its GIL time. Each attempt merges its ids into it."""
    return Resource.create({"service.name": service_name})


class AttemptTelemetry:
    """Tracer, buffer and exporter of one attempt. Create at start, ``close()`` at the end."""

    def __init__(
        self,
        store: StoreClient,
        *,
        rollout_id: str,
        attempt_id: str,
        service_name: str,
        export: bool = True,
        traces_url: str | None = None,
        courier: TraceCourier | None = None,
    ) -> None:
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        ids = Resource({"agentlightning.rollout_id": rollout_id, "agentlightning.attempt_id": attempt_id})
        resource = _service_resource(service_name).merge(ids)
        self.resource = resource  # spans built elsewhere (a LitAgent's returned trace) are re-filed under it
        self._processor = SynchronousMultiSpanProcessor()
        self._processor.add_span_processor(_BufferingProcessor(self))
        self.tracer = Tracer(
            sampling.ALWAYS_ON,
            resource,
            self._processor,
            _ID_GENERATOR,
            _SCOPE_INFO,
            SpanLimits(),
            _SCOPE,
        )
        self._store = store
        self._export = export
        self._traces_url = traces_url  # None: the Store's /v1/traces
        self._courier = courier  # the final flush may share a request with other attempts' (trace_courier)
        self._opened = time.monotonic()
        self._open = courier is not None  # counted among the courier's running attempts until ``close``
        if courier is not None:
            courier.opened()
        self._buffer: list[ReadableSpan] = []
        self._int_lists: dict[int, dict[str, Sequence[int]]] = {}  # kept beside the spans: span_encoding
        self._buffer_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self.spans_exported = 0
        self.bytes_exported = 0
        self.export_requests = 0
        self.export_seconds = 0.0
        self.last_flush = time.monotonic()
        self._flush_failed = False
        self.delivered_at = 0.0  # epoch s when the latest delivered batch was sent: stored spans are heartbeats

    @property
    def destination(self) -> str:
        return self._traces_url or self._store.base_url + TRACES

    def _collect(self, span: ReadableSpan) -> None:
        with self._buffer_lock:
            self._buffer.append(span)

    def add_spans(self, spans: Sequence[ReadableSpan]) -> None:
        """Ended spans made outside this tracer, shipped with the attempt's own in the next flush.

        They must carry ``self.resource``: the Store files spans under the attempt their resource names.
        """
        with self._buffer_lock:
            self._buffer.extend(spans)

    @property
    def pending(self) -> int:
        with self._buffer_lock:
            return len(self._buffer)

    def unsent_spans(self) -> list[ReadableSpan]:
        """A copy of the ended spans the next flush ships, oldest first (what ``pending`` counts)."""
        with self._buffer_lock:
            return list(self._buffer)

    def flush(self, *, deadline: float | None = None, timeout: float | None = None, together: bool = False) -> None:
        """Ship every ended span in one request; on failure keep them for the next try and raise.

        The caller turns a failed final flush into a ``failed``/``telemetry`` report: the reward span is
        the last span, and a rollout whose reward never reached the Store must not look ``succeeded``.
        ``together``: through the process's courier, which may carry other attempts' spans in the same
        request (the final flush; the heartbeat's flushes never wait on other attempts). After a failure,
        an attempt's spans always go alone.
        """
        with self._flush_lock:
            with self._buffer_lock:
                batch, self._buffer = self._buffer, []
                lists = {sid: self._int_lists.pop(sid) for sid in map(_span_id, batch) if sid in self._int_lists}
            self.last_flush = time.monotonic()
            if not batch or not self._export:
                return
            payload = span_encoding.encode(batch, lists)
            sent_at = time.time()
            started = time.perf_counter()
            try:
                if together and self._courier is not None and not self._flush_failed:
                    running_s = time.monotonic() - self._opened
                    self._courier.send(payload, deadline=deadline, timeout=timeout, running_s=running_s)
                else:
                    self._store.post_traces(payload, url=self._traces_url, deadline=deadline, timeout=timeout)
            except StoreError as exc:
                self._flush_failed = True
                with self._buffer_lock:
                    self._buffer = batch + self._buffer
                    self._int_lists.update(lists)
                raise TelemetryError(
                    f"could not deliver {len(batch)} spans of attempt {self.attempt_id} to "
                    f"{redact_url(self.destination)} (AGENT_LIGHTNING_OTLP_ENDPOINT): {exc}"
                ) from exc
            finally:
                self.export_seconds += time.perf_counter() - started
                self.export_requests += 1
            self.spans_exported += len(batch)
            self.bytes_exported += len(payload)
            self.delivered_at = sent_at

    def seal(self) -> None:
        """Send nothing more and drop what is unsent; a flush in flight ends first. For an attempt handed over while
        its agent still runs: no span may follow the hand-over into the attempt (docs/store-protocol.md 10, case 6)."""
        with self._flush_lock:
            self._export = False
            with self._buffer_lock:
                self._buffer.clear()
                self._int_lists.clear()

    def close(self) -> None:
        """Drop anything unsent: nothing of the attempt outlives it."""
        self._processor.shutdown()
        if self._courier is not None and self._open:
            self._open = False
            self._courier.closed()
        with self._buffer_lock:
            self._buffer.clear()
            self._int_lists.clear()

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[trace.Span]:
        """A child span of whatever is current; an exception marks it as an error and propagates."""
        with self.tracer.start_as_current_span(
            name, attributes=otlp_attributes(attributes or {}), record_exception=True, set_status_on_exception=True
        ) as span:
            yield span

    def attach_ints(self, span: trace.Span, key: str, values: Sequence[int]) -> None:
        """A long integer attribute (token ids) of ``span``, exported with it without per-element checks.

        ``values`` must hold plain ints; it is not copied, so it must not change afterwards.
        """
        sid = span.get_span_context().span_id
        with self._buffer_lock:
            self._int_lists.setdefault(sid, {})[key] = values

    def emit_reward(self, reward: float) -> None:
        """The reward span in the format the trainer's adapters read (docs/store-protocol.md 8)."""
        with self.tracer.start_as_current_span(REWARD_SPAN) as span:
            span.set_attribute("agentlightning.reward.0.name", "primary")
            span.set_attribute("agentlightning.reward.0.value", float(reward))
            span.set_status(Status(StatusCode.OK))


_ATTRIBUTE_TYPES = (bool, str, int, float)  # bool first: a bool is an int to isinstance, not to OpenTelemetry


def otlp_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes as OpenTelemetry's rules take them, the one rule for every span of an attempt (the built-in
    agent's, Agent Lightning's emitters', a LitAgent's returned trace): a str, bool, int or float as it is; a list or
    tuple whose items are all of one of those types (a bool is no int) as a list; None dropped; anything else (a mixed
    list, a list of dicts or of None, a dict, an object) as its string, as the SDK keeps a value it does not take."""
    clean: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, _ATTRIBUTE_TYPES):
            clean[key] = value
        elif isinstance(value, (list, tuple)) and _homogeneous(value):
            clean[key] = list(value)
        else:
            clean[key] = str(value)
    return clean


def _homogeneous(values: Sequence[Any]) -> bool:
    """Every item is of the same one of ``_ATTRIBUTE_TYPES`` (a bool is not taken for an int)."""
    kinds = {next((kind for kind in _ATTRIBUTE_TYPES if isinstance(v, kind)), None) for v in values}
    return len(kinds) <= 1 and None not in kinds


def _span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    return context.span_id if context is not None else 0


def current_trace_id() -> str | None:
    """Hex trace id of the current span (the Celery instrumentation's run span), if any."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
