"""Resources updates shared through Redis by every worker process of one Store (``StoreClient.shared_resources``).

A rollout's resources (the LLM endpoint, sampling parameters, an agent's prompt) are read by id and cached for
``resources_ttl_s`` after the fetch. Under ``-P prefork`` each process kept its own cache, so 32 processes made
0.40 ``GET /resources/{id}`` per rollout between them (docs/performance.md). Here the first process to fetch an
update leaves it in Redis until its TTL ends, counted from that fetch, so a process that finds it serves it for
the same window: an update is at most as stale as one process's own cache would have let it be. Redis
trouble only costs the Store a read: every failure here reads as a miss.
"""

from __future__ import annotations

import json
import logging
import math

import redis
from pydantic import ValidationError

from bridge.core.coordination import keys
from bridge.core.store import ResourcesUpdate

log = logging.getLogger("workers.lifecycle.shared_resources")


class RedisResources:
    def __init__(self, redis_client: redis.Redis, scope: str) -> None:
        """``scope``: the deployment's Redis key scope (``bridge.core.coordination.deployment_scope``), which every
        key it reads and writes names."""
        self._redis = redis_client
        self.scope = scope  # the deployment's (bridge.core.coordination.connection.deployment_scope)

    def get(self, resources_id: str) -> tuple[float, ResourcesUpdate] | None:
        try:
            raw = self._redis.get(keys.shared_resources(self.scope, resources_id))
        except redis.RedisError as exc:
            log.debug("shared resources unreadable: %r", exc)
            return None
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
            return float(entry["fetched_at"]), ResourcesUpdate.model_validate(entry["update"])
        except (ValueError, KeyError, TypeError, ValidationError):
            return None  # written by another version, or damaged: read the Store instead

    def put(self, fetched_at: float, update: ResourcesUpdate, ttl_s: float) -> None:
        entry = {"fetched_at": fetched_at, "update": update.model_dump(mode="json")}
        try:
            self._redis.set(
                keys.shared_resources(self.scope, update.resources_id),
                json.dumps(entry, separators=(",", ":")),
                ex=max(1, math.ceil(ttl_s)),
            )
        except redis.RedisError as exc:
            log.debug("could not share resources %s: %r", update.resources_id, exc)
