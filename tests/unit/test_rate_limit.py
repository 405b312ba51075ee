"""The global LLM rate limit: one token bucket per model in Redis, shared by every worker.

The Redis tests use this test process's Redis (``tests/redis_for_tests.py``)."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bridge.core.coordination import coordination_client, keys
from bridge.core.infra import ConfigError, Superseded
from bridge.core.settings import load_settings
from tests.helpers import TEST_REDIS_URL
from workers.agents.ratelimit import LLMRateLimiter, RateLimit


def _model() -> str:
    return f"test-model-{uuid.uuid4().hex[:8]}"


def test_two_workers_share_one_request_budget(redis_client: redis.Redis) -> None:
    """Two limiters (two workers, two connections) on one model draw from the same bucket."""
    model = _model()
    limit = RateLimit(rpm=60, burst_s=2)  # 1 request/s, bucket of 2
    other = coordination_client(TEST_REDIS_URL)
    first, second = LLMRateLimiter(redis_client, model, limit), LLMRateLimiter(other, model, limit)
    assert first.acquire() < 0.2
    assert second.acquire() < 0.2
    waited = first.acquire()  # the bucket is empty for both now: about one second's refill
    assert waited >= 0.5
    assert redis_client.exists(keys.ratelimit(model))
    other.close()


def test_tokens_used_slow_down_the_next_call(redis_client: redis.Redis) -> None:
    model = _model()
    limiter = LLMRateLimiter(redis_client, model, RateLimit(tpm=600, burst_s=1))  # 10 tokens/s, bucket of 10
    assert limiter.acquire() < 0.2
    limiter.charge_tokens(15)  # 5 tokens below zero: half a second to pay back
    assert limiter.acquire() >= 0.3


def test_a_stopped_attempt_stops_waiting_for_budget(redis_client: redis.Redis) -> None:
    model = _model()
    limiter = LLMRateLimiter(redis_client, model, RateLimit(rpm=1, burst_s=1))
    limiter.acquire()

    def stop() -> None:
        raise Superseded("rollout is cancelled")

    started = time.monotonic()
    with pytest.raises(Superseded):
        limiter.acquire(stop)
    assert time.monotonic() - started < 5  # not the 60 s the next request would need


def test_an_unreachable_limiter_lets_calls_through(caplog: pytest.LogCaptureFixture) -> None:
    """Redis down: each call goes ahead after at most its socket timeouts, never after the budget's wait."""
    connect_s = read_s = 0.5
    retries = 1
    dead = redis.Redis(
        host="127.0.0.1",
        port=1,  # nothing listens there: connection refused
        socket_connect_timeout=connect_s,
        socket_timeout=read_s,
        retry=Retry(NoBackoff(), retries),
    )
    limiter = LLMRateLimiter(dead, _model(), RateLimit(rpm=1))  # a working limiter would make call 2 wait 60 s
    # Per call at most two commands (EVALSHA, and SCRIPT LOAD if Redis lost the script), each tried
    # 1 + retries times, each try bounded by the connect and the read timeout; plus 1 s of slack.
    per_call_s = 2 * (1 + retries) * (connect_s + read_s)
    bound_s = 2 * per_call_s + 1.0

    def must_not_wait() -> None:  # the limiter calls this between the sleeps of a wait for budget
        raise AssertionError("the limiter waits for budget although Redis is unreachable")

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="workers.agents.ratelimit"):
        limiter.acquire(must_not_wait)
        limiter.acquire(must_not_wait)
    elapsed = time.monotonic() - started
    assert elapsed < bound_s, (
        f"two calls with Redis unreachable took {elapsed:.1f} s; the socket timeouts allow {bound_s:.1f} s: "
        "the limiter waited for budget instead of letting the calls through"
    )
    warned = [r for r in caplog.records if r.name == "workers.agents.ratelimit" and r.levelno == logging.WARNING]
    # The first call pays the outage and starts the back-off (one warning); the second skips the limiter.
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_no_limit_configured_means_no_redis_traffic(redis_client: redis.Redis) -> None:
    model = _model()
    assert LLMRateLimiter(redis_client, model, RateLimit()).acquire() == 0.0
    assert not redis_client.exists(keys.ratelimit(model))


def test_per_model_limits_override_the_defaults() -> None:
    settings = load_settings(
        store_url="http://127.0.0.1:1", llm_rpm=100, llm_rate_limits="Qwen/Qwen2.5-7B:v1=60:9000,small=30"
    )
    assert settings.llm_rate_limit("Qwen/Qwen2.5-7B:v1") == (60.0, 9000.0)
    assert settings.llm_rate_limit("small") == (30.0, None)
    assert settings.llm_rate_limit("other") == (100.0, None)
    with pytest.raises(ConfigError, match="LLM_RATE_LIMITS"):
        load_settings(store_url="http://127.0.0.1:1", llm_rate_limits="m=fast")
