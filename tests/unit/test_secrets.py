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
        load_settings(store_url="http://127.0.0.1:1", broker_url="sqs://key:secret@")


def test_amqp_urls_with_credentials_and_tls_are_accepted_and_never_shown() -> None:
    settings = load_settings(
        store_url="http://127.0.0.1:1",
        broker_url="amqps://agl:amqp-pw-789@rabbit.example:5671/prod?ssl_cert_reqs=required",
        redis_url="rediss://:coord-pw-123@redis.example:6380/0",
    )
    shown = repr(settings.redacted())
    assert "amqp-pw-789" not in shown and "coord-pw-123" not in shown
    assert "amqps://agl:***@rabbit.example:5671/prod" in shown
    assert redact_url("pyamqp://u:pw@h//") == "pyamqp://u:***@h//"
    text = redact_text("[Errno 111] Connection refused: amqp://agl:amqp-pw-789@rabbit.example:5672/prod")
    assert "amqp-pw-789" not in text and "amqp://agl:***@rabbit.example" in text
    with pytest.raises(ConfigError) as info:  # an AMQP broker needs REDIS_URL; the refusal shows no password
        load_settings(store_url="http://127.0.0.1:1", broker_url="amqp://agl:amqp-pw-789@rabbit.example//")
    assert "REDIS_URL" in info.value.message and "amqp-pw-789" not in info.value.message
