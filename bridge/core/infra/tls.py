"""Certificate checks for TLS broker and Redis URLs (``rediss://``, ``amqps://``): on unless BROKER_TLS_INSECURE.

Left alone, kombu connects to a ``rediss://`` broker without checking its certificate (it only logs that) and
py-amqp checks an ``amqps://`` broker's chain but not its host name. The Celery app (``bridge.core.task.message``)
and the coordination Redis (``bridge.core.coordination.connection``) take their options from here instead.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, Any

from bridge.core.infra import process_state
from bridge.core.infra.redact import redact_url

if TYPE_CHECKING:
    from bridge.core.settings import SharedSettings

log = logging.getLogger("bridge.tls")


def uses_tls(url: str | None) -> bool:
    return bool(url) and str(url).startswith(("rediss://", "amqps://"))


def redis_ssl_options(settings: SharedSettings) -> dict[str, Any]:
    """redis-py's (and kombu's Redis transport's) TLS options: verify the chain and the host name."""
    if settings.broker_tls_insecure:
        return {"ssl_cert_reqs": ssl.CERT_NONE, "ssl_check_hostname": False}
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}


def redis_client_options(url: str, settings: SharedSettings) -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url(url, ...)``: TLS options for ``rediss://``, else none."""
    return redis_ssl_options(settings) if url.startswith("rediss://") else {}


def broker_use_ssl(settings: SharedSettings) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` for CELERY_BROKER_URL; None for a broker without TLS.

    For ``amqps://`` a ``server_hostname`` of None makes kombu fill in the broker's host name, which turns
    py-amqp's host name check on.
    """
    url = settings.broker_url
    if url.startswith("rediss://"):
        return redis_ssl_options(settings)
    if url.startswith("amqps://"):
        if settings.broker_tls_insecure:
            return {"cert_reqs": ssl.CERT_NONE}
        return {"cert_reqs": ssl.CERT_REQUIRED, "server_hostname": None}
    return None


def warn_if_insecure(settings: SharedSettings) -> None:
    """Log once per process and URL that a TLS URL is used without certificate checks (BROKER_TLS_INSECURE)."""
    if not settings.broker_tls_insecure:
        return
    for name, url in (("CELERY_BROKER_URL", settings.broker_url), ("REDIS_URL", settings.coordination_url)):
        if not uses_tls(url):
            continue
        state = process_state.core
        with state.tls_lock:
            if url in state.tls_warned:
                continue
            state.tls_warned.add(url)
        log.warning(
            "BROKER_TLS_INSECURE=true: %s %s is used WITHOUT TLS certificate or host name checks; "
            "anyone on the network path can impersonate it",
            name,
            redact_url(url),
        )
