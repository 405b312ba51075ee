"""Process-wide tracing for operators: one trace per rollout across bridge, broker and worker.

The Celery instrumentation links the bridge's publish span and the worker's run span through the
message headers. This global provider is separate from the per-attempt providers that feed the Store:
it exports only when the operator configured a standard OTLP collector (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and otherwise sends nothing anywhere.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bridge.core.infra import process_state

log = logging.getLogger(__name__)


def operator_collector_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup_process_tracing(service_name: str) -> None:
    """Install the global provider and the Celery instrumentation once per process tree.

    Prefork children inherit both; the SDK's batch processor re-creates its thread after fork.
    """
    state = process_state.core
    with state.tracing_lock:
        if state.tracing_installed:
            return
        state.tracing_installed = True
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if operator_collector_configured():
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            log.info("exporting operator traces to the configured OTLP collector")
        trace.set_tracer_provider(provider)
        instrumentor = CeleryInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
