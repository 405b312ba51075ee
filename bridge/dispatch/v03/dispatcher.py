"""The 0.3 line of the one dispatcher (``bridge.dispatch.dispatcher``, ``python -m bridge``): claim only as many
rollouts as workers can start, publish each, lose none.

Backpressure, per queue: each queue's room comes from ``bridge.core.coordination.capacity`` (advertised worker slots,
a node's counted once however many queues it consumes, minus attempts in flight; negative when a queue
holds more than its nodes can run). A dequeue cannot choose the mode, and the mode picks the queue, so
``bridge.dispatch.v03.placement`` sizes each dequeue for any mix: a batch while every consumed queue has
room, one rollout at a time while some are full (a rollout that cannot be placed is *held* here,
never published into a full queue: ``bridge.dispatch.v03.hold``), none while all are. So no queue is
claimed beyond its slots by more than the held rollouts (``BRIDGE_MAX_HELD`` in all); with the single
default queue the batch is ``min(free slots, BRIDGE_MAX_BATCH)``, one request per batch; beside the 1.0 line
the default queue's room is first cut to this line's share (``bridge.core.coordination.slot_share``).
With no worker consuming there are no slots, so the bridge never dequeues and rollouts stay
``queuing`` in the Store, where their clock has not started yet.

Nothing dequeued is stranded: a rollout is recorded in flight before it is published; if the broker
refuses it after retries it is handed back to the Store queue (``requeuing``). What a crash leaves half
done (a claim never published, an in-flight entry no message carries, the slot of a worker that died with
its messages unacknowledged) is repaired by ``reconcile``, on start, every ``BRIDGE_RECONCILE_INTERVAL_S``
and sooner when asked: it reads the facts and applies the repairs ``bridge.dispatch.v03.repairs`` plans
from them (re-publish under the same task id, hand back, free a slot, drop a held rollout, settle a rollout
a late span revived with no live attempt). Workers do not
mark attempts ``running`` (their first span does), so the lease is what tells a started attempt from a
stranded one; nothing but a drop is repaired before it looked so on two scans ``confirm_s`` apart.

The tick's template, the error policy (a dequeue that fails backs off), the leader lock, the reconcile schedule and
repair runner, the share, the publishing and the in-flight accounting are the one dispatcher's; this line supplies its
round (share, hold, dequeue, place), its task (``rollout_task``), the hand-back, its facts and planner. Every Redis
key the loop uses is scoped by its Store (``self.scope``), so deployments sharing a Redis neither count each other's
slots nor contend for one lock.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import redis

from bridge.core.coordination import capacity, markers, slot_share
from bridge.core.infra import MAX_DOUBLINGS, StoreError, UnknownIdError, redact_url
from bridge.core.settings import DispatcherSettings
from bridge.core.store import AttemptedRollout, RolloutStatus, StoreClient, handback
from bridge.core.task import TASK_NAME, hard_time_limit, soft_time_limit, task_kwargs
from bridge.dispatch import broker, metrics
from bridge.dispatch.backlog import BacklogReader
from bridge.dispatch.dispatcher import LineDispatcher, Repair, StopSignal
from bridge.dispatch.publisher import Publisher, Task, clamp_timeout
from bridge.dispatch.v03 import placement
from bridge.dispatch.v03.backlog import store_reader
from bridge.dispatch.v03.coalesce import Coalescer
from bridge.dispatch.v03.hold import Hold
from bridge.dispatch.v03.repairs import (
    DropHeld,
    Facts,
    FreeLost,
    FreeOrphan,
    HandBack,
    Plan,
    Republish,
    Settle,
    active_attempts,
    dead_ends,
    plan_repairs,
    why_not_settle,
)

log = logging.getLogger(__name__)

FULL_CAPACITY_WAIT_S = 0.2
UNEXPECTED_ERROR_WAIT_S = 1.0
_INSTRUCTION_PREVIEW = 60


def describe(rollout: AttemptedRollout) -> str:
    """What monitoring shows for a task: ids and the start of the instruction, never secrets."""
    instruction = ""
    if isinstance(rollout.input, dict) and isinstance(rollout.input.get("instruction"), str):
        instruction = rollout.input["instruction"][:_INSTRUCTION_PREVIEW]
    ids = f"rollout={rollout.rollout_id} attempt={rollout.attempt.attempt_id}"
    return f"{ids} mode={rollout.mode} instruction={instruction!r}"


def rollout_task(rollout: AttemptedRollout, queue: str, settings: DispatcherSettings, agent: str) -> Task:
    """A claimed rollout's message, ``workers.run_rollout``: task id = attempt id, the rollout exactly as the Store
    returned it (its ``timeout_seconds`` clamped to what the broker covers) and the agent it expects, soft and hard
    limits from that timeout, an expiry of ``BRIDGE_MAX_QUEUE_WAIT_S``."""
    rollout = clamp_timeout(rollout, settings, f"rollout={rollout.rollout_id} attempt={rollout.attempt.attempt_id}")
    timeout = rollout.config.timeout_seconds
    return Task(
        name=TASK_NAME,
        task_id=rollout.attempt.attempt_id,
        queue=queue,
        kwargs=task_kwargs(rollout, queue, agent),
        soft_time_limit=soft_time_limit(settings, timeout),
        time_limit=hard_time_limit(settings, timeout),
        describe=describe(rollout),
        expires=settings.max_queue_wait_s,
    )


class V03Dispatcher(LineDispatcher[AttemptedRollout]):
    """The 0.3 line on the one dispatcher (``bridge.dispatch.dispatcher``): a Store's rollouts, dequeued within
    each queue's room, held, coalesced and placed per queue, published by task name."""

    line = slot_share.V03
    loop_name = "dispatch"
    error_wait_s = UNEXPECTED_ERROR_WAIT_S
    stopped_message = "bridge stopped"
    logger = log
    facts_errors = (StoreError, redis.RedisError)
    upstream_errors = (StoreError,)
    upstream_counter = (metrics.STORE_ERRORS, "dequeue")
    upstream_call = "dequeue"
    waiting_gauges = (metrics.STORE_WAITING, metrics.STORE_OLDEST_WAITING)

    def __init__(
        self,
        settings: DispatcherSettings,
        store: StoreClient,
        redis_client: redis.Redis,
        publisher: Publisher,
        stop: StopSignal | None = None,
        *,
        strict_scope: bool = False,
        coalescer: Coalescer | None = None,
    ) -> None:
        """``strict_scope``: raise ScopeMismatchError from ``run`` when this Store's workers appear only under
        another spelling of its URL (``bridge.core.coordination.scope_check``), instead of logging it
        (``CeleryRunner``). ``coalescer``: the estimate of episode time the waits follow (default: one on
        ``coalesce_max_s``)."""
        self.store = store
        self._empty_polls = 0
        self._hold = Hold(settings.max_held)  # claimed rollouts whose queue has no room now
        self._unserved_reported: set[str] = set()  # queues already logged as consumed by no worker
        self._coalescer = coalescer if coalescer is not None else Coalescer(settings.coalesce_max_s)
        # Whether the last dequeue came back full, and the backlog reading it followed (``_share_slots``).
        self._last_dequeue: tuple[bool, object] | None = None
        super().__init__(
            settings,
            redis_client,
            publisher,
            stop,
            queues=settings.all_queues(),
            lock_owner=settings.dispatcher_id,
            who="this bridge" if not strict_scope else "CeleryRunner",
            strict_scope=strict_scope,
        )

    def _backlog_reader(self, leading: Callable[[], bool]) -> BacklogReader:
        return store_reader(self.store, self.settings, leading=leading)  # the Store's waiting rollouts

    # --- the loop ------------------------------------------------------------------------------

    def _announce(self) -> None:
        log.info(
            "bridge %s dispatching to queues %s for Store %s (Redis key scope %s)",
            self.settings.dispatcher_id,
            ", ".join(self.queues),
            redact_url(self.settings.store_base),
            self.scope,
        )

    def _give_back_all(self) -> None:
        for held in self._hold.take_all():  # claimed, never published: give them back rather than strand them
            self.hand_back(held.rollout, "shutdown")

    def _round(self, view: capacity.SlotView) -> float:
        """Share, place what is held, then claim within the room: a batch while every consumed queue has room, one
        rollout while some are full, none while all are (``bridge.dispatch.v03.placement``)."""
        rooms, served = view.rooms(), view.served()
        self._share_slots(view, rooms, served)
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
        metrics.DEQUEUE_REQUESTS.inc()
        try:
            batch = self.store.dequeue(limit, self.settings.dispatcher_id)  # a StoreError is the loop's: backoff
        except UnknownIdError as exc:  # never expected for dequeue; do not spin on it
            log.error("dequeue rejected: %s", exc)
            return self.settings.poll_max_s
        metrics.DEQUEUED.inc(len(batch))
        self._last_dequeue = (len(batch) >= limit, self._backlog.latest)
        for rollout in batch:
            self._place(rollout, rooms, served)
        if len(batch) >= limit:
            return 0.0
        return self.next_poll(found_work=bool(batch))

    def _share_slots(self, view: capacity.SlotView, rooms: dict[str, int], served: set[str]) -> None:
        """Beside a 1.0 dispatcher, cut the default queue's room to this line's fair share (``_share``), this line's
        demand the Store's waiting rollouts (the last backlog reading, unless a dequeue since said more: a full
        batch, at least the queue's slots; a short one, none) and those held."""
        queue = self.settings.default_queue
        if queue not in served:
            return
        total = view.totals().get(queue, 0)
        latest = self._backlog.latest
        waiting = latest.waiting.get(queue, 0) if latest is not None else 0
        if self._last_dequeue is not None and self._last_dequeue[1] is latest:  # the dequeue is the fresher news:
            waiting = max(waiting, total) if self._last_dequeue[0] else 0  # full: more wait; short: none do
        self._share(view, rooms, waiting + self._hold.by_queue().get(queue, 0))

    def next_poll(self, *, found_work: bool) -> float:
        """poll_min_s after work was found; each empty poll doubles the wait (jittered) up to poll_max_s,
        or up to the coalescer's share of the episode time where that is longer (long episodes). The count of empty
        polls stops at ``MAX_DOUBLINGS``, so an idle bridge never overflows a float however long it waits."""
        self._empty_polls = 0 if found_work else min(self._empty_polls + 1, MAX_DOUBLINGS)  # bounded: idle for days
        longest = max(self.settings.poll_max_s, self._coalescer.idle_poll_s())
        ceiling = min(longest, self.settings.poll_min_s * 2**self._empty_polls)
        return random.uniform(max(self.settings.poll_min_s, ceiling / 2), ceiling)

    # --- one rollout -----------------------------------------------------------------------------

    def _place(self, rollout: AttemptedRollout, rooms: dict[str, int], served: set[str]) -> None:
        """Publish one claimed rollout, or hold it; on an unexpected error, hand it back (never drop it)."""
        try:
            if not self._lock.valid():  # the fence: leadership may have lapsed while the dequeue blocked
                log.warning("[rollout=%s attempt=%s] claimed, but this bridge no longer leads", *_ids(rollout))
                self.hand_back(rollout, "not_leader")
                return
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
        """Hold a claimed rollout whose queue has no room now (``bridge.dispatch.v03.hold``)."""
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
        if not self._hold or not self._lock.valid():  # the fence: only a leader publishes what it holds
            return
        for held in self._hold.placeable(rooms, served):
            self.dispatch(held.rollout)  # an error publishing it hands it back (``_unsendable``)
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
        """Publish (``LineDispatcher._send``), or hand back; returns True when the rollout is in the broker."""
        return self._send(rollout)

    def _task(self, claim: AttemptedRollout) -> Task:
        return rollout_task(claim, self.settings.queue_for_mode(claim.mode), self.settings, self.publisher.agent)

    def _sent(self, claim: AttemptedRollout, task: Task) -> None:
        self._coalescer.dispatched()
        if claim.attempt.start_time:
            metrics.DISPATCH_LATENCY.observe(max(0.0, time.time() - claim.attempt.start_time))
        aid = task.task_id
        log.info("[rollout=%s attempt=%s task=%s] published to %s", claim.rollout_id, aid, aid, task.queue)

    def _refused(self, claim: AttemptedRollout, error: Exception) -> None:
        log.error("could not publish %s: %s; handing it back", describe(claim), error)
        self.hand_back(claim, "publish_failed")

    def _unsendable(self, claim: AttemptedRollout, error: Exception) -> None:
        metrics.LOOP_ERRORS.inc()  # the rollout goes back all the same
        log.exception("unexpected error publishing %s; handing it back", describe(claim))
        self.hand_back(claim, "error")

    def hand_back(self, rollout: AttemptedRollout, reason: str) -> None:
        """Put a claimed rollout back at the tail of the Store queue, if it is still live and unstarted.

        See ``bridge.core.store.handback`` and docs/store-protocol.md section 10, "Handing a rollout back".
        """
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            why_not = handback.hand_back(self.store, rid, aid)
        except Exception as exc:  # a StoreError, or anything else: reconcile retries either way
            metrics.STORE_ERRORS.labels("hand_back").inc()
            # Still preparing under our dispatcher id: the next reconcile picks it up again.
            log.error("[rollout=%s] could not hand back (%s); reconciliation will retry", rollout.rollout_id, exc)
            self.reconcile_by(time.monotonic() + 5.0)
            return
        if why_not is not None:
            metrics.HAND_BACKS_WITHHELD.inc()
            log.info("[rollout=%s attempt=%s] not handed back (%s): %s", rid, aid, reason, why_not)
            return
        metrics.HANDED_BACK.labels(reason).inc()
        log.warning("[rollout=%s attempt=%s] handed back to the Store (%s)", rid, aid, reason)

    # --- repair ----------------------------------------------------------------------------------

    def _plan(self) -> Plan:
        """Read the facts and plan (``bridge.dispatch.v03.repairs``): re-publish or hand back stranded attempts,
        free slots, drop held rollouts the Store moved on from, settle dead ends. The plan may ask for the next
        scan sooner (a suspect to confirm, a young in-flight entry to look at again)."""
        return plan_repairs(self._reconcile_facts())

    def _carry_out(self, repair: Repair) -> None:
        if isinstance(repair, DropHeld):
            self._drop_moved_on(repair)
        elif isinstance(repair, FreeLost | FreeOrphan):
            self._free_slot(repair)
        elif isinstance(repair, Republish | HandBack):
            self._restart(repair)
        elif isinstance(repair, Settle):
            self._settle(repair)

    def _reconcile_facts(self) -> Facts:
        """What a scan plans from; stale in-flight entries (older than any task could live) are pruned first."""
        rollouts, _ = self.store.list_rollouts(status_in=[RolloutStatus.PREPARING, RolloutStatus.RUNNING])
        inflight: dict[str, dict[str, float]] = {}
        for queue in self.queues:
            capacity.prune_stale(self.redis, self.scope, queue, self.settings.redelivery_timeout_s)
            inflight[queue] = capacity.inflight_entries(self.redis, self.scope, queue)
        active = active_attempts(rollouts)
        ended = dead_ends(rollouts)
        return Facts(
            active=active,
            inflight=inflight,
            executions=markers.read_markers(self.redis, set(active).union(ended, *inflight.values())),
            held=frozenset(self._hold.attempt_ids()),
            suspects=dict(self._suspects),
            now=time.time(),
            monotonic=time.monotonic(),
            dispatcher_id=self.settings.dispatcher_id,
            max_queue_wait_s=self.settings.max_queue_wait_s,
            confirm_s=self.confirm_s,
            dead_ends=ended,
            drained=self.drained_queues() if any(inflight.values()) else frozenset(),
        )

    def _drop_moved_on(self, drop: DropHeld) -> None:
        for held in self._hold.discard({drop.attempt_id: drop.store_says}):
            log.warning(
                "[rollout=%s attempt=%s] held for queue %s, but the Store moved on (%s): dropped, not published",
                held.rollout.rollout_id,
                held.attempt_id,
                held.queue,
                drop.store_says,
            )

    def _free_slot(self, free: FreeLost | FreeOrphan) -> None:
        self._clear_inflight(free.queue, free.attempt_id)
        if isinstance(free, FreeLost):
            metrics.STRANDED_IN_FLIGHT.labels(slot_share.V03).inc()
            log.warning(
                "[attempt=%s] in flight for %.0fs, never started, no lease: slot freed",
                free.attempt_id,
                free.in_flight_s,
            )
        else:
            metrics.ORPHANS_FREED.inc()
            log.warning("[attempt=%s] its executor is gone (no lease): slot freed", free.attempt_id)

    def _restart(self, restart: Republish | HandBack) -> None:
        if isinstance(restart, HandBack):
            self.hand_back(restart.rollout, "stranded")
        elif self.dispatch(restart.rollout):
            metrics.REPUBLISHED.labels(slot_share.V03).inc()
            log.warning(
                "[rollout=%s attempt=%s] was stranded (%s); re-published",
                *_ids(restart.rollout),
                "its executor died" if restart.executor_died else "bridge crash or broker loss",
            )

    def _settle(self, settle: Settle) -> None:
        """Write the status the Store's retry policy gives a dead-end rollout, if a re-read still shows it so
        (a cancelled, finished, requeued or superseded one is left alone). Errors wait for the next scan."""
        rid, aid = _ids(settle.rollout)
        try:
            current = self.store.get_rollout(rid)
            why_not = why_not_settle(current, settle)
            if why_not is None:
                self.store.update_rollout(rid, status=settle.status)
        except UnknownIdError:
            return
        except Exception as exc:  # a StoreError, or anything else: the next scan sees it again
            metrics.STORE_ERRORS.labels("settle").inc()
            log.error("[rollout=%s attempt=%s] could not settle (%s); reconciliation will retry", rid, aid, exc)
            return
        if why_not is not None:
            log.info("[rollout=%s attempt=%s] not settled: %s", rid, aid, why_not)
            return
        metrics.SETTLED.labels(settle.status).inc()
        log.warning(
            "[rollout=%s attempt=%s] was %s with its latest attempt %s and no lease (a span after the report?);"
            " set to %s, as the Store's retry policy would",
            rid,
            aid,
            settle.rollout.status,
            settle.rollout.attempt.status,
            settle.status,
        )

    # --- helpers ---------------------------------------------------------------------------------

    def _wait_for_slot(self, gather_for: int = 0) -> float:
        """All slots busy: block on the workers' slot-freed wake-up (at most FULL_CAPACITY_WAIT_S).

        With ``gather_for`` (the slots that were all busy), a wake-up is followed by the coalescing wait
        (``bridge.dispatch.v03.coalesce``), so that slots freed meanwhile share the next dequeue.
        """
        try:
            woken = self.wait_for_freed(self.queues, FULL_CAPACITY_WAIT_S)
        except redis.RedisError:
            return FULL_CAPACITY_WAIT_S  # the next tick's slot count reports the outage
        return self._coalescer.wait_s(gather_for) if woken and gather_for else 0.0

    def _held(self) -> dict[str, int]:
        return self._hold.by_queue()

    def _line_gauges(self, view: capacity.SlotView) -> None:
        """Free slots, held rollouts and unserved queues; the broker's depth and oldest message; the oldest
        in-flight entry."""
        free, served = view.rooms(), view.served()
        held = self._hold.by_queue()
        for queue in self.queues:
            metrics.FREE_SLOTS.labels(queue).set(free.get(queue, 0))
            metrics.HELD.labels(queue).set(held.get(queue, 0))
            metrics.UNSERVED.labels(queue).set(0 if queue in served else 1)
        try:
            capacity.record_held(self.redis, self.scope, held, served)
        except redis.RedisError:
            pass
        try:
            probe = self.queue_probe()
            for queue in self.queues:
                metrics.QUEUE_DEPTH.labels(queue).set(probe.depth(queue))
                metrics.OLDEST_QUEUED_AGE.labels(queue).set(probe.oldest_age(queue) or 0.0)
                oldest = capacity.oldest_inflight_age(self.redis, self.scope, queue)
                metrics.OLDEST_IN_FLIGHT_AGE.labels(queue).set(oldest or 0.0)
        except (redis.RedisError, broker.BrokerReadError):
            pass


def _ids(rollout: AttemptedRollout) -> tuple[str, str]:
    return rollout.rollout_id, rollout.attempt.attempt_id
