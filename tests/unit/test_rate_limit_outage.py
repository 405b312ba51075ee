"""The global LLM rate limit with a Redis that does not answer: one socket timeout, then a back-off.

The address is a real listening socket that accepts connections and never replies (a hung or
partitioned Redis), so each command waits the full read timeout, unlike a refused connection."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY

from workers.agents import ratelimit
from workers.agents.ratelimit import LLMRateLimiter, RateLimit

READ_TIMEOUT_S = 1.0


@pytest.fixture
def silent_redis() -> Iterator[redis.Redis]:
    """A client for an address that accepts connections (the kernel's backlog) but never answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    client = redis.Redis(
        host="127.0.0.1", port=port, socket_connect_timeout=READ_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S
    )
    try:
        yield client
    finally:
        client.close()
        listener.close()


def _bypassed(op: str) -> float:
    return REGISTRY.get_sample_value("agl_worker_ratelimit_bypassed_total", {"op": op}) or 0.0


def test_after_one_timeout_calls_skip_the_limiter_at_once(silent_redis: redis.Redis) -> None:
    limiter = LLMRateLimiter(silent_redis, f"m-{uuid.uuid4().hex[:8]}", RateLimit(rpm=1, tpm=100))
    before_acquire, before_charge = _bypassed("acquire"), _bypassed("charge")

    started = time.monotonic()
    limiter.acquire()
    first_s = time.monotonic() - started
    assert first_s >= READ_TIMEOUT_S * 0.9, f"{first_s:.2f} s: the address answered after all?"

    started = time.monotonic()
    limiter.acquire()
    limiter.charge_tokens(500)
    # Another limiter on the same Redis (the next attempt of this process) shares the back-off.
    LLMRateLimiter(silent_redis, "other-model", RateLimit(rpm=1)).acquire()
    rest_s = time.monotonic() - started
    assert rest_s < 0.2, f"three more limiter calls took {rest_s:.2f} s: each waited the socket timeout"
    assert _bypassed("acquire") - before_acquire == 3
    assert _bypassed("charge") - before_charge == 1


def test_after_the_back_off_one_caller_probes_and_the_others_go_on(
    silent_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ratelimit, "BYPASS_S", 0.5)
    model = f"m-{uuid.uuid4().hex[:8]}"
    LLMRateLimiter(silent_redis, model, RateLimit(rpm=1)).acquire()  # the failure that starts the back-off
    time.sleep(0.6)  # the back-off is over: the next caller asks Redis again
    durations: list[float] = []
    lock = threading.Lock()

    def call() -> None:
        started = time.monotonic()
        LLMRateLimiter(silent_redis, model, RateLimit(rpm=1)).acquire()
        with lock:
            durations.append(time.monotonic() - started)

    threads = [threading.Thread(target=call) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    slow = [d for d in durations if d >= READ_TIMEOUT_S * 0.9]
    assert len(durations) == 10
    assert len(slow) == 1, f"{len(slow)} callers waited the socket timeout (one probe expected): {durations}"
