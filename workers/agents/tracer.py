"""The Agent Lightning ``Tracer`` a LitAgent and its hooks see on a worker.

Agent Lightning's emitters (``agl.emit_reward``, ``emit_message``, ...) write through the process's
*active* tracer, one per process. This one is that tracer for the whole worker process and files each
span under the attempt whose context is running (``workers.agents.capture``), so concurrent attempts of
a ``-P threads`` worker never mix. Spans land in the attempt's ``AttemptTelemetry`` and are delivered
with the attempt's other spans, in its one batch before the final status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import agentlightning as agl
from agentlightning.tracer.base import get_active_tracer, set_active_tracer
from agentlightning.types import SpanCoreFields, TraceStatus
from opentelemetry.trace import Status, StatusCode

from workers.agents import capture
from workers.telemetry.spans import REWARD_SPAN, otlp_attributes

log = logging.getLogger("workers.agents")

_REWARD_VALUE = "agentlightning.reward.0.value"


class WorkerTracer(agl.Tracer):
    """Routes Agent Lightning's span creation into the running attempt's telemetry."""

    @asynccontextmanager
    async def trace_context(
        self,
        name: str | None = None,
        *,
        store: Any = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> AsyncIterator[None]:
        """Nothing to start: the worker opens each attempt's capture itself (``workers.agents.litagent``)."""
        yield

    def get_last_trace(self) -> list[Any]:
        """Spans are the attempt's, delivered by the worker; none are kept here."""
        return []

    def create_span(
        self,
        name: str,
        attributes: Any = None,
        timestamp: float | None = None,
        status: TraceStatus | None = None,
    ) -> SpanCoreFields:
        now = time.time() if timestamp is None else timestamp
        attrs = dict(attributes or {})
        status = status or TraceStatus(status_code="OK")
        running = capture.current()
        if running is None:
            log.warning("span %r created outside any attempt: not recorded", name)
        else:
            start_ns = int(now * 1e9)
            span = running.telemetry.tracer.start_span(name, attributes=otlp_attributes(attrs), start_time=start_ns)
            code = StatusCode.ERROR if status.status_code == "ERROR" else StatusCode.OK
            span.set_status(Status(code, status.description if code is StatusCode.ERROR else None))
            span.end(end_time=start_ns)
            reward = attrs.get(_REWARD_VALUE)
            if name == REWARD_SPAN and isinstance(reward, (int, float)) and not isinstance(reward, bool):
                running.last_reward = float(reward)
        return SpanCoreFields(name=name, status=status, attributes=attrs, start_time=now, end_time=now)


def activate() -> WorkerTracer:
    """This process's tracer, made Agent Lightning's active one (kept across a fork; never replaced)."""
    active = get_active_tracer()
    if isinstance(active, WorkerTracer):
        return active
    if active is not None:
        log.warning("replacing Agent Lightning's active tracer %r with the worker's", active)
        from agentlightning.tracer.base import clear_active_tracer

        clear_active_tracer()
    tracer = WorkerTracer()
    set_active_tracer(tracer)
    return tracer
