"""A long-lived worker process: its heartbeat monitor turns 10,000 times, busy and idle in turns, leaving nothing.

The monitor's two threads (``workers.protocol.heartbeat``: lease renewals, and the Store's fence reads, span flushes
and heartbeats) live as long as the worker process, watching attempts that come and go. Here its tick is shortened
(a fast clock) and attempts are watched and released in turns, 500 ticks each: four attempts with real leases on
this test's Redis, fenced by a loopback Store that answers each read with the rollouts it names. What must hold: no
error logged, every watched attempt still running (no lease lost, no fence failed), the threads and open files no
more at the end than half-way, and of what ``workers/`` allocated over the last ticks (``tracemalloc``) almost nothing
still held.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
import tracemalloc
import uuid
from urllib.parse import parse_qs, urlsplit

import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.store import StoreClient
from tests.loopback import LoopbackServer
from workers.protocol import heartbeat
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease

TICKS = 10_000
PHASE_TICKS = 500
ATTEMPTS = 4
HELD_BYTES = 64 * 1024  # of what workers/ allocated over the last ticks: a leak of a few bytes a tick shows


def _fencing_store() -> LoopbackServer:
    """Answers a fence read (``GET /v1/agl/rollouts?rollout_id_in=...``) with each named rollout running its attempt
    ``at-<rollout id>``; anything else with 503."""

    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        parts = urlsplit(path)
        if method != "GET" or parts.path != "/v1/agl/rollouts":
            return 503, {}, b""
        ids = parse_qs(parts.query).get("rollout_id_in", [])
        items = [
            {
                "rollout_id": rid,
                "status": "running",
                "attempt": {"rollout_id": rid, "attempt_id": f"at-{rid}", "status": "running"},
            }
            for rid in ids
        ]
        return 200, {"Content-Type": "application/json"}, json.dumps({"items": items, "total": len(items)}).encode()

    return LoopbackServer(answer)


def _held_by(directory: str) -> int:
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"*{os.sep}{directory}{os.sep}*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.nightly("a soak: the back-off and the round's rules are unit tests that run every time")
def test_ten_thousand_monitor_ticks_busy_and_idle_leave_threads_files_and_memory_flat(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(heartbeat, "TICK_S", 0.0005)
    server = _fencing_store()
    store = StoreClient(server.url, retries=0, timeout_s=5)
    monitor = HeartbeatMonitor(store, redis_client)
    ticks = 0
    snapshot = monitor.watches

    def counted() -> list[AttemptWatch]:
        nonlocal ticks
        if threading.current_thread().name == "attempt-heartbeat":
            ticks += 1
        return snapshot()

    monkeypatch.setattr(monitor, "watches", counted)
    readings: list[tuple[int, int]] = []
    held = 0
    phase = 0
    watched: list[AttemptWatch] = []
    try:
        with caplog.at_level(logging.WARNING):
            while ticks < TICKS:
                busy = phase % 2 == 0
                if busy:
                    for _ in range(ATTEMPTS):
                        rid = f"ro-soak-{uuid.uuid4().hex[:8]}"
                        lease = Lease(redis_client, f"at-{rid}", 5.0)
                        assert lease.claim(60).acquired
                        watch = AttemptWatch(rid, f"at-{rid}", lease, None, interval_s=0.05, flush_interval_s=1.0)
                        monitor.watch(watch)
                        watched.append(watch)
                until = (phase + 1) * PHASE_TICKS
                deadline = time.monotonic() + 60
                while ticks < until:
                    assert time.monotonic() < deadline, f"the monitor turned only {ticks} times"
                    time.sleep(0.005)
                for watch in watched:
                    assert watch.stop_reason is None, watch.stop_reason
                    assert watch.beats > 0  # it was fenced, again and again
                    watch.begin_reporting()  # as an attempt ends: its report, then the lease goes
                    monitor.unwatch(watch)
                    watch.lease.release()
                watched.clear()
                phase += 1
                if phase * PHASE_TICKS in (TICKS // 2, TICKS):
                    readings.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
                if phase * PHASE_TICKS == TICKS - 2 * PHASE_TICKS:
                    tracemalloc.start()  # the last busy and idle phases only: tracing all of them triples the time
            held = _held_by("workers")
    finally:
        tracemalloc.stop()
        monitor.close()
        store.close()
        server.close()
        for key in redis_client.scan_iter(f"{keys.PREFIX}:*at-ro-soak-*"):
            redis_client.delete(key)
    (files_half, threads_half), (files_end, threads_end) = readings
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], errors[:5]
    assert files_end <= files_half + 2, (files_half, files_end)
    assert threads_end <= threads_half, (threads_half, threads_end)
    assert held <= HELD_BYTES, f"{held} bytes allocated by workers/ over the last {2 * PHASE_TICKS} ticks still held"
    print(f"\n{ticks} ticks: {held} bytes held from the last {2 * PHASE_TICKS}, files {files_half} -> {files_end}")
