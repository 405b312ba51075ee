"""The Redis broker's channel reuses one client per pool (``bridge.core.patches.kombu_redis_client``), against the real
Redis of this test process: messages go and come as before, and a replaced pool gets a client of its own."""

from __future__ import annotations

import uuid

import redis
from celery import Celery
from kombu import Queue

from bridge.core.patches import kombu_redis_client
from bridge.core.settings import load_settings
from bridge.core.task import base_app
from tests.helpers import TEST_REDIS_URL


def _app(broker_url: str) -> Celery:
    settings = load_settings(store_url="http://127.0.0.1:9", broker_url=broker_url, redis_url=TEST_REDIS_URL)
    return base_app(settings, "patch-test")


def test_a_redis_broker_uses_the_reusing_transport_and_amqp_does_not() -> None:
    assert _app(TEST_REDIS_URL).conf.broker_transport == kombu_redis_client.TRANSPORT
    assert _app("amqp://guest:guest@127.0.0.1:5672//").conf.broker_transport is None


def test_one_client_per_pool_carries_messages_both_ways(redis_client: redis.Redis) -> None:
    app = _app(TEST_REDIS_URL)
    name = f"patch-test-{uuid.uuid4().hex[:8]}"
    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            assert isinstance(channel, kombu_redis_client.Channel)
            with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
                assert first is second and first.connection_pool is channel.pool
            given = object()
            with channel.conn_or_acquire(given) as passed:
                assert passed is given  # a caller's own client or pipeline is used as it is

            queue = Queue(name, routing_key=name)
            with connection.Producer() as producer:
                for number in range(3):
                    producer.publish({"n": number}, routing_key=name, declare=[queue], serializer="json")
            received = []
            with connection.SimpleQueue(queue) as simple:
                for _ in range(3):
                    message = simple.get(timeout=5)
                    received.append(message.payload["n"])
                    message.ack()
            assert received == [0, 1, 2]
            assert redis_client.llen(name) == 0

            old = first
            channel._disconnect_pools()  # what kombu does after a connection error
            with channel.conn_or_acquire() as renewed:
                assert renewed is not old and renewed.connection_pool is channel.pool
                assert renewed.ping()
    finally:
        redis_client.delete(name)
