"""The dispatch lock: only one bridge of a deployment dispatches at a time, the others stand by as hot standbys.

A Redis key holding a token unique to this process, renewed by the dispatch loop on every tick and
expiring ``LEADER_TTL_S`` after the last renewal, so a killed leader is replaced within that long and two
bridges never publish the same rollouts. The key is scoped by the deployment's Store
(``bridge.core.coordination.deployment_scope``): the bridges of two Stores sharing one Redis each lead.
"""

from __future__ import annotations

import logging
import random
import uuid

import redis

from bridge.core import keys, locks
from bridge.dispatch import metrics

log = logging.getLogger("bridge.dispatch.dispatcher")

LEADER_TTL_S = 15


class LeaderLock:
    def __init__(self, client: redis.Redis, dispatcher_id: str, *, scope: str) -> None:
        self.redis = client
        self.key = keys.bridge_leader(scope)
        self.token = f"{dispatcher_id}:{uuid.uuid4().hex[:8]}"
        self.held = False

    def ensure(self) -> tuple[bool, bool]:
        """Renew or take the lock; returns (this bridge dispatches, it has just started to). Raises RedisError."""
        key, ttl_ms = self.key, LEADER_TTL_S * 1000
        if self.held and locks.renew(self.redis, key, self.token, ttl_ms):
            return True, False
        was_held = self.held
        self.held = bool(self.redis.set(key, self.token, nx=True, px=ttl_ms))
        metrics.IS_LEADER.set(1 if self.held else 0)
        if self.held and not was_held:
            log.info("this bridge now dispatches (lock %s)", key)
        elif not self.held and not was_held and random.random() < 0.05:
            log.info("another bridge dispatches (%s); standing by", self.redis.get(key))
        return self.held, self.held and not was_held

    def release(self) -> None:
        if self.held:
            try:
                locks.release(self.redis, self.key, self.token)
            except redis.RedisError:
                pass
            self.held = False


def dispatching(client: redis.Redis, scope: str) -> bool:
    """Whether some dispatch loop of the deployment ``scope`` (``python -m bridge`` or ``CeleryRunner.iter``)
    holds the lock now, so a rollout the Store puts back in its queue will be dequeued again. Raises RedisError."""
    return bool(client.exists(keys.bridge_leader(scope)))
