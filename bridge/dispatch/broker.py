"""What waits in the broker: queue depth and the age of the oldest queued message, behind one seam.

``queues_for(settings, coordination)`` returns the probe for the configured broker; the bridge's gauges and
``bridge status`` use only its ``depth``/``oldest_age`` and never take a message. Redis: the queue is a list
(``LPUSH``/``BRPOP``, oldest at index -1) whose task id is the attempt id, aged by the publish time the bridge
recorded in the in-flight set (``bridge.core.coordination.capacity``). RabbitMQ: a passive ``queue.declare`` gives the
ready messages without creating anything; AMQP cannot peek at a queue's head, so the age is unknown (None), and a
queue not declared yet holds nothing.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import redis
from kombu import Connection

from bridge.core.coordination import deployment_scope, keys
from bridge.core.infra import redact_url, tls
from bridge.core.settings import DispatcherSettings

PROBE_TIMEOUT_S = 3.0


class BrokerReadError(Exception):
    """The broker did not answer a read (its URL is redacted in the message)."""


class QueueProbe(Protocol):
    """Read-only view of the broker's queues."""

    def depth(self, queue: str) -> int:
        """Messages waiting in ``queue`` (published, not yet delivered to a worker)."""
        ...

    def oldest_age(self, queue: str) -> float | None:
        """Seconds the oldest waiting message has waited; None when empty or unknown."""
        ...

    def close(self) -> None: ...


class RedisQueues:
    """Kombu's Redis lists; the publish time comes from the in-flight set (of deployment ``scope``) in the
    coordination Redis."""

    def __init__(self, broker: redis.Redis, coordination: redis.Redis, scope: str) -> None:
        self.broker, self.coordination, self._own = broker, coordination, broker is not coordination
        self.scope = scope

    def depth(self, queue: str) -> int:
        return queue_depth(self.broker, queue)

    def oldest_age(self, queue: str) -> float | None:
        return oldest_message_age(self.broker, self.scope, queue, self.coordination)

    def close(self) -> None:
        if self._own:
            self.broker.close()


class AmqpQueues:
    """RabbitMQ queues through one kombu connection, opened on first use and re-opened after an error.

    ``use_ssl``: kombu's ``ssl`` option for that connection (``bridge.core.infra.tls.broker_use_ssl``: the workers' and
    publisher's own TLS checks); None connects as the URL says."""

    def __init__(self, url: str, use_ssl: dict[str, Any] | None = None) -> None:
        self.url = url
        self.use_ssl = use_ssl  # bridge.core.infra.tls.broker_use_ssl: the workers' and publisher's own TLS checks
        self._connection: Any = None
        self._channel: Any = None

    def depth(self, queue: str) -> int:
        from amqp.exceptions import NotFound

        try:
            channel = self._open()
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
        except NotFound:  # never declared: nothing waits in it (the server closed this channel)
            self._channel = None
            return 0
        except Exception as exc:  # socket, protocol or auth errors: the next read reconnects
            self.close()
            raise BrokerReadError(f"RabbitMQ at {redact_url(self.url)}: {type(exc).__name__}: {exc}") from None

    def oldest_age(self, queue: str) -> float | None:
        return None

    def _open(self) -> Any:
        if self._connection is None:
            options = {"ssl": self.use_ssl} if self.use_ssl is not None else {}
            self._connection = Connection(self.url, connect_timeout=PROBE_TIMEOUT_S, **options)
            self._connection.ensure_connection(max_retries=1)
        if self._channel is None:
            self._channel = self._connection.channel()
        return self._channel

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception:  # closing a broken connection: nothing left to do
                pass


def queues_for(settings: DispatcherSettings, coordination: redis.Redis) -> QueueProbe:
    """The probe for ``CELERY_BROKER_URL``; a Redis broker on the coordination URL shares its client."""
    if settings.broker_is_amqp:
        return AmqpQueues(settings.broker_url, tls.broker_use_ssl(settings))
    scope = deployment_scope(settings)
    if settings.broker_url == settings.coordination_url:
        return RedisQueues(coordination, coordination, scope)
    broker = redis.Redis.from_url(
        settings.broker_url, socket_timeout=PROBE_TIMEOUT_S, **tls.redis_client_options(settings.broker_url, settings)
    )
    return RedisQueues(broker, coordination, scope)


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Messages published to ``queue`` and not yet taken by a worker."""
    return int(client.llen(queue))


def oldest_message_id(client: redis.Redis, queue: str) -> str | None:
    """Task id of the message that has waited longest in ``queue``, if any."""
    raw = client.lindex(queue, -1)
    if raw is None:
        return None
    try:
        message = json.loads(raw)
    except (ValueError, TypeError):
        return None
    headers = message.get("headers") if isinstance(message, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) else None


def oldest_message_age(
    client: redis.Redis, scope: str, queue: str, coordination: redis.Redis | None = None
) -> float | None:
    """Seconds the oldest queued message has waited since the bridge of deployment ``scope`` published it
    (None: queue empty, or not published by it)."""
    task_id = oldest_message_id(client, queue)
    if task_id is None:
        return None
    published = (coordination or client).zscore(keys.inflight(scope, queue), task_id)
    return max(0.0, time.time() - float(published)) if published is not None else None
