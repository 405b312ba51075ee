"""When an attempt's spans leave the worker before its report: only to stream, to stay alive, or when too many.

Real ``HeartbeatMonitor``, ``Lease`` and ``AttemptTelemetry`` (with export off, a flush empties the buffer
without a Store); the lease is made to look freshly renewed so that only the flush policy decides.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from bridge.core.store import StoreClient
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor, span_flush_interval
from workers.protocol.lease import Lease
from workers.telemetry.spans import AttemptTelemetry


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def monitor() -> Iterator[HeartbeatMonitor]:
    client = redis.Redis(port=_closed_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    store = StoreClient("http://127.0.0.1:9", retries=0)
    monitor = HeartbeatMonitor(store, client)
    try:
        yield monitor
    finally:
        monitor.close()
        store.close()


def _attempt(
    monitor: HeartbeatMonitor, spans: int, flush_interval_s: float, flush_max_pending: int
) -> tuple[AttemptWatch, AttemptTelemetry]:
    assert monitor.store is not None
    telemetry = AttemptTelemetry(
        monitor.store, rollout_id="ro-flush", attempt_id="at-flush", service_name="flush-policy", export=False
    )
    for index in range(spans):
        with telemetry.span("webshop.step", {"step.index": index}):
            pass
    telemetry.last_flush = time.monotonic() - 3600  # an hour-long episode so far
    lease = Lease(monitor.redis, "at-flush", 30.0)
    lease.valid_until = time.monotonic() + 20.0
    watch = AttemptWatch(
        "ro-flush",
        "at-flush",
        lease,
        telemetry,
        interval_s=10.0,
        flush_interval_s=flush_interval_s,
        flush_max_pending=flush_max_pending,
    )
    return watch, telemetry


def test_without_streaming_or_a_watchdog_spans_wait_for_the_report(monitor: HeartbeatMonitor) -> None:
    watch, telemetry = _attempt(monitor, 5, flush_interval_s=math.inf, flush_max_pending=10)
    monitor.flush_if_due(watch)
    assert telemetry.pending == 5


def test_a_full_buffer_is_shipped_whatever_the_interval(monitor: HeartbeatMonitor) -> None:
    watch, telemetry = _attempt(monitor, 10, flush_interval_s=math.inf, flush_max_pending=10)
    monitor.flush_if_due(watch)
    assert telemetry.pending == 0 and telemetry.spans_exported == 0  # export off: emptied, nothing sent


def test_streaming_ships_every_interval(monitor: HeartbeatMonitor) -> None:
    watch, telemetry = _attempt(monitor, 3, flush_interval_s=1.0, flush_max_pending=10)
    monitor.flush_if_due(watch)
    assert telemetry.pending == 0
    with telemetry.tracer.start_as_current_span("webshop.step"):
        pass
    monitor.flush_if_due(watch)  # just flushed: the next one waits for the interval
    assert telemetry.pending == 1


def test_the_interval_comes_from_streaming_else_the_watchdog_else_none() -> None:
    assert span_flush_interval(2.0, None, 10.0) == 2.0  # streaming asked for
    assert span_flush_interval(2.0, 30.0, 10.0) == 2.0
    assert span_flush_interval(None, 30.0, 10.0) == 10.0  # spans keep the attempt alive: every heartbeat
    assert span_flush_interval(None, None, 10.0) == math.inf  # nobody looks: the report's batch only
