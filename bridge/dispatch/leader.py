"""The dispatch lock: only one bridge of a deployment dispatches at a time, the others stand by as hot standbys.

A Redis lock (redis-py's ``Lock``) holding a token unique to this process, expiring ``LEADER_TTL_S`` after its
last renewal. It is renewed on every tick and, on a thread of its own, every ``RENEW_EVERY_S``, so a dispatch loop
blocked on a slow Store keeps it, while a killed leader is replaced within ``LEADER_TTL_S`` plus a standby's
``STANDBY_RETRY_S``. Fencing: ``valid()`` is true only until ``LEADER_TTL_S - FENCE_MARGIN_S`` after the start of
the last renewal Redis confirmed, which is before the key can expire in Redis, so a leader cut off from Redis
stops publishing before a standby can take over. The key is scoped by the deployment's Store
(``bridge.core.coordination.connection.deployment_scope``): the bridges of two Stores sharing one Redis each lead.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from bridge.core.coordination import keys
from bridge.core.coordination.slot_share import V03
from bridge.dispatch import metrics

log = logging.getLogger(__name__)

LEADER_TTL_S = 3.0  # a SIGKILLed leader's lock lapses this long after its last renewal
RENEW_EVERY_S = 1.0  # the renewal thread's period: two renewals may fail in a row before the lock lapses
FENCE_MARGIN_S = 0.5  # ``valid()`` ends this long before the lock can expire in Redis
STANDBY_RETRY_S = 0.5  # how often a standby's loop tries to take the lock


class LeaderLock:
    """redis-py's ``Lock`` (a token checked by its Lua scripts on extend and release), taken without blocking
    and renewed to ``LEADER_TTL_S`` on every ``ensure`` and by a renewal thread while held; the token names the
    bridge, so standbys can log who leads."""

    def __init__(self, client: redis.Redis, dispatcher_id: str, *, scope: str, line: str = V03) -> None:
        """``line``: the dispatch line whose ``agl_bridge_is_leader`` this lock sets."""
        self.redis = client
        self._is_leader = metrics.IS_LEADER.labels(line)
        self.key = keys.bridge_leader(scope)
        self.token = f"{dispatcher_id}:{uuid.uuid4().hex[:8]}"
        # thread_local=False: CeleryRunner may take it on one thread and release it on another, and the renewal
        # thread extends what the dispatch loop took.
        self._lock = Lock(client, self.key, timeout=LEADER_TTL_S, thread_local=False)
        self.held = False
        self._valid_until = 0.0  # monotonic: the fence (``valid``)
        self._state = threading.Lock()  # guards held, _valid_until and the renewal thread's start
        self._term = 0  # bumped on every change of ``held``: a renewal thread of an older term exits
        self._renewer: threading.Thread | None = None
        self._released = threading.Event()  # wakes the renewal thread at once when the lock is given up

    def valid(self) -> bool:
        """Whether this bridge may publish now: it holds the lock and its last confirmed renewal is recent enough
        that the key cannot have expired in Redis yet (the module docstring). No Redis call."""
        return self.held and time.monotonic() < self._valid_until

    def ensure(self) -> tuple[bool, bool]:
        """Renew or take the lock; returns (this bridge dispatches, it has just started to). Raises RedisError."""
        if self.held and self._renew():
            return True, False
        was_held = self.held
        started = time.monotonic()
        taken = self._lock.acquire(blocking=False, token=self.token)
        with self._state:
            self.held = taken
            if taken:
                self._valid_until = started + LEADER_TTL_S - FENCE_MARGIN_S
            if taken != was_held:
                self._term += 1
            if taken and (self._renewer is None or not self._renewer.is_alive() or not was_held):
                self._released.clear()
                self._renewer = threading.Thread(
                    target=self._renew_while_held, args=(self._term,), name="leader-renewal", daemon=True
                )
                self._renewer.start()
        self._is_leader.set(1 if self.held else 0)
        if self.held and not was_held:
            log.info("this bridge now dispatches (lock %s)", self.key)
        elif was_held and not self.held:
            log.warning("this bridge lost the dispatch lock to %s; standing by", self.redis.get(self.key))
        elif not self.held and random.random() < 0.05:
            log.info("another bridge dispatches (%s); standing by", self.redis.get(self.key))
        return self.held, self.held and not was_held

    def _renew(self) -> bool:
        """Extend the lock to ``LEADER_TTL_S`` and move the fence; False when it is gone or another bridge's
        (``held`` is then cleared). Raises RedisError, leaving the fence where it was."""
        started = time.monotonic()
        try:
            self._lock.reacquire()
        except LockError:  # expired, or another bridge took it meanwhile
            with self._state:
                if self.held:
                    self.held = False
                    self._term += 1
            self._is_leader.set(0)
            return False
        with self._state:
            if self.held:
                self._valid_until = max(self._valid_until, started + LEADER_TTL_S - FENCE_MARGIN_S)
        return True

    def _renew_while_held(self, term: int) -> None:
        """The renewal thread of one leader term: renews every ``RENEW_EVERY_S`` until the term ends."""
        while True:
            self._released.wait(RENEW_EVERY_S)
            if self._term != term or not self.held:
                return
            try:
                if not self._renew():
                    log.warning("this bridge lost the dispatch lock; it stops publishing and stands by")
                    return
            except redis.RedisError as exc:  # the fence runs out on its own if Redis stays away
                if self._expired_unrenewed(term):
                    log.warning("the dispatch lock expired while Redis was unreachable (%r); standing by", exc)
                    return
                log.warning("renewing the dispatch lock failed (%r); retrying in %.1fs", exc, RENEW_EVERY_S)
            except Exception:  # the thread outlives any surprise while the term lasts
                log.exception("unexpected error renewing the dispatch lock")

    def _expired_unrenewed(self, term: int) -> bool:
        """End the term ``term`` if the key has expired in Redis by now (the fence ran out ``FENCE_MARGIN_S`` ago): the
        lock is nobody's, so the next ``ensure`` takes it again like any bridge, and the renewal thread of a process
        that lost Redis for good ends instead of retrying forever. True when the term is over."""
        with self._state:
            if self._term != term or not self.held:
                return True
            if time.monotonic() < self._valid_until + FENCE_MARGIN_S:
                return False
            self.held = False
            self._term += 1
        self._is_leader.set(0)
        return True

    def release(self) -> None:
        with self._state:
            was_held, self.held, self._valid_until = self.held, False, 0.0
            self._term += 1  # the renewal thread exits when it wakes, which this does now
            renewer, self._renewer = self._renewer, None
        self._released.set()
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join(timeout=RENEW_EVERY_S + 1.0)  # a released lock leaves no thread behind
        if was_held:
            try:
                self._lock.release()
            except (LockError, redis.RedisError):  # no longer ours, or Redis is away: it expires on its own
                pass
            self._is_leader.set(0)


def dispatching(client: redis.Redis, scope: str) -> bool:
    """Whether some dispatch loop of the deployment ``scope`` (``python -m bridge`` or ``CeleryRunner.iter``)
    holds the lock now, so a rollout the Store puts back in its queue will be dequeued again. Raises RedisError."""
    return bool(client.exists(keys.bridge_leader(scope)))
