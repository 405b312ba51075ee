"""What waits in the Redis broker: queue depth and the age of the oldest queued message.

Kombu's Redis transport keeps a queue as a list: producers ``LPUSH``, consumers ``BRPOP``, so the
oldest message sits at index -1. Its task id is the attempt id, and the bridge recorded the publish
time of every attempt in the in-flight set (bridge.core.capacity), so the age needs no clock in the message.
Read by the bridge's metrics and by ``bridge status``; both only read, never pop.
"""

from __future__ import annotations

import json
import time

import redis

from bridge.core import keys


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


def oldest_message_age(client: redis.Redis, queue: str) -> float | None:
    """Seconds the oldest queued message has waited since the bridge published it (None: queue empty)."""
    task_id = oldest_message_id(client, queue)
    if task_id is None:
        return None
    published = client.zscore(keys.inflight(queue), task_id)
    return max(0.0, time.time() - float(published)) if published is not None else None
