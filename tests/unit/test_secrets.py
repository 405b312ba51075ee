"""Secrets in URLs, tokens and error texts are masked wherever settings or errors are shown."""

from __future__ import annotations

import pytest

from bridge.core.infra import ConfigError, redact_text, redact_url
from bridge.core.settings import load_settings


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


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer tok-SECRET.abc_def",
        "{'Authorization': 'Bearer tok-SECRET', 'Accept': 'application/json'}",
        "authorization=tok-SECRET",
        "Authorization: Basic tok-SECRET==",
        "the proxy answered 401 to Bearer tok-SECRET; retrying",
        "bearer\ttok-SECRET",
    ],
)
def test_bearer_tokens_and_authorization_values_are_masked(text: str) -> None:
    shown = redact_text(text)
    assert "tok-SECRET" not in shown and "***" in shown
    assert redact_text(shown) == shown


def test_authorization_keeps_its_scheme_readable() -> None:
    assert redact_text("Authorization: Bearer abc") == "Authorization: Bearer ***"
    assert redact_text("Authorization: abc was rejected") == "Authorization: *** was rejected"


@pytest.mark.parametrize(
    "name", ["api_key", "apikey", "key", "token", "access_token", "sig", "signature", "X-Amz-Signature", "password"]
)
def test_secret_query_values_are_masked_in_urls_and_in_text(name: str) -> None:
    url = f"https://llm.example:8443/v1/chat?model=m&{name}=val-SECRET&page=2#top"
    assert redact_url(url) == f"https://llm.example:8443/v1/chat?model=m&{name}=***&page=2#top"
    text = redact_text(f"POST {url} failed: 500")
    assert "val-SECRET" not in text and "model=m" in text and "failed: 500" in text


def test_url_redaction_keeps_what_is_not_secret() -> None:
    assert redact_url("https://h/x?model=m&ssl_cert_reqs=required") == "https://h/x?model=m&ssl_cert_reqs=required"
    assert redact_url("https://h/cb#access_token=at-SECRET&state=1") == "https://h/cb#access_token=***&state=1"
    assert redact_url("http://u:pw-SECRET@h:1/p?token=t-SECRET") == "http://u:***@h:1/p?token=***"
    assert "pw-SECRET" not in redact_url("redis://:pw-SECRET@h:99999/0")  # a port urllib cannot read
    assert redact_url("https://h/x?key=") == "https://h/x?key="
