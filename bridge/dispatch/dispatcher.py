"""The bridge's loop: claim only as many rollouts as workers can start, publish each, lose none.

Backpressure, per queue: each queue's room comes from ``bridge.core.capacity`` (advertised worker slots,
a node's counted once however many queues it consumes, minus attempts in flight; negative when a queue
holds more than its nodes can run). A dequeue cannot choose the mode, and the mode picks the queue, so
``bridge.dispatch.placement`` sizes each dequeue for any mix: a batch while every consumed queue has
room, one rollout at a time while some are full (a rollout that cannot be placed is *held* here,
never published into a full queue: ``bridge.dispatch.hold``), none while all are. So no queue is
claimed beyond its slots by more than the held rollouts (``BRIDGE_MAX_HELD`` in all); with the single
default queue the batch is ``min(free slots, BRIDGE_MAX_BATCH)``, one request per batch as before.
With no worker consuming there are no slots, so the bridge never dequeues and rollouts stay
``queuing`` in the Store, where their clock has not started yet.

Nothing dequeued is stranded: a rollout is recorded in flight before it is published; if the broker
refuses it after retries it is handed back to the Store queue (``requeuing``). A crash between dequeue
and publish is repaired by ``reconcile``: on start and every ``BRIDGE_RECONCILE_INTERVAL_S`` (a minute),
attempts this dispatcher claimed that are still ``preparing``, not in flight and not leased by an executor
are published again under the same task id (the worker's lease makes a duplicate harmless) or handed back
when they are too old to start in time. Workers do not mark attempts ``running`` (their first span does),
so the lease is what tells a started attempt from a stranded one. The same scan frees the slots of workers that died
with their messages unacknowledged (the broker would redeliver them only after the visibility timeout, and
their slots would be counted busy until then). Because a Redis restart without persistence loses
leases until their holders renew them on the next heartbeat, nothing is repaired before it looked so
on two scans at least ``confirm_s`` apart. An in-flight entry older than ``BRIDGE_MAX_QUEUE_WAIT_S`` whose
attempt was never started and is not leased is stranded as well (a bridge killed between recording the
slot and the broker taking the message, which kombu's publish retries make seconds long, or a failed
publish whose clean-up failed too): any message it had has expired, so its slot is freed and its
attempt, if still ours and ``preparing``, handed back.

Only one bridge of a deployment dispatches at a time (``bridge.dispatch.leader``); others wait as hot
standbys. Every Redis key the loop uses is scoped by its Store (``self.scope``), so deployments sharing a
Redis neither count each other's slots nor contend for one lock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Protocol

import redis

from bridge.core import capacity, handback
from bridge.core.coordination import deployment_scope
from bridge.core.errors import PublishError, StoreError, UnknownIdError
from bridge.core.models import ACTIVE_ATTEMPT, AttemptedRollout, AttemptStatus, RolloutStatus
from bridge.core.redact import redact_url
from bridge.core.settings import Settings
from bridge.core.store import StoreClient
from bridge.dispatch import broker, metrics, placement
from bridge.dispatch.coalesce import Coalescer
from bridge.dispatch.hold import Hold
from bridge.dispatch.leader import LeaderLock
from bridge.dispatch.publisher import Publisher, describe

log = logging.getLogger("bridge.dispatch.dispatcher")

FULL_CAPACITY_WAIT_S = 0.2
UNEXPECTED_ERROR_WAIT_S = 1.0
GAUGES_EVERY_S = 1.0
SCOPE_CHECK_EVERY_S = 60.0


class StopSignal(Protocol):
    """What the loop needs of its stop signal: a ``threading.Event``, or the ``ExecutionEvent`` (thread or
    multiprocessing event) an Agent Lightning Trainer hands to ``bridge.runner.CeleryRunner.iter``."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        store: StoreClient,
        redis_client: redis.Redis,
        publisher: Publisher,
        stop: StopSignal | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.redis = redis_client
        self.publisher = publisher
        self.stop: StopSignal = stop if stop is not None else threading.Event()
        self.queues = settings.all_queues()
        self.scope = deployment_scope(settings)  # of every Redis key this deployment owns (bridge.core.keys)
        self._lock = LeaderLock(redis_client, settings.dispatcher_id, scope=self.scope)
        self._next_reconcile = 0.0
        self._store_failures = 0
        self._broker_failures = 0
        self._empty_polls = 0
        self._next_gauges = 0.0
        self._probe: broker.QueueProbe | None = None  # opened by the first gauge update
        self._hold = Hold(settings.max_held)  # claimed rollouts whose queue has no room now
        self._unserved_reported: set[str] = set()  # queues already logged as consumed by no worker
        self._suspects: dict[str, float] = {}  # attempt id -> when reconcile first saw it stranded (monotonic)
        self._coalescer = Coalescer(settings.coalesce_max_s)
        # Longer than it takes every live executor to renew its lease (one heartbeat) after Redis lost them.
        self.confirm_s = 2 * settings.heartbeat_interval_s + 5.0
        self._next_scope_check = 0.0  # monotonic: when to look again for workers of another Store URL

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        log.info(
            "bridge %s dispatching to queues %s for Store %s (Redis key scope %s)",
            self.settings.dispatcher_id,
            ", ".join(self.queues),
            redact_url(self.settings.store_base),
            self.scope,
        )
        try:
            while not self.stop.is_set():
                self.stop.wait(self._tick_surviving())
        finally:
            for held in self._hold.take_all():  # claimed, never published: give them back rather than strand them
                self.hand_back(held.rollout, "shutdown")
            self._lock.release()
            if self._probe is not None:
                self._probe.close()
            self.publisher.close()
        log.info("bridge stopped")

    def _tick_surviving(self) -> float:
        """``tick``, but an unexpected error is logged and counted and the loop goes on after a pause.

        A claimed batch is never dropped by it: ``_place`` publishes or hands back each rollout on its own,
        and whatever an error left half done (an in-flight entry, an unpublished claim) is repaired by the
        reconcile scheduled here.
        """
        try:
            return self.tick()
        except Exception:
            metrics.LOOP_ERRORS.inc()
            log.exception("unexpected error in the dispatch loop; going on in %.0fs", UNEXPECTED_ERROR_WAIT_S)
            self._next_reconcile = min(self._next_reconcile, time.monotonic() + UNEXPECTED_ERROR_WAIT_S)
            return UNEXPECTED_ERROR_WAIT_S

    def tick(self) -> float:
        """One round; returns how long to wait before the next."""
        try:
            if not self._ensure_leader():
                return 2.0
            if time.monotonic() >= self._next_reconcile:
                self.reconcile()  # before the slots are read: what it re-publishes takes slots this tick sees
            view = capacity.read_slots(self.redis, self.scope, self.queues)
            self._broker_failures = 0
        except redis.RedisError as exc:
            metrics.BROKER_ERRORS.inc()
            self._broker_failures += 1
            wait = min(10.0, 0.5 * 2 ** min(self._broker_failures, 5))
            log.warning("broker unreachable (%r); not dequeuing, retry in %.1fs", exc, wait)
            return wait
        rooms, served = view.rooms(), view.served()
        if time.monotonic() >= self._next_gauges:  # observability only: once a second, not every tick
            self._next_gauges = time.monotonic() + GAUGES_EVERY_S
            self._update_gauges(rooms, served)
        self._place_held(rooms, served)
        if self._hold.waits_on(served):  # a consumed queue is full and its rollout waits: claim nothing more
            return self._wait_for_slot()
        limit = placement.claim_limit(rooms, served, self.settings.max_batch)
        if not served.issuperset(self.queues):  # a rollout claimed for an unserved queue is held: keep room
            limit = min(limit, self._hold.room())
        if limit <= 0:
            if self._hold.room() == 0:
                log.debug("the hold is full (%d rollouts): claiming nothing until one goes out", len(self._hold))
            return self._wait_for_slot(gather_for=0 if self._hold else view.slots())
        try:
            metrics.DEQUEUE_REQUESTS.inc()
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
            self._place(rollout, rooms, served)
        if len(batch) >= limit:
            return 0.0
        return self._next_poll(found_work=bool(batch))

    def _next_poll(self, *, found_work: bool) -> float:
        """poll_min_s after work was found; each empty poll doubles the wait (jittered) up to poll_max_s,
        or up to the coalescer's share of the episode time where that is longer (long episodes)."""
        self._empty_polls = 0 if found_work else self._empty_polls + 1
        longest = max(self.settings.poll_max_s, self._coalescer.idle_poll_s())
        ceiling = min(longest, self.settings.poll_min_s * 2**self._empty_polls)
        return random.uniform(max(self.settings.poll_min_s, ceiling / 2), ceiling)

    # --- one rollout -----------------------------------------------------------------------------

    def _place(self, rollout: AttemptedRollout, rooms: dict[str, int], served: set[str]) -> None:
        """Publish one claimed rollout, or hold it; on an unexpected error, hand it back (never drop it)."""
        try:
            queue = self.settings.queue_for_mode(rollout.mode)
            if placement.fits(queue, rooms, served):
                rooms[queue] -= 1
                self.dispatch(rollout)
            else:  # the claim limit never exceeds the hold's room
                self._hold_rollout(rollout, queue, served)
        except Exception:
            metrics.LOOP_ERRORS.inc()
            log.exception("[rollout=%s attempt=%s] unexpected error placing it", *_ids(rollout))
            self.hand_back(rollout, "error")

    def _hold_rollout(self, rollout: AttemptedRollout, queue: str, served: set[str]) -> None:
        """Hold a claimed rollout whose queue has no room now (``bridge.dispatch.hold``)."""
        self._hold.add(rollout, queue)
        if queue in served:
            log.info("[rollout=%s] queue %s is full: held until a slot frees", rollout.rollout_id, queue)
            return
        log.info("[rollout=%s] no worker consumes queue %s: held until one does", rollout.rollout_id, queue)
        if queue not in self._unserved_reported:
            self._unserved_reported.add(queue)
            log.warning(
                "no live worker consumes queue %s (mode %r routes there, QUEUE_BY_MODE): its rollouts are held "
                "until a worker consumes it (at most BRIDGE_MAX_HELD=%d held in all)",
                queue,
                rollout.mode,
                self._hold.capacity,
            )

    def _place_held(self, rooms: dict[str, int], served: set[str]) -> None:
        """Publish the held rollouts whose queue has room; hand back those a full queue kept too long."""
        if not self._hold:
            return
        for held in self._hold.placeable(rooms, served):
            try:
                self.dispatch(held.rollout)
            except Exception:
                metrics.LOOP_ERRORS.inc()
                log.exception("[rollout=%s attempt=%s] unexpected error publishing it", *_ids(held.rollout))
                self.hand_back(held.rollout, "error")
        for held in self._hold.overdue(served, self.settings.max_queue_wait_s):
            log.warning(
                "[rollout=%s] queue %s full for %.0fs: handing it back",
                held.rollout.rollout_id,
                held.queue,
                self.settings.max_queue_wait_s,
            )
            self.hand_back(held.rollout, "no_room")
        self._unserved_reported &= {queue for queue in self._hold.by_queue() if queue not in served}

    def dispatch(self, rollout: AttemptedRollout) -> bool:
        """Publish, or hand back; returns True when the rollout is in the broker."""
        queue = self.settings.queue_for_mode(rollout.mode)
        aid = rollout.attempt.attempt_id
        try:
            capacity.mark_inflight(self.redis, self.scope, queue, aid)
            self.publisher.publish(rollout, queue)
        except (PublishError, redis.RedisError) as exc:
            metrics.BROKER_ERRORS.inc()
            log.error("could not publish %s: %s; handing it back", describe(rollout), exc)
            self._forget_inflight(queue, aid)
            self.hand_back(rollout, "publish_failed")
            return False
        except Exception:  # not the broker saying no: our bug or a library's; the rollout goes back all the same
            metrics.LOOP_ERRORS.inc()
            log.exception("unexpected error publishing %s; handing it back", describe(rollout))
            self._forget_inflight(queue, aid)
            self.hand_back(rollout, "error")
            return False
        metrics.PUBLISHED.labels(queue).inc()
        self._coalescer.dispatched()
        if rollout.attempt.start_time:
            metrics.DISPATCH_LATENCY.observe(max(0.0, time.time() - rollout.attempt.start_time))
        log.info("[rollout=%s attempt=%s task=%s] published to %s", rollout.rollout_id, aid, aid, queue)
        return True

    def hand_back(self, rollout: AttemptedRollout, reason: str) -> None:
        """Put a claimed rollout back at the tail of the Store queue, if it is still live and unstarted.

        See ``bridge.core.handback`` and docs/store-protocol.md section 10, "Handing a rollout back".
        """
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            why_not = handback.hand_back(self.store, rid, aid)
        except Exception as exc:  # a StoreError, or anything else: reconcile retries either way
            metrics.STORE_ERRORS.labels("hand_back").inc()
            # Still preparing under our dispatcher id: the next reconcile picks it up again.
            log.error("[rollout=%s] could not hand back (%s); reconciliation will retry", rollout.rollout_id, exc)
            self._next_reconcile = min(self._next_reconcile, time.monotonic() + 5.0)
            return
        if why_not is not None:
            metrics.HAND_BACKS_WITHHELD.inc()
            log.info("[rollout=%s attempt=%s] not handed back (%s): %s", rid, aid, reason, why_not)
            return
        metrics.HANDED_BACK.labels(reason).inc()
        log.warning("[rollout=%s attempt=%s] handed back to the Store (%s)", rid, aid, reason)

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
        * lost in flight: an in-flight entry older than ``max_queue_wait_s`` that no executor started or
          holds: its message never reached the broker or has expired unstarted. Its slot is freed, and
          its attempt, if still ours and ``preparing``, counts as stranded (its attempt is at least as old
          as the entry, so in practice it is handed back).
        All only after two scans ``confirm_s`` apart (see the module docstring).
        """
        self._next_reconcile = time.monotonic() + self.settings.reconcile_interval_s
        try:
            rollouts, _ = self.store.list_rollouts(status_in=[RolloutStatus.PREPARING, RolloutStatus.RUNNING])
            inflight: dict[str, str] = {}
            recorded: dict[str, float] = {}  # attempt id -> when its in-flight entry was recorded
            for queue in self.queues:
                capacity.prune_stale(self.redis, self.scope, queue, self.settings.redelivery_timeout_s)
                entries = capacity.inflight_entries(self.redis, self.scope, queue)
                inflight.update(dict.fromkeys(entries, queue))
                recorded.update(entries)
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
        self._release_moved_on(active)
        stranded -= self._hold.attempt_ids()  # claimed and deliberately not published yet
        lost = self._lost_in_flight(inflight, recorded, facts)
        confirmed = self._confirm(orphans | stranded | lost)
        for aid in sorted(confirmed & lost):
            self._forget_inflight(inflight[aid], aid)
            metrics.STRANDED_IN_FLIGHT.inc()
            log.warning(
                "[attempt=%s] in flight for %.0fs, never started, no lease: slot freed",
                aid,
                time.time() - recorded[aid],
            )
            if aid in active and active[aid].attempt.status == AttemptStatus.PREPARING and not facts[aid].done:
                stranded.add(aid)
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

    def _release_moved_on(self, active: dict[str, AttemptedRollout]) -> None:
        """Drop held rollouts the Store moved on from (cancelled, finished, started, timed out, superseded)."""
        for held in self._hold.discard(
            aid
            for aid in self._hold.attempt_ids()
            if aid not in active
            or active[aid].status != RolloutStatus.PREPARING
            or active[aid].attempt.status != AttemptStatus.PREPARING
        ):
            current = active.get(held.attempt_id)
            log.warning(
                "[rollout=%s attempt=%s] held for queue %s, but the Store moved on (%s): dropped, not published",
                held.rollout.rollout_id,
                held.attempt_id,
                held.queue,
                f"rollout {current.status}, attempt {current.attempt.status}" if current else "no longer active",
            )

    def _lost_in_flight(
        self, inflight: dict[str, str], recorded: dict[str, float], facts: dict[str, capacity.Execution]
    ) -> set[str]:
        """In-flight entries past the longest queue wait that nobody started or holds; schedules the next
        scan for when the youngest unstarted entry would cross that age (at most every 10 s)."""
        now, wait = time.time(), self.settings.max_queue_wait_s
        unstarted = {aid for aid in inflight if not (facts[aid].leased or facts[aid].started or facts[aid].done)}
        lost = {aid for aid in unstarted if now - recorded[aid] > wait}
        pending = [recorded[aid] + wait + 1.0 - now for aid in unstarted - lost]
        if pending:
            self._next_reconcile = min(self._next_reconcile, time.monotonic() + max(10.0, min(pending)))
        return lost

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

    def _ensure_leader(self) -> bool:
        leading, newly = self._lock.ensure()
        if newly:
            self._next_reconcile = 0.0  # a new leader repairs what the last one left at once
        return leading

    # --- helpers ---------------------------------------------------------------------------------

    def _wait_for_slot(self, gather_for: int = 0) -> float:
        """All slots busy: block on the workers' slot-freed wake-up (at most FULL_CAPACITY_WAIT_S).

        With ``gather_for`` (the slots that were all busy), a wake-up is followed by the coalescing wait
        (``bridge.dispatch.coalesce``), so that slots freed meanwhile share the next dequeue.
        """
        try:
            woken = capacity.wait_for_freed(self.redis, self.scope, self.queues, FULL_CAPACITY_WAIT_S)
        except redis.RedisError:
            return FULL_CAPACITY_WAIT_S  # the next tick's slot count reports the outage
        return self._coalescer.wait_s(gather_for) if woken and gather_for else 0.0

    def _forget_inflight(self, queue: str, attempt_id: str) -> None:
        try:
            capacity.clear_inflight(self.redis, self.scope, queue, attempt_id)
        except redis.RedisError:
            pass

    def _warn_about_other_scopes(self) -> None:
        """No worker serves any of our queues: once a minute, say so when workers list themselves on them under
        another Store's scope, as when this bridge and its workers spell the Store's URL differently
        (``bridge.core.coordination.deployment_scope``). One keyspace walk a minute, only while idle so."""
        now = time.monotonic()
        if now < self._next_scope_check:
            return
        self._next_scope_check = now + SCOPE_CHECK_EVERY_S
        try:
            others = capacity.listed_scopes(self.redis, self.queues) - {self.scope}
        except redis.RedisError:
            return
        if others:
            log.warning(
                "no worker of this Store (%s, Redis key scope %s) consumes queues %s, but workers list themselves "
                "on them under other scopes %s: if they are this deployment's, give them and this bridge the same "
                "AGENT_LIGHTNING_STORE_URL, or the same REDIS_KEY_SCOPE (docs/operations.md, several deployments "
                "on one Redis)",
                redact_url(self.settings.store_base),
                self.scope,
                ", ".join(self.queues),
                ", ".join(sorted(others)),
            )

    def _update_gauges(self, free: dict[str, int], served: set[str]) -> None:
        if not served:
            self._warn_about_other_scopes()
        held = self._hold.by_queue()
        for queue in self.queues:
            metrics.HELD.labels(queue).set(held.get(queue, 0))
            metrics.UNSERVED.labels(queue).set(0 if queue in served else 1)
        try:
            capacity.record_held(self.redis, self.scope, held, served)
        except redis.RedisError:
            pass
        if self._probe is None:
            self._probe = broker.queues_for(self.settings, self.redis)
        try:
            for queue in self.queues:
                metrics.FREE_SLOTS.labels(queue).set(free.get(queue, 0))
                metrics.IN_FLIGHT.labels(queue).set(capacity.inflight_count(self.redis, self.scope, queue))
                metrics.QUEUE_DEPTH.labels(queue).set(self._probe.depth(queue))
                metrics.OLDEST_QUEUED_AGE.labels(queue).set(self._probe.oldest_age(queue) or 0.0)
                oldest = capacity.oldest_inflight_age(self.redis, self.scope, queue)
                metrics.OLDEST_IN_FLIGHT_AGE.labels(queue).set(oldest or 0.0)
        except (redis.RedisError, broker.BrokerReadError):
            pass


def _ids(rollout: AttemptedRollout) -> tuple[str, str]:
    return rollout.rollout_id, rollout.attempt.attempt_id
