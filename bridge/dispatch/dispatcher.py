"""The bridge's loop: claim only as many rollouts as workers can start, publish each, lose none.

Backpressure: the number to dequeue is the free slot count from ``bridge.core.capacity`` (advertised worker
slots minus attempts in flight). With no worker consuming there are no slots, so the bridge never
dequeues and rollouts stay ``queuing`` in the Store, where their clock has not started yet.

Nothing dequeued is stranded: a rollout is recorded in flight before it is published; if the broker
refuses it after retries it is handed back to the Store queue (``requeuing``). A crash between dequeue
and publish is repaired by ``reconcile``: on start and every minute, attempts this dispatcher claimed
that are still ``preparing``, not in flight and not leased by an executor are published again under the
same task id (the worker's lease makes a duplicate harmless) or handed back when they are too old to
start in time. Workers do not mark attempts ``running`` (their first span does), so the lease is what
tells a started attempt from a stranded one. The same scan frees the slots of workers that died with
their messages unacknowledged (the broker would redeliver them only after the visibility timeout, and
their slots would be counted busy until then). Because a Redis restart without persistence loses
leases until their holders renew them on the next heartbeat, nothing is repaired before it looked so
on two scans at least ``confirm_s`` apart.

Only one bridge dispatches at a time (a Redis lock renewed by the loop); others wait as hot standbys.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid

import redis

from bridge.core import capacity, keys, locks
from bridge.core.errors import PublishError, StoreError, UnknownIdError
from bridge.core.models import ACTIVE_ATTEMPT, AttemptedRollout, AttemptStatus, RolloutStatus
from bridge.core.settings import Settings
from bridge.core.store import StoreClient
from bridge.dispatch import broker, metrics
from bridge.dispatch.publisher import Publisher, describe

log = logging.getLogger("bridge.dispatch.dispatcher")

LEADER_TTL_S = 15
FULL_CAPACITY_WAIT_S = 0.2
RECONCILE_EVERY_S = 60.0
GAUGES_EVERY_S = 1.0


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        store: StoreClient,
        redis_client: redis.Redis,
        publisher: Publisher,
        stop: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.redis = redis_client
        self.publisher = publisher
        self.stop = stop or threading.Event()
        self.queues = settings.all_queues()
        self._token = f"{settings.dispatcher_id}:{uuid.uuid4().hex[:8]}"
        self._leader = False
        self._next_reconcile = 0.0
        self._store_failures = 0
        self._broker_failures = 0
        self._empty_polls = 0
        self._next_gauges = 0.0
        self._suspects: dict[str, float] = {}  # attempt id -> when reconcile first saw it stranded (monotonic)
        # Longer than it takes every live executor to renew its lease (one heartbeat) after Redis lost them.
        self.confirm_s = 2 * settings.heartbeat_interval_s + 5.0

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        log.info("bridge %s dispatching to queues %s", self.settings.dispatcher_id, ", ".join(self.queues))
        try:
            while not self.stop.is_set():
                self.stop.wait(self.tick())
        finally:
            self._resign()
        log.info("bridge stopped")

    def tick(self) -> float:
        """One round; returns how long to wait before the next."""
        try:
            if not self._ensure_leader():
                return 2.0
            free = capacity.free_slots(self.redis, self.queues)
            self._broker_failures = 0
        except redis.RedisError as exc:
            metrics.BROKER_ERRORS.inc()
            self._broker_failures += 1
            wait = min(10.0, 0.5 * 2 ** min(self._broker_failures, 5))
            log.warning("broker unreachable (%r); not dequeuing, retry in %.1fs", exc, wait)
            return wait
        if time.monotonic() >= self._next_reconcile:
            self.reconcile()
        if time.monotonic() >= self._next_gauges:  # observability only: once a second, not every tick
            self._next_gauges = time.monotonic() + GAUGES_EVERY_S
            self._update_gauges(free)
        slots = sum(free.values())
        if slots <= 0:
            return self._wait_for_slot()
        limit = min(slots, self.settings.max_batch)
        try:
            batch = self.store.dequeue(limit, self.settings.dispatcher_id)
            self._store_failures = 0
        except UnknownIdError as exc:  # never expected for dequeue; do not spin on it
            log.error("dequeue rejected: %s", exc)
            return self.settings.poll_max_s
        except StoreError as exc:
            metrics.STORE_ERRORS.labels("dequeue").inc()
            self._store_failures += 1
            wait = min(30.0, 1.0 * 2 ** min(self._store_failures, 5))
            log.warning("dequeue failed (%s); retry in %.1fs", exc, wait)
            # A dequeue whose answer was lost may have claimed rollouts: reconcile soon.
            self._next_reconcile = min(self._next_reconcile, time.monotonic() + wait)
            return wait
        metrics.DEQUEUED.inc(len(batch))
        for rollout in batch:
            self.dispatch(rollout)
        if len(batch) >= limit:
            return 0.0
        return self._next_poll(found_work=bool(batch))

    def _next_poll(self, *, found_work: bool) -> float:
        """poll_min_s after work was found; each empty poll doubles the wait (jittered) up to poll_max_s."""
        self._empty_polls = 0 if found_work else self._empty_polls + 1
        ceiling = min(self.settings.poll_max_s, self.settings.poll_min_s * 2**self._empty_polls)
        return random.uniform(max(self.settings.poll_min_s, ceiling / 2), ceiling)

    # --- one rollout -----------------------------------------------------------------------------

    def dispatch(self, rollout: AttemptedRollout) -> bool:
        """Publish, or hand back; returns True when the rollout is in the broker."""
        queue = self.settings.queue_for_mode(rollout.mode)
        aid = rollout.attempt.attempt_id
        try:
            capacity.mark_inflight(self.redis, queue, aid)
            self.publisher.publish(rollout, queue)
        except (PublishError, redis.RedisError) as exc:
            metrics.BROKER_ERRORS.inc()
            log.error("could not publish %s: %s; handing it back", describe(rollout), exc)
            self._forget_inflight(queue, aid)
            self.hand_back(rollout, "publish_failed")
            return False
        metrics.PUBLISHED.labels(queue).inc()
        if rollout.attempt.start_time:
            metrics.DISPATCH_LATENCY.observe(max(0.0, time.time() - rollout.attempt.start_time))
        log.info("[rollout=%s attempt=%s task=%s] published to %s", rollout.rollout_id, aid, aid, queue)
        return True

    def hand_back(self, rollout: AttemptedRollout, reason: str) -> None:
        """Put a claimed rollout back at the tail of the Store queue.

        See docs/store-protocol.md section 10, "Handing a rollout back".
        """
        try:
            self.store.update_rollout(rollout.rollout_id, status=RolloutStatus.REQUEUING)
            metrics.HANDED_BACK.labels(reason).inc()
            log.warning(
                "[rollout=%s attempt=%s] handed back to the Store (%s)",
                rollout.rollout_id,
                rollout.attempt.attempt_id,
                reason,
            )
        except StoreError as exc:
            metrics.STORE_ERRORS.labels("hand_back").inc()
            # Still preparing under our dispatcher id: the next reconcile picks it up again.
            log.error("[rollout=%s] could not hand back (%s); reconciliation will retry", rollout.rollout_id, exc)
            self._next_reconcile = min(self._next_reconcile, time.monotonic() + 5.0)

    # --- repair ----------------------------------------------------------------------------------

    def reconcile(self) -> int:
        """Repair what crashes left behind; returns how many attempts were re-published or handed back.

        * stranded: an active attempt this dispatcher claimed that no message carries and nobody holds
          (a bridge crash between dequeue and publish, broker data loss, a freed orphan below): published
          again under the same task id, or handed back when too old to start in time. A ``running`` one
          (its dead executor shipped spans) is published too: the takeover reports it ``failed`` (infra)
          and the Store's retry policy decides, sooner than its watchdog or the broker's visibility timeout.
        * orphaned: an in-flight entry whose executor started it and is gone (no lease): a worker killed
          with its messages unacknowledged, which the broker redelivers only after the visibility timeout.
          Its slot is freed at once, and the attempt then counts as stranded.
        Both only after two scans ``confirm_s`` apart (see the module docstring).
        """
        self._next_reconcile = time.monotonic() + RECONCILE_EVERY_S
        try:
            rollouts, _ = self.store.list_rollouts(status_in=[RolloutStatus.PREPARING, RolloutStatus.RUNNING])
            inflight: dict[str, str] = {}
            for queue in self.queues:
                capacity.prune_stale(self.redis, queue, self.settings.visibility_timeout_s)
                inflight.update(dict.fromkeys(capacity.inflight_ids(self.redis, queue), queue))
            active = {
                r.attempt.attempt_id: r
                for r in rollouts
                if isinstance(r, AttemptedRollout) and r.attempt.status in ACTIVE_ATTEMPT
            }
            facts = capacity.executions(self.redis, set(inflight) | set(active))
        except (StoreError, redis.RedisError) as exc:
            log.warning("reconciliation skipped: %s", exc)
            self._next_reconcile = time.monotonic() + 10.0
            return 0
        orphans = {
            aid for aid, fact in facts.items() if aid in inflight and not fact.leased and (fact.started or fact.done)
        }
        stranded = {
            aid for aid, rollout in active.items() if aid not in inflight and self._abandoned(rollout, facts[aid])
        }
        confirmed = self._confirm(orphans | stranded)
        for aid in sorted(confirmed & orphans):
            self._forget_inflight(inflight[aid], aid)
            metrics.ORPHANS_FREED.inc()
            log.warning("[attempt=%s] its executor is gone (no lease): slot freed", aid)
            if aid in active and not facts[aid].done:
                stranded.add(aid)
        repaired = 0
        for aid in sorted(confirmed & stranded):
            rollout = active[aid]
            repaired += 1
            age = time.time() - (rollout.attempt.start_time or time.time())
            if age > self.settings.max_queue_wait_s and rollout.attempt.status == AttemptStatus.PREPARING:
                self.hand_back(rollout, "stranded")
            elif self.dispatch(rollout):
                metrics.REPUBLISHED.inc()
                log.warning(
                    "[rollout=%s attempt=%s] was stranded (%s); re-published",
                    rollout.rollout_id,
                    aid,
                    "its executor died" if facts[aid].started else "bridge crash or broker loss",
                )
        return repaired

    def _abandoned(self, rollout: AttemptedRollout, fact: capacity.Execution) -> bool:
        """Ours, and nobody runs it: neither leased nor finished, and claimed by us or started by our workers."""
        if fact.leased or fact.done:
            return False
        if rollout.attempt.status == AttemptStatus.PREPARING:
            return fact.started or rollout.attempt.worker_id == self.settings.dispatcher_id
        return fact.started  # running: only attempts our workers executed

    def _confirm(self, seen: set[str]) -> set[str]:
        """The ids seen now that were already seen at least ``confirm_s`` ago; schedules the re-check."""
        now = time.monotonic()
        self._suspects = {aid: self._suspects.get(aid, now) for aid in seen}
        confirmed = {aid for aid, first in self._suspects.items() if now - first >= self.confirm_s}
        for aid in confirmed:
            del self._suspects[aid]
        if self._suspects:
            log.info("%d attempts look stranded or orphaned; re-checking in %.0fs", len(self._suspects), self.confirm_s)
            self._next_reconcile = min(self._next_reconcile, min(self._suspects.values()) + self.confirm_s + 0.5)
        return confirmed

    # --- leadership ------------------------------------------------------------------------------

    def _ensure_leader(self) -> bool:
        key, ttl_ms = keys.bridge_leader(), LEADER_TTL_S * 1000
        if self._leader and locks.renew(self.redis, key, self._token, ttl_ms):
            return True
        was_leader = self._leader
        self._leader = bool(self.redis.set(key, self._token, nx=True, px=ttl_ms))
        metrics.IS_LEADER.set(1 if self._leader else 0)
        if self._leader and not was_leader:
            log.info("this bridge now dispatches (lock %s)", key)
            self._next_reconcile = 0.0
        elif not self._leader and not was_leader and random.random() < 0.05:
            log.info("another bridge dispatches (%s); standing by", self.redis.get(key))
        return self._leader

    def _resign(self) -> None:
        if self._leader:
            try:
                locks.release(self.redis, keys.bridge_leader(), self._token)
            except redis.RedisError:
                pass
            self._leader = False

    # --- helpers ---------------------------------------------------------------------------------

    def _wait_for_slot(self) -> float:
        """All slots busy: block on the workers' slot-freed wake-up (at most FULL_CAPACITY_WAIT_S)."""
        try:
            capacity.wait_for_freed(self.redis, self.queues, FULL_CAPACITY_WAIT_S)
        except redis.RedisError:
            return FULL_CAPACITY_WAIT_S  # the next tick's slot count reports the outage
        return 0.0

    def _forget_inflight(self, queue: str, attempt_id: str) -> None:
        try:
            capacity.clear_inflight(self.redis, queue, attempt_id)
        except redis.RedisError:
            pass

    def _update_gauges(self, free: dict[str, int]) -> None:
        try:
            for queue in self.queues:
                metrics.FREE_SLOTS.labels(queue).set(free.get(queue, 0))
                metrics.IN_FLIGHT.labels(queue).set(capacity.inflight_count(self.redis, queue))
                metrics.QUEUE_DEPTH.labels(queue).set(broker.queue_depth(self.redis, queue))
                metrics.OLDEST_QUEUED_AGE.labels(queue).set(broker.oldest_message_age(self.redis, queue) or 0.0)
                metrics.OLDEST_IN_FLIGHT_AGE.labels(queue).set(capacity.oldest_inflight_age(self.redis, queue) or 0.0)
        except redis.RedisError:
            pass
