"""Reliability building blocks against a real Redis: the global LLM rate limit, the lease, secret-free settings."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core import keys
from bridge.core.errors import Superseded
from bridge.core.redact import redact_text
from bridge.core.settings import ConfigError, load_settings
from workers.lease import Claim, Lease, mark_done
from workers.ratelimit import LLMRateLimiter, RateLimit

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(TEST_REDIS_URL, socket_timeout=5)
    try:
        conn.ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}")
    yield conn
    conn.close()


def _model() -> str:
    return f"test-model-{uuid.uuid4().hex[:8]}"


def test_two_workers_share_one_request_budget(client: redis.Redis) -> None:
    """Two limiters (two workers, two connections) on one model draw from the same bucket."""
    model = _model()
    limit = RateLimit(rpm=60, burst_s=2)  # 1 request/s, bucket of 2
    other = redis.Redis.from_url(TEST_REDIS_URL)
    first, second = LLMRateLimiter(client, model, limit), LLMRateLimiter(other, model, limit)
    assert first.acquire() < 0.2
    assert second.acquire() < 0.2
    waited = first.acquire()  # the bucket is empty for both now: about one second's refill
    assert waited >= 0.5
    assert client.exists(f"agl:ratelimit:{model}")
    other.close()


def test_tokens_used_slow_down_the_next_call(client: redis.Redis) -> None:
    model = _model()
    limiter = LLMRateLimiter(client, model, RateLimit(tpm=600, burst_s=1))  # 10 tokens/s, bucket of 10
    assert limiter.acquire() < 0.2
    limiter.charge_tokens(15)  # 5 tokens below zero: half a second to pay back
    assert limiter.acquire() >= 0.3


def test_a_stopped_attempt_stops_waiting_for_budget(client: redis.Redis) -> None:
    model = _model()
    limiter = LLMRateLimiter(client, model, RateLimit(rpm=1, burst_s=1))
    limiter.acquire()

    def stop() -> None:
        raise Superseded("rollout is cancelled")

    started = time.monotonic()
    with pytest.raises(Superseded):
        limiter.acquire(stop)
    assert time.monotonic() - started < 5  # not the 60 s the next request would need


def test_an_unreachable_limiter_lets_calls_through() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, socket_timeout=0.5)
    limiter = LLMRateLimiter(dead, _model(), RateLimit(rpm=1))
    limiter.acquire()  # no exception: the call goes ahead (redis-py's own reconnect retries take a few seconds)
    limiter.acquire()  # and again, although an rpm of 1 would make a working limiter wait a minute


def test_no_limit_configured_means_no_redis_traffic(client: redis.Redis) -> None:
    model = _model()
    assert LLMRateLimiter(client, model, RateLimit()).acquire() == 0.0
    assert not client.exists(f"agl:ratelimit:{model}")


def test_per_model_limits_override_the_defaults() -> None:
    settings = load_settings(
        store_url="http://127.0.0.1:1", llm_rpm=100, llm_rate_limits="Qwen/Qwen2.5-7B:v1=60:9000,small=30"
    )
    assert settings.llm_rate_limit("Qwen/Qwen2.5-7B:v1") == (60.0, 9000.0)
    assert settings.llm_rate_limit("small") == (30.0, None)
    assert settings.llm_rate_limit("other") == (100.0, None)
    with pytest.raises(ConfigError, match="LLM_RATE_LIMITS"):
        load_settings(store_url="http://127.0.0.1:1", llm_rate_limits="m=fast")


def test_lease_admits_one_executor_and_survives_a_lost_key(client: redis.Redis) -> None:
    attempt = f"at-{uuid.uuid4().hex[:8]}"
    mine, theirs = Lease(client, attempt, 5), Lease(client, attempt, 5)
    try:
        assert mine.claim(60).acquired
        assert not theirs.claim(60).acquired
        assert 0 < theirs.remaining_s() <= 5
        client.delete(mine.key)  # Redis restarted without persistence: the live executor takes it back
        assert mine.renew()
        assert not theirs.renew()  # someone else's lease is never taken over by a renewal
        mine.release()
        assert theirs.claim(60).acquired
        theirs.release()
    finally:
        client.delete(keys.lease(attempt), keys.started(attempt))


def test_claim_tells_first_starts_takeovers_held_and_finished_attempts(client: redis.Redis) -> None:
    attempt = f"at-claim-{uuid.uuid4().hex[:8]}"
    try:
        first = Lease(client, attempt, 5)
        assert first.claim(60) == Claim(True, first_start=True)
        assert Lease(client, attempt, 5).claim(60) == Claim(False)  # held: a duplicate delivery
        first.release()
        takeover = Lease(client, attempt, 5)
        assert takeover.claim(60) == Claim(True, first_start=False)  # started before: read the Store first
        takeover.release()
        mark_done(client, attempt, "succeeded", 60)
        assert Lease(client, attempt, 5).claim(60) == Claim(False, done_status="succeeded")
        assert client.exists(keys.lease(attempt)) == 0  # a finished attempt is not leased again
    finally:
        client.delete(keys.lease(attempt), keys.started(attempt), keys.done(attempt))


def test_settings_accept_password_and_tls_redis_urls_and_never_show_secrets() -> None:
    settings = load_settings(
        store_url="http://127.0.0.1:1",
        broker_url="rediss://:s3cret-pw@redis.example:6380/0?ssl_cert_reqs=required",
        openai_api_key="sk-live-123",
        store_token="store-tok-456",
        webshop_token="shop-tok-789",
    )
    shown = repr(settings.redacted())
    for secret in ("s3cret-pw", "sk-live-123", "store-tok-456", "shop-tok-789"):
        assert secret not in shown
    assert "rediss://:***@redis.example:6380/0" in shown
    assert "s3cret-pw" not in redact_text("Error connecting to redis://:s3cret-pw@redis.example:6380")
    with pytest.raises(ConfigError, match="CELERY_BROKER_URL"):
        load_settings(store_url="http://127.0.0.1:1", broker_url="amqp://guest@localhost")


def test_a_password_protected_redis_works_through_a_url(tmp_path: pytest.TempPathFactory) -> None:
    """Leases and the rate limiter run unchanged against ``redis://:password@...``."""
    from bridge.tools.stack import ManagedProcess, find_redis_server, free_port, redis_answers

    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    url = f"redis://:pw-{port}@127.0.0.1:{port}/0"
    proc = ManagedProcess(
        "redis-auth",
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", f"pw-{port}"],
        tmp_path / "redis.log",  # type: ignore[operator]
        lambda: redis_answers(url),
        startup_timeout_s=20,
    )
    proc.start()
    try:
        proc.wait_healthy()
        assert not redis_answers(f"redis://127.0.0.1:{port}/0")  # the password is really required
        client = redis.Redis.from_url(url)
        assert Lease(client, "at-auth", 5).claim(60).acquired
        assert LLMRateLimiter(client, "m", RateLimit(rpm=60)).acquire() < 0.2
        client.close()
    finally:
        proc.stop()
