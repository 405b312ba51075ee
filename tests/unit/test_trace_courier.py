"""Span payloads of a process's attempts share OTLP requests only when they would otherwise wait, and a
shared request that fails costs no member its spans.

A real HTTP server on 127.0.0.1 parses every request as the Store would (an ``ExportTraceServiceRequest``)
and records which attempts each carried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from bridge.core.infra import StoreError
from bridge.core.store import StoreClient
from tests.loopback import LoopbackServer
from workers.telemetry.courier import TraceCourier

ATTEMPT = "agentlightning.attempt_id"


def _payload(attempt_id: str) -> bytes:
    ids = [KeyValue(key=ATTEMPT, value=AnyValue(string_value=attempt_id))]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(resource=Resource(attributes=ids))])
    return request.SerializeToString()


class OtlpSink(LoopbackServer):
    """Records the attempts of every request; answers 500 to any that carries ``refused`` (as the Store
    answers spans of a rollout it does not know), and holds the first request ``first_delay_s``."""

    def __init__(self, delay_s: float = 0.0, refused: str = "", first_delay_s: float = 0.0) -> None:
        self.requests: list[list[str]] = []
        self._lock = threading.Lock()
        self._delay_s, self._refused, self._first_delay_s = delay_s, refused, first_delay_s
        super().__init__(lambda method, path: (200, {}, b""))

    def respond(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        request = ExportTraceServiceRequest.FromString(body)
        attempts = [
            kv.value.string_value for rs in request.resource_spans for kv in rs.resource.attributes if kv.key == ATTEMPT
        ]
        with self._lock:
            first = not self.requests
            self.requests.append(attempts)
        time.sleep(self._first_delay_s if first else self._delay_s)
        if self._refused in attempts:
            return 500, {"Content-Type": "text/plain"}, b"Internal Server Error"
        return 200, {}, b""

    def delivered(self) -> list[str]:
        """Attempts whose spans were in a request that succeeded, in order."""
        with self._lock:
            return [a for attempts in self.requests if self._refused not in attempts for a in attempts]


@pytest.fixture
def sink_factory() -> Iterator[list[OtlpSink]]:
    sinks: list[OtlpSink] = []
    yield sinks
    for sink in sinks:
        sink.close()


def _courier(sink: OtlpSink, gather_max_s: float = 0.0) -> TraceCourier:
    store = StoreClient(sink.url, retries=1, timeout_s=5)
    return TraceCourier(store, f"{sink.url}/v1/traces", gather_max_s=gather_max_s)


def _send_all(courier: TraceCourier, attempt_ids: list[str], timeout: float = 5.0) -> dict[str, BaseException]:
    errors: dict[str, BaseException] = {}

    def one(attempt_id: str) -> None:
        try:
            courier.send(_payload(attempt_id), deadline=time.time() + timeout, timeout=timeout)
        except BaseException as exc:
            errors[attempt_id] = exc

    threads = [threading.Thread(target=one, args=(a,)) for a in attempt_ids]
    for thread in threads:
        thread.start()
        time.sleep(0.005)  # flushes that end close together, not at the same instant
    for thread in threads:
        thread.join(timeout=30)
    return errors


def test_flushes_that_meet_a_request_in_flight_share_the_next(sink_factory: list[OtlpSink]) -> None:
    sink = OtlpSink(delay_s=0.2)
    sink_factory.append(sink)
    attempts = [f"at-{i}" for i in range(12)]
    assert _send_all(_courier(sink), attempts) == {}
    assert sorted(sink.delivered()) == sorted(attempts)  # every attempt's spans, each exactly once
    assert len(sink.requests) <= 4  # the first alone, the rest gathered behind it: 12 flushes, 2-3 requests
    assert max(len(r) for r in sink.requests) > 1


def test_a_flush_with_nothing_in_flight_goes_at_once(sink_factory: list[OtlpSink]) -> None:
    sink = OtlpSink()
    sink_factory.append(sink)
    courier = _courier(sink)
    started = time.monotonic()
    courier.send(_payload("at-alone"), deadline=time.time() + 5, timeout=5)
    assert time.monotonic() - started < 0.5
    assert sink.requests == [["at-alone"]]


def test_a_member_the_store_refuses_costs_the_others_one_try_not_their_spans(sink_factory: list[OtlpSink]) -> None:
    sink = OtlpSink(delay_s=0.2, refused="at-gone")
    sink_factory.append(sink)
    attempts = ["at-0", "at-1", "at-gone", "at-3", "at-4", "at-5"]
    errors = _send_all(_courier(sink), attempts)
    assert set(errors) == {"at-gone"} and isinstance(errors["at-gone"], StoreError)
    assert sorted(sink.delivered()) == sorted(a for a in attempts if a != "at-gone")
    assert any(len(r) > 1 and "at-gone" in r for r in sink.requests)  # it did share a request, which failed


def test_a_member_short_of_time_stops_waiting_for_a_slow_request(sink_factory: list[OtlpSink]) -> None:
    sink = OtlpSink(first_delay_s=3.0)
    sink_factory.append(sink)
    courier = _courier(sink)
    slow = threading.Thread(target=courier.send, args=(_payload("at-slow"),), kwargs={"deadline": None, "timeout": 10})
    slow.start()
    time.sleep(0.3)  # the slow request is in flight
    started = time.monotonic()
    courier.send(_payload("at-short"), deadline=time.time() + 1.2, timeout=1.2)
    assert time.monotonic() - started < 2.5  # went alone before the slow request's 3 s were up
    slow.join(timeout=10)
    assert sorted(sink.delivered()) == ["at-short", "at-slow"]


def test_an_error_that_is_not_the_stores_answer_reaches_the_leader_and_spares_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E.g. Celery's soft time limit raised inside the shared request: the thread that sent it must see it."""
    delivered: list[bytes] = []

    def post(payload: bytes, **kwargs: object) -> None:
        if kwargs.get("once"):
            raise RuntimeError("time limit")
        time.sleep(0.3)  # keeps the first request in flight while the others gather
        delivered.append(payload)

    store = StoreClient("http://127.0.0.1:9")
    monkeypatch.setattr(store, "post_traces", post)
    courier = TraceCourier(store)
    errors = _send_all(courier, ["at-first", "at-leader", "at-other"])
    assert len(errors) == 1 and isinstance(next(iter(errors.values())), RuntimeError)
    failed = next(iter(errors))
    assert sorted(delivered) == sorted(_payload(a) for a in ["at-first", "at-leader", "at-other"] if a != failed)


