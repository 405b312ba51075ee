"""Long-lived dispatchers: 10,000 ticks of each line, busy and idle in turns, leave nothing growing behind.

A bridge and a 1.0 dispatcher run for weeks, mostly idle between training steps. Counters, back-offs and caches
that grow with the ticks show only after days (an unbounded empty-poll count overflowed a float after about
1,000 idle polls); here the ticks come as fast as the loop can turn them (the waits each tick returns are not
slept: a fast clock), over the lines of ``tests/fakes/lines.py`` (real dispatchers and Redis; the Store,
the gateway and the broker as plain objects). What must hold: no error logged, every wait within the line's bounds,
the open files and threads no more at the end than half-way, and of what the dispatch code allocated over the last
1,000 ticks (``tracemalloc``, allocations in ``bridge/``) almost nothing still held.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import tracemalloc

import pytest
import redis

from bridge.core.coordination import keys
from tests.fakes.lines import QUEUE, SLOTS, Line

pytestmark = [
    pytest.mark.cost(40),  # 10,000 ticks of each line: about 20 s each on 2 busy cores
    pytest.mark.nightly("a soak: the empty-poll bound and each line's waits are unit tests that run every time"),
]

TICKS = 10_000
PHASE_TICKS = 500  # busy, then idle, and so on: 20 phases
TRACED_TICKS = 1_000  # the last ones, a busy phase and an idle one
# What their allocations in bridge/ may still hold at the end: a leak of 64 bytes a tick shows. Measured: 24 bytes (1.0
# line) and about 15 KiB (0.3 line: blocks the allocator keeps for reuse, with no live object allocated there).
HELD_BYTES = 64 * 1024


def _held_by_dispatch_code() -> int:
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"*{os.sep}bridge{os.sep}*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


class ErrorsOnly(logging.Handler):
    """Keeps the text of ERROR records only. Warnings are not even made during the loop (the ``bridge`` loggers are at
    ERROR): pytest's capture keeps every record with its arguments, which would count as memory the dispatch code
    still holds, and a starved test process may log one a tick (a leader lock lost for seconds, measured)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_ten_thousand_ticks_busy_and_idle_leave_memory_files_and_threads_flat(
    line: Line,
    redis_client: redis.Redis,
) -> None:
    dispatcher = line.dispatcher
    dispatcher.leader_lock.ensure()
    inflight = keys.inflight(dispatcher.scope, QUEUE)
    longest = max(dispatcher.settings.poll_max_s, 60.0)  # any wait beyond this is a runaway back-off
    published_before = len(line.published())
    readings: list[tuple[int, int]] = []
    errors = ErrorsOnly()
    logging.getLogger().addHandler(errors)
    bridge_logs = logging.getLogger("bridge")
    level = bridge_logs.level
    bridge_logs.setLevel(logging.ERROR)
    try:
        for tick in range(TICKS):
            busy = (tick // PHASE_TICKS) % 2 == 0
            if busy and tick % 4 == 0:
                line.add_waiting(SLOTS)
            wait = dispatcher.tick_surviving()
            assert 0.0 <= wait <= longest, (tick, wait)
            redis_client.delete(inflight)  # the workers finished what was published: its slots are free
            if tick + 1 in (TICKS // 2, TICKS):
                readings.append((_open_files(), threading.active_count()))
            if tick + 1 == TICKS - TRACED_TICKS:
                tracemalloc.start()  # only the last ticks: tracing all of them would triple the test's time
        dispatched = len(line.published()) - published_before
        line.forget()  # what the fakes recorded was made by bridge/ code, but only the fakes hold it
        held = _held_by_dispatch_code()  # allocated in bridge/ during the traced ticks and still alive
    finally:
        tracemalloc.stop()
        logging.getLogger().removeHandler(errors)
        bridge_logs.setLevel(level)
    (files_half, threads_half), (files_end, threads_end) = readings
    assert errors.messages == [], errors.messages[:5]
    assert dispatched >= TICKS // 2 // 4 * SLOTS // 2  # it did dispatch
    assert held <= HELD_BYTES, f"{held} bytes allocated by bridge/ over the last {TRACED_TICKS} ticks still held"
    assert files_end <= files_half + 2, (files_half, files_end)
    assert threads_end <= threads_half, (threads_half, threads_end)
    print(
        f"\n{dispatcher.line}: {held} bytes held from the last {TRACED_TICKS} ticks, files {files_half} -> {files_end}"
    )
