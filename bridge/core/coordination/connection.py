"""The one place that opens the coordination Redis: leases, slot accounting, rate limits, the leader lock.

With a Redis broker it is the broker's own Redis unless ``REDIS_URL`` names another; with RabbitMQ it is always
``REDIS_URL`` (settings refuse an AMQP broker without it). Every process opens it through here so a deployment
that moves coordination off the broker changes one setting, not every caller.

Deployments may share that Redis: the keys that hold one deployment's state carry its scope
(``deployment_scope``, a digest of its Store's URL, or of its gateway's without a Store;
``bridge.core.coordination.keys``), derived here and nowhere else.

Its answers are ``str``, never ``bytes`` (``decode_responses``): every coordination key holds text (attempt ids,
node names, tokens, numbers, JSON), nothing binary. ``coordination_client`` is the one constructor, for the
processes here and for the tools and tests that read the same keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis

from bridge.core.coordination import keys
from bridge.core.infra import MissingSetting, redact_url, tls

if TYPE_CHECKING:
    from bridge.core.settings import SharedSettings


def coordination_redis(
    settings: SharedSettings, *, timeout_s: float = 5.0, connect_timeout_s: float = 5.0
) -> redis.Redis:
    """A client of the coordination Redis (``BrokerSettings.coordination_url``); it connects on first use.

    ``rediss://`` checks the server's certificate and host name unless BROKER_TLS_INSECURE (``bridge.core.infra.tls``).
    """
    url = settings.coordination_url
    tls.warn_if_insecure(settings)
    return coordination_client(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        **tls.redis_client_options(url, settings),
    )


def coordination_client(url: str, **options: Any) -> redis.Redis:
    """A client of the coordination Redis at ``url`` whose answers are ``str`` (``decode_responses``); ``options``
    go to ``redis.Redis.from_url``. Every function that reads coordination keys (``bridge.core.coordination.capacity``,
    ``workers.protocol.lease``, ...) expects such a client; Celery's broker and result-backend clients are not this."""
    return redis.Redis.from_url(url, decode_responses=True, **options)


def deployment_scope(settings: SharedSettings) -> str:
    """The scope of this deployment's Redis keys: ``REDIS_KEY_SCOPE``, else a digest of its Store's URL
    (``keys.store_scope``), else, in a 1.0-only deployment (no Store), of its gateway's URL
    (``keys.gateway_scope``); MissingSetting when none of the three is set.

    Every process of one deployment (workers, bridge, trainer, tools) must agree on it. With a digest they
    must name the Store (the gateway) by the same URL: another spelling of it (``localhost`` on the trainer's
    host, ``store`` inside compose) is another scope, whose bridge sees none of these workers' slots.
    ``REDIS_KEY_SCOPE`` set alike everywhere removes that trap (docs/agl-v1.md, "Without a Store")."""
    if settings.redis_key_scope:
        return settings.redis_key_scope
    if settings.store_url is not None:
        return keys.store_scope(settings.store_base)
    if settings.agl_v1_url:
        return keys.gateway_scope(settings.agl_v1_url)
    raise MissingSetting(
        "invalid configuration: AGENT_LIGHTNING_STORE_URL: is required but not set (it names this deployment's "
        "Redis keys; a 1.0-only deployment sets AGL_V1_SERVER_URL or REDIS_KEY_SCOPE instead)",
        setting="AGENT_LIGHTNING_STORE_URL",
    )


def deployment_endpoint(settings: SharedSettings) -> str | None:
    """The URL (redacted) that names this deployment: its Store's, else its gateway's; None when neither is set.

    Workers advertise it beside their slots (``keys.scope_endpoint``), so a process that derives another scope
    can say which spelling the workers use (``bridge.core.coordination.scope_check``)."""
    if settings.store_url is not None:
        return redact_url(settings.store_base)
    return redact_url(settings.agl_v1_url) if settings.agl_v1_url else None
