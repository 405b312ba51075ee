"""Secrets in URLs, tokens and error texts are masked wherever settings or errors are shown."""

from __future__ import annotations

import pytest

from bridge.core.redact import redact_text, redact_url
from bridge.core.settings import ConfigError, load_settings


def test_urls_and_error_texts_lose_their_passwords_and_keys() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    assert redact_url("http://h:1/v1") == "http://h:1/v1"
    assert "sk-123" not in redact_text("failed: api_key=sk-123 at redis://:pw@h:1")
    assert "pw" not in redact_text("at redis://:pw@h:1")


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