def _gathering(sink: OtlpSink, *, running: int, episode_s: float, gather_max_s: float = 0.25) -> TraceCourier:
    """A courier of a process with ``running`` attempts whose episodes have lasted ``episode_s``."""
    courier = _courier(sink, gather_max_s)
    for _ in range(running):
        courier.opened()
    courier.send(_payload("at-measured"), deadline=None, timeout=5, running_s=episode_s)
    return courier


def test_the_wait_for_others_is_a_share_of_the_episode_and_only_where_others_are_due(
    sink_factory: list[OtlpSink],
) -> None:
    sink = OtlpSink()
    sink_factory.append(sink)
    # 128 threads of 15 s episodes: 1% of an episode is 0.15 s, in which 127 others end 1.27 times.
    assert _gathering(sink, running=128, episode_s=15.0).gather_s() == pytest.approx(0.15)
    assert _gathering(sink, running=256, episode_s=60.0).gather_s() == pytest.approx(0.25)  # capped: 1.06 others
    assert _gathering(sink, running=128, episode_s=60.0).gather_s() == 0.0  # capped: 0.53 others, no wait
    assert _gathering(sink, running=32, episode_s=15.0).gather_s() == 0.0  # 0.3 others expected: no wait
    assert _gathering(sink, running=1, episode_s=15.0).gather_s() == 0.0  # prefork: one attempt a process
    assert _gathering(sink, running=128, episode_s=15.0, gather_max_s=0).gather_s() == 0.0  # turned off
    fresh = TraceCourier(StoreClient(sink.url), gather_max_s=0.25)
    for _ in range(128):
        fresh.opened()
    assert fresh.gather_s() == 0.0  # no episode measured yet
    ending = _gathering(sink, running=128, episode_s=15.0)
    for _ in range(100):
        ending.closed()  # 28 attempts left running: 0.27 others expected
    assert ending.gather_s() == 0.0


def test_flushes_that_end_apart_share_a_request_when_the_leader_waits_for_them(sink_factory: list[OtlpSink]) -> None:
    """With nothing in flight each flush would go alone; a leader waiting its share gathers those behind it."""
    attempts = [f"at-{i}" for i in range(5)]
    counts = {}
    for cap in (0.0, 1.0):
        sink = OtlpSink()
        sink_factory.append(sink)
        courier = _gathering(sink, running=200, episode_s=100.0, gather_max_s=cap)  # a wait of 1 s when on
        sink.requests.clear()
        threads = [
            threading.Thread(target=courier.send, args=(_payload(a),), kwargs={"deadline": None, "timeout": 5})
            for a in attempts
        ]
        for thread in threads:
            thread.start()
            time.sleep(0.1)  # apart: each request (to a sink that answers at once) is done before the next
        for thread in threads:
            thread.join(timeout=10)
        assert sorted(sink.delivered()) == attempts
        counts[cap] = len(sink.requests)
    assert counts[0.0] == 5
    assert counts[1.0] == 1


def test_a_leader_stops_waiting_for_others_while_it_keeps_time_for_its_own_try(sink_factory: list[OtlpSink]) -> None:
    sink = OtlpSink()
    sink_factory.append(sink)
    courier = _gathering(sink, running=200, episode_s=300.0, gather_max_s=3.0)  # a wait of 3 s
    assert courier.gather_s() == pytest.approx(3.0)
    started = time.monotonic()
    courier.send(_payload("at-short"), deadline=time.time() + 1.0, timeout=1.0)
    assert time.monotonic() - started < 0.9  # waited 1.0 - 2 x 0.2 s at most, then sent
    assert sink.requests[-1] == ["at-short"]
