"""TLS broker and Redis URLs check certificates unless BROKER_TLS_INSECURE says otherwise (``bridge.core.infra.tls``).

Left alone, kombu connects to a ``rediss://`` broker with ``CERT_NONE`` and py-amqp checks no host name for
``amqps://``. No TLS server is needed: the Celery app's configuration and the redis client's connection
options are what decide.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import pytest
import redis

from bridge.core.coordination import coordination_redis
from bridge.core.infra import ConfigError, process_state, tls
from bridge.core.settings import Settings, load_settings
from bridge.core.task import base_app
from bridge.dispatch import broker

VERIFIED = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}
UNVERIFIED = {"ssl_cert_reqs": ssl.CERT_NONE, "ssl_check_hostname": False}


def _settings(broker_url: str, **overrides: Any) -> Settings:
    return load_settings(store_url="http://127.0.0.1:1", broker_url=broker_url, **overrides)


def _redis_options(client: redis.Redis) -> dict[str, Any]:
    kwargs = client.connection_pool.connection_kwargs
    return {key: kwargs.get(key) for key in VERIFIED}


def test_a_rediss_broker_and_coordination_redis_check_certificates_by_default() -> None:
    settings = _settings("rediss://:pw@redis.example:6380/0")
    app = base_app(settings, "tls-unit")
    assert app.conf.broker_use_ssl == VERIFIED
    assert app.connection_for_write().ssl == VERIFIED  # what kombu's Redis transport hands to redis-py
    client = coordination_redis(settings)
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert _redis_options(client) == VERIFIED


def test_an_amqps_broker_checks_the_certificate_and_the_host_name() -> None:
    settings = _settings("amqps://agl:pw@rabbit.example:5671/prod", redis_url="rediss://redis.example:6380/0")
    app = base_app(settings, "tls-unit")
    # server_hostname None: kombu fills in the broker's host, which turns py-amqp's host name check on.
    assert app.conf.broker_use_ssl == {"cert_reqs": ssl.CERT_REQUIRED, "server_hostname": None}
    assert _redis_options(coordination_redis(settings)) == VERIFIED


def test_plain_urls_get_no_tls_options() -> None:
    settings = _settings("redis://127.0.0.1:1/0")
    assert not base_app(settings, "tls-unit").conf.broker_use_ssl
    assert tls.redis_client_options(settings.coordination_url, settings) == {}
    assert "ssl_cert_reqs" not in coordination_redis(settings).connection_pool.connection_kwargs


def test_opting_out_is_explicit_and_warned_once(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    process_state.reset()  # no URL warned about yet in this process
    with pytest.raises(ConfigError, match="BROKER_TLS_INSECURE") as info:
        _settings("rediss://:s3cret@redis.example:6380/0?ssl_cert_reqs=none")
    assert "CELERY_BROKER_URL" in info.value.message and "s3cret" not in info.value.message
    with pytest.raises(ConfigError, match="REDIS_URL"):
        _settings("amqps://rabbit.example//", redis_url="rediss://redis.example/0?ssl_check_hostname=false")
    settings = _settings("rediss://:s3cret@redis.example:6380/0?ssl_cert_reqs=none", broker_tls_insecure=True)
    with caplog.at_level(logging.WARNING, logger="bridge.tls"):
        app = base_app(settings, "tls-unit")
        client = coordination_redis(settings)
        base_app(settings, "tls-unit")
    assert app.conf.broker_use_ssl == UNVERIFIED and _redis_options(client)["ssl_check_hostname"] is False
    warnings = [r.getMessage() for r in caplog.records if r.name == "bridge.tls"]
    assert len(warnings) == 1 and "BROKER_TLS_INSECURE" in warnings[0] and "s3cret" not in warnings[0]
    amqps = _settings("amqps://rabbit.example//", redis_url="redis://r/0", broker_tls_insecure=True)
    assert base_app(amqps, "tls-unit").conf.broker_use_ssl == {"cert_reqs": ssl.CERT_NONE}


@pytest.mark.parametrize("insecure", [False, True])
def test_the_queue_depth_probe_uses_the_same_tls_checks_as_the_workers(insecure: bool) -> None:
    """``status`` and the bridge's queue gauges read the broker too: with the same checks, and the same opt-out."""
    plain = coordination_redis(_settings("redis://127.0.0.1:1/0"))
    separate = _settings(
        "rediss://redis.example:6380/0", redis_url="redis://127.0.0.1:1/0", broker_tls_insecure=insecure
    )
    redis_probe = broker.queues_for(separate, plain)
    assert isinstance(redis_probe, broker.RedisQueues)
    assert _redis_options(redis_probe.broker) == (UNVERIFIED if insecure else VERIFIED)
    amqps = _settings("amqps://rabbit.example//", redis_url="redis://r/0", broker_tls_insecure=insecure)
    amqp_probe = broker.queues_for(amqps, plain)
    assert isinstance(amqp_probe, broker.AmqpQueues)
    assert amqp_probe.use_ssl == tls.broker_use_ssl(amqps) == base_app(amqps, "tls-unit").conf.broker_use_ssl
