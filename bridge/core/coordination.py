"""The one place that opens the coordination Redis: leases, slot accounting, rate limits, the leader lock.

With a Redis broker it is the broker's own Redis unless ``REDIS_URL`` names another; with RabbitMQ it is always
``REDIS_URL`` (settings refuse an AMQP broker without it). Every process opens it through here so a deployment
that moves coordination off the broker changes one setting, not every caller.

Deployments may share that Redis: the keys that hold one deployment's state carry its scope
(``deployment_scope``, a digest of its Store's URL; ``bridge.core.keys``), derived here and nowhere else.
"""

from __future__ import annotations

import redis

from bridge.core import keys, tls
from bridge.core.settings import Settings


def coordination_redis(settings: Settings, *, timeout_s: float = 5.0, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A client of the coordination Redis (``Settings.coordination_url``); it connects on first use.

    ``rediss://`` checks the server's certificate and host name unless BROKER_TLS_INSECURE (``bridge.core.tls``).
    """
    url = settings.coordination_url
    tls.warn_if_insecure(settings)
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        **tls.redis_client_options(url, settings),
    )


def deployment_scope(settings: Settings) -> str:
    """The scope of this deployment's Redis keys: a digest of its Store's URL (``keys.store_scope``).

    Every process of one deployment (workers, bridge, trainer, tools) must name the Store by the same URL, as
    ``AGENT_LIGHTNING_STORE_URL`` (or the Store given to ``CeleryRunner``): another spelling of it is another
    scope, whose bridge would see none of these workers' slots."""
    return keys.store_scope(settings.store_base)
