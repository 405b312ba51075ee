"""The dispatch lock: only one bridge of a deployment dispatches at a time, the others stand by as hot standbys.

A Redis lock (redis-py's ``Lock``) holding a token unique to this process, renewed by the dispatch loop on
every tick and expiring ``LEADER_TTL_S`` after the last renewal, so a killed leader is replaced within that long and two
bridges never publish the same rollouts. The key is scoped by the deployment's Store
(``bridge.core.coordination.deployment_scope``): the bridges of two Stores sharing one Redis each lead.
"""

from __future__ import annotations

import logging
import random
import uuid

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from bridge.core import keys
from bridge.dispatch import metrics

log = logging.getLogger("bridge.dispatch.dispatcher")

LEADER_TTL_S = 15


class LeaderLock:
    """redis-py's ``Lock`` (a token checked by its Lua scripts on extend and release), taken without blocking
    and renewed on every tick to ``LEADER_TTL_S``; the token names the bridge, so standbys can log who leads."""

    def __init__(self, client: redis.Redis, dispatcher_id: str, *, scope: str) -> None:
        self.redis = client
        self.key = keys.bridge_leader(scope)
        self.token = f"{dispatcher_id}:{uuid.uuid4().hex[:8]}"
        # thread_local=False: CeleryRunner may take it on one thread and release it on another.
        self._lock = Lock(client, self.key, timeout=LEADER_TTL_S, thread_local=False)
        self.held = False

    def ensure(self) -> tuple[bool, bool]:
        """Renew or take the lock; returns (this bridge dispatches, it has just started to). Raises RedisError."""
        if self.held:
            try:
                self._lock.reacquire()
                return True, False
            except LockError:  # expired, or another bridge took it meanwhile: try to take it afresh
                pass
        was_held = self.held
        self.held = self._lock.acquire(blocking=False, token=self.token)
        metrics.IS_LEADER.set(1 if self.held else 0)
        if self.held and not was_held:
            log.info("this bridge now dispatches (lock %s)", self.key)
        elif was_held and not self.held:
            log.warning("this bridge lost the dispatch lock to %s; standing by", self.redis.get(self.key))
        elif not self.held and random.random() < 0.05:
            log.info("another bridge dispatches (%s); standing by", self.redis.get(self.key))
        return self.held, self.held and not was_held

    def release(self) -> None:
        if self.held:
            try:
                self._lock.release()
            except (LockError, redis.RedisError):  # no longer ours, or Redis is away: it expires on its own
                pass
            self.held = False
            metrics.IS_LEADER.set(0)


def dispatching(client: redis.Redis, scope: str) -> bool:
    """Whether some dispatch loop of the deployment ``scope`` (``python -m bridge`` or ``CeleryRunner.iter``)
    holds the lock now, so a rollout the Store puts back in its queue will be dequeued again. Raises RedisError."""
    return bool(client.exists(keys.bridge_leader(scope)))
