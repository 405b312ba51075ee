"""The one place that opens the coordination Redis: leases, slot accounting, rate limits, the leader lock.

With a Redis broker it is the broker's own Redis unless ``REDIS_URL`` names another; with RabbitMQ it is always
``REDIS_URL`` (settings refuse an AMQP broker without it). Every process opens it through here so a deployment
that moves coordination off the broker changes one setting, not every caller.
"""

from __future__ import annotations

import redis

from bridge.core.settings import Settings


def coordination_redis(settings: Settings, *, timeout_s: float = 5.0, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A client of the coordination Redis (``Settings.coordination_url``); it connects on first use."""
    return redis.Redis.from_url(
        settings.coordination_url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s
    )
