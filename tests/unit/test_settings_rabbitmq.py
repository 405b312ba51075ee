"""RabbitMQ as broker: which URLs are accepted, the coordination Redis it needs, and its consumer timeout.

RabbitMQ closes the channel of a consumer holding an unacknowledged message past its ``consumer_timeout``; the
settings must refuse a hard time limit that would not fit under it, as they do for Redis's visibility timeout.
"""

from __future__ import annotations

import os

import pytest
from celery import Celery

from bridge.core.coordination import coordination_redis
from bridge.core.infra import ConfigError
from bridge.core.settings import Settings, load_settings
from bridge.core.task import base_app, clamp_to_broker, hard_time_limit, longest_timeout_s

STORE = "http://127.0.0.1:4747"
AMQP = "amqp://agl:s3cret-amqp@rabbit.example:5672/agl"
REDIS = "redis://:redis-pw@redis.example:6379/3"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for name in list(os.environ):
        if name.startswith(("AGENT_LIGHTNING", "CELERY_", "BRIDGE_", "BROKER_", "ROLLOUT_", "REDIS_", "QUEUE_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(str(tmp_path))  # no stray .env


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0",
        "rediss://:pw@h:6380/0",
        "redis+socket:///tmp/r.sock",
        AMQP,
        "amqps://u:p@h/v",
        "pyamqp://h//",
    ],
)
def test_redis_and_amqp_broker_urls_are_accepted(url: str) -> None:
    settings = load_settings(store_url=STORE, broker_url=url, redis_url="redis://h:6379/1")
    assert settings.broker_is_amqp == url.startswith(("amqp", "pyamqp"))


@pytest.mark.parametrize("url", ["sqs://", "kafka://h:9092", "memory://", "http://h"])
def test_other_brokers_are_refused_naming_the_variable(url: str) -> None:
    with pytest.raises(ConfigError, match=r"CELERY_BROKER_URL: .*Redis or RabbitMQ"):
        load_settings(store_url=STORE, broker_url=url)


def test_an_amqp_broker_without_redis_url_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="REDIS_URL must be set with a RabbitMQ broker") as info:
        load_settings(store_url=STORE, broker_url=AMQP)
    assert "s3cret-amqp" not in info.value.message
    with pytest.raises(ConfigError, match=r"REDIS_URL: .*expected a Redis URL"):
        load_settings(store_url=STORE, broker_url=AMQP, redis_url=AMQP)


def test_coordination_is_redis_url_else_a_redis_broker() -> None:
    redis_broker = load_settings(store_url=STORE, broker_url=REDIS)
    assert redis_broker.coordination_url == REDIS
    split = load_settings(store_url=STORE, broker_url=REDIS, redis_url="redis://other:6379/0")
    assert split.coordination_url == "redis://other:6379/0"
    amqp = load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)
    assert amqp.coordination_url == REDIS
    client = coordination_redis(amqp, timeout_s=2)  # opens no connection until used
    assert client.connection_pool.connection_kwargs["host"] == "redis.example"
    assert client.connection_pool.connection_kwargs["db"] == 3
    assert client.connection_pool.connection_kwargs[
        "decode_responses"
    ]  # answers are str (bridge.core.coordination.connection)


def test_the_consumer_timeout_must_cover_the_hard_limit_and_queue_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: 900 s rollouts -> hard limit 855 s + 300 s queue wait < RabbitMQ's 1,800 s default."""
    settings = load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)
    assert settings.redelivery_timeout_s == 1800.0
    monkeypatch.setenv("ROLLOUT_DEFAULT_TIMEOUT_S", "1800")
    with pytest.raises(ConfigError) as info:
        load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)
    assert "BROKER_CONSUMER_TIMEOUT_S (1800s) must exceed" in info.value.message
    assert "consumer_timeout" in info.value.message and "s3cret-amqp" not in info.value.message
    monkeypatch.setenv("BROKER_CONSUMER_TIMEOUT_S", "3600")  # a server configured with consumer_timeout = 3600000
    assert hard_time_limit(load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS), None) == 1710.0
    # The visibility timeout is Redis's rule only: it does not bound an AMQP deployment, nor the reverse.
    monkeypatch.setenv("BROKER_VISIBILITY_TIMEOUT_S", "60")
    load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)
    with pytest.raises(ConfigError, match="BROKER_VISIBILITY_TIMEOUT_S"):
        load_settings(store_url=STORE, broker_url=REDIS)


def test_rollouts_longer_than_the_consumer_timeout_covers_are_clamped() -> None:
    settings = Settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)  # type: ignore[arg-type]
    longest = longest_timeout_s(settings)
    assert hard_time_limit(settings, longest) + settings.max_queue_wait_s < settings.consumer_timeout_s
    assert clamp_to_broker(settings, 7200) == longest < 1800
    assert clamp_to_broker(settings, 600) == 600


def _app(settings: Settings) -> Celery:
    return base_app(settings, "test")


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_amqp_apps_confirm_publishes_and_declare_durable_queues_of_the_chosen_type(queue_type: str) -> None:
    settings = load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS, queue_type=queue_type)
    app = _app(settings)
    assert app.conf.broker_transport_options == {"confirm_publish": True}
    assert app.conf.task_default_delivery_mode == "persistent"
    queue = app.amqp.queues[settings.default_queue]
    assert queue.durable and queue.name == "rollouts"
    assert (queue.queue_arguments or {}).get("x-queue-type") == (None if queue_type == "classic" else "quorum")
    created = app.amqp.queues["rollouts-train"]  # a queue named by QUEUE_BY_MODE or -Q: created on demand
    assert (created.queue_arguments or {}).get("x-queue-type") == (None if queue_type == "classic" else "quorum")
    redis_app = _app(load_settings(store_url=STORE, broker_url=REDIS))
    assert redis_app.conf.broker_transport_options == {"visibility_timeout": 7200}


def test_queue_type_is_checked() -> None:
    with pytest.raises(ConfigError, match="QUEUE_TYPE"):
        load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS, queue_type="stream")


def test_amqp_urls_are_redacted_wherever_settings_are_shown() -> None:
    settings = load_settings(store_url=STORE, broker_url=AMQP, redis_url=REDIS)
    shown = repr(settings.redacted())
    assert "s3cret-amqp" not in shown and "redis-pw" not in shown
    assert "amqp://agl:***@rabbit.example:5672/agl" in shown and "redis://:***@redis.example:6379/3" in shown
