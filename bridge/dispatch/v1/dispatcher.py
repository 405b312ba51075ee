"""The 1.0 line of the one dispatcher (``bridge.dispatch.dispatcher``), ``python -m bridge v1``: Agent Lightning 1.0
rollouts on the Celery cluster, as a runner type beside 1.0's ``local`` and ``k8s`` (docs/agl-v1.md).

Each tick, as leader: as many ``queuing`` rollouts as the workers have free slots are published as
``workers.run_v1_rollout`` (task id ``attempt_key``), recorded in flight in the same accounting the 0.3 bridge
uses, and marked ``running``. Each rollout of a listing is validated on its own: one this project cannot read is
failed on the gateway with the fields at fault, and the others go on. A publish the broker refuses is retried
on later ticks with backoff, the rollouts behind it going on meanwhile, and fails the rollout with the broker's
error after ``AGL_V1_PUBLISH_GIVE_UP_S``; an error no retry can cure fails it at once. Error texts are masked
(``bridge.core.infra.redact``) before they reach the gateway or the log. Time budgets are clamped to what the broker
covers by the rule the worker applies to the gateway's copy too (``bridge.core.task.time_budget.clamp_to_broker``).

Each reconcile reads the facts, plans the repairs (``bridge.dispatch.v1.repairs``, which says what each hazard
gets) and carries them out one by one, so one failing repair stops no other. Every step is safe to repeat, so
a dispatcher killed anywhere is restarted (or replaced by a standby) without running a rollout twice.
Hand-overs are counted per rollout in Redis (``keys.v1_handovers``, a set of attempt ids, so counting one twice
is impossible), which a re-run's limit subtracts from the attempts numbered so far.

The leader reads the gateway's queuing rollouts on a thread of its own (``bridge.dispatch.backlog``) and exports
them with the queue's desired slots, which count the 0.3 line's backlog too (``bridge.core.coordination.line_demand``);
with ``--metrics-port`` (or ``BRIDGE_METRICS_PORT``) it serves the dispatch series of ``bridge.dispatch.metrics`` under
``line="v1"`` (docs/operations.md, "Autoscaling signal").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import redis

from bridge.core.coordination import capacity, coordination_redis, deployment_scope, keys, markers, slot_share
from bridge.core.gateway import (
    FIRST_ATTEMPT,
    V1_TASK_NAME,
    GatewayClient,
    GatewayConflict,
    GatewayError,
    Malformed,
    V1Rollout,
    V1State,
    attempt_key,
    scoped_attempt_key,
)
from bridge.core.infra import MissingSetting, backoff_delay, redact_error, redact_text, redact_url
from bridge.core.settings import DispatcherSettings
from bridge.core.task import Outcome, base_app, failed_message, v1_time_limits
from bridge.dispatch import metrics
from bridge.dispatch.backlog import BacklogReader
from bridge.dispatch.dispatcher import LineDispatcher, Repair, start_process
from bridge.dispatch.leader import STANDBY_RETRY_S
from bridge.dispatch.publisher import Publisher, Task, clamp_timeout
from bridge.dispatch.v1.backlog import gateway_reader
from bridge.dispatch.v1.repairs import (
    ApplyKept,
    Fail,
    FreeSlot,
    Republish,
    Rerun,
    Unreadable,
    V1Facts,
    V1Plan,
    current_key,
    plan_v1_repairs,
)

log = logging.getLogger("bridge.v1")

IDLE_POLL_S = 1.0  # between gateway reads while nothing is queuing or no slot is free
BUSY_POLL_S = 0.2  # after a tick that published
ERROR_WAIT_S = 5.0
REFUSAL_BACKOFF_BASE_S = 1.0  # a refused publish is tried again after this, doubling up to the cap
REFUSAL_BACKOFF_CAP_S = 30.0
INPUT, INFRA = "input", "infra"  # the failure classes of the rollouts the dispatcher fails, as the workers name them


class V1Attempt(NamedTuple):
    """What the 1.0 line publishes: a rollout's attempt."""

    rollout: V1Rollout
    attempt_id: str


@dataclass
class _Refused:
    first_s: float
    tries: int
    retry_at_s: float


class PublishRefusals:
    """Per rollout, since when the broker keeps refusing its publish and when to try again (backoff). Held in
    memory: a restarted dispatcher starts the clock again."""

    def __init__(self, give_up_s: float, stale_after_s: float) -> None:
        self.give_up_s, self.stale_after_s = give_up_s, stale_after_s
        self._refused: dict[str, _Refused] = {}

    def waiting(self, rollout_id: str, now: float) -> bool:
        """Its last publish was refused and its next try is not due yet."""
        refused = self._refused.get(rollout_id)
        return refused is not None and now < refused.retry_at_s

    def refused(self, rollout_id: str, now: float) -> float | None:
        """Count one refusal: the seconds until the next try, or None when it has been refused for
        ``give_up_s`` and must fail (it is forgotten then)."""
        refused = self._refused.setdefault(rollout_id, _Refused(now, 0, now))
        if now - refused.first_s >= self.give_up_s:
            del self._refused[rollout_id]
            return None
        delay = backoff_delay(refused.tries, base_s=REFUSAL_BACKOFF_BASE_S, cap_s=REFUSAL_BACKOFF_CAP_S)
        refused.tries += 1
        refused.retry_at_s = now + delay
        return delay

    def since(self, rollout_id: str, now: float) -> float:
        refused = self._refused.get(rollout_id)
        return now - refused.first_s if refused is not None else 0.0

    def forget(self, rollout_id: str) -> None:
        self._refused.pop(rollout_id, None)

    def forget_stale(self, now: float) -> None:
        """Forget the rollouts nobody tried to publish for ``stale_after_s`` after their try was due: they left
        the gateway's queue (the trainer failed or deleted them) or another dispatcher published them."""
        self._refused = {rid: r for rid, r in self._refused.items() if now - r.retry_at_s < self.stale_after_s}

    def __len__(self) -> int:
        return len(self._refused)


class V1Dispatcher(LineDispatcher[V1Attempt]):
    """The 1.0 line on the one dispatcher (``bridge.dispatch.dispatcher``): a gateway's queuing rollouts published
    as ``workers.run_v1_rollout`` on the default queue, repaired by the plan of ``bridge.dispatch.v1.repairs``."""

    line = slot_share.V1
    loop_name = "1.0 dispatch"
    error_wait_s = ERROR_WAIT_S
    stopped_message = "1.0 dispatcher stopped"
    logger = log
    facts_errors = ()  # a gateway or Redis error is the loop's: counted, and the scan is due again at once
    upstream_errors = (GatewayError,)
    upstream_counter = (metrics.GATEWAY_ERRORS, "dispatch")
    upstream_call = "a gateway request"
    upstream_backoff = (1.0, ERROR_WAIT_S)  # a listing claims nothing: a gateway back is served within 5 s
    waiting_gauges = (metrics.GATEWAY_WAITING, metrics.GATEWAY_OLDEST_WAITING)

    def __init__(
        self, settings: DispatcherSettings, gateway: GatewayClient, client: redis.Redis, stop: threading.Event
    ) -> None:
        self.gateway = gateway
        self.queue = settings.default_queue
        self._state_keys: dict[str, str] = {}  # attempt key -> its scoped state key (``_facts``)
        super().__init__(  # the workers' slots: the same cluster as the 0.3 line
            settings,
            client,
            Publisher(settings, app=base_app(settings, "bridge-v1")),
            stop,
            queues=[self.queue],
            lock_owner=f"{settings.dispatcher_id}-v1",
            lock_scope=f"{deployment_scope(settings)}:v1",
            who="the 1.0 dispatcher",
        )
        # A refused re-publish of a running rollout is tried again by a later reconcile (within two scans).
        stale_after_s = settings.agl_v1_publish_give_up_s + 2 * (settings.reconcile_interval_s + self.confirm_s)
        self.refusals = PublishRefusals(settings.agl_v1_publish_give_up_s, stale_after_s)

    def _backlog_reader(self, leading: Callable[[], bool]) -> BacklogReader:
        return gateway_reader(self.gateway, self.settings, self.queue, leading=leading)  # the gateway's queuing

    def _announce(self) -> None:
        log.info(
            "1.0 dispatcher %s: gateway %s, queue %s (Redis key scope %s)",
            self.settings.dispatcher_id,
            redact_url(self.gateway.base_url),
            self.queue,
            self.scope,
        )

    def _round(self, view: capacity.SlotView) -> float:
        """List the queuing rollouts, fail those this project cannot read, and start as many as the share leaves
        room for; a rollout whose refused publish waits for its next try is skipped."""
        total = view.totals().get(self.queue, 0)
        if self.queue not in view.served() or total < 1:
            return IDLE_POLL_S
        # Up to every slot's worth of queuing rollouts, so the 0.3 bridge beside it sees this line's demand, and
        # past the rollouts whose refused publish waits for its next try (they come first in the listing).
        queuing, malformed = self.gateway.list_checked(V1State.QUEUING, limit=total + len(self.refusals))
        for bad in malformed:
            self._fail_malformed(bad)
        now = time.time()
        self.refusals.forget_stale(now)
        waiting = [r for r in queuing if not self.refusals.waiting(r.rollout_id, now)]
        rooms = view.rooms()
        self._share(view, rooms, len(waiting))
        room = max(0, rooms[self.queue])
        for rollout in waiting[:room]:
            if not self._lock.valid():  # the fence: leadership lapsed while this tick ran
                return STANDBY_RETRY_S
            try:
                self._start(rollout)
            except GatewayError as exc:  # this rollout's call failed: it is still queuing, the next tick lists it
                log.warning("[v1 rollout=%s] not started: %s", rollout.rollout_id, exc)
        if room < len(waiting):  # work waits for a slot: look again as soon as one frees
            self.wait_for_freed([self.queue], IDLE_POLL_S)
            return 0.0
        return BUSY_POLL_S if waiting or malformed else IDLE_POLL_S

    # --- one rollout ---------------------------------------------------------------------------

    def _start(self, rollout: V1Rollout) -> None:
        """Publish a queuing rollout's first attempt and mark it running."""
        local = rollout.config.local
        if local is None or not local.agent_class:
            why = "invalid rollout config: missing config.local.agent_class"
            self._fail(rollout.rollout_id, FIRST_ATTEMPT, why, INPUT)
            return
        if not self._publish(rollout, FIRST_ATTEMPT):
            return
        try:
            self.gateway.patch_status(rollout.rollout_id, state=V1State.RUNNING, last_attempt_id=FIRST_ATTEMPT)
        except GatewayConflict:
            pass  # the worker marked it running first, or the trainer failed it: the worker sees which
        except GatewayError as exc:  # the worker marks it running when it starts
            log.warning("[v1 rollout=%s] published; marking it running failed: %s", rollout.rollout_id, exc)

    def _publish(self, rollout: V1Rollout, attempt_id: str) -> bool:
        """Send the attempt's task (``LineDispatcher._send``); True when the broker took it. A refusal leaves the
        rollout as it is, to be tried again after a backoff, and fails it once refused for
        ``AGL_V1_PUBLISH_GIVE_UP_S``; any other error fails it at once, since no retry cures it."""
        return self._send(V1Attempt(rollout, attempt_id))

    def _task(self, claim: V1Attempt) -> Task:
        """``workers.run_v1_rollout``, task id ``attempt_key``; the rollout's time budget clamped to what the broker
        covers, the limits above it (``v1_time_limits``)."""
        rid, attempt_id = claim.rollout.rollout_id, claim.attempt_id
        ids = f"v1 rollout={rid} attempt={attempt_id}"
        rollout = clamp_timeout(claim.rollout, self.settings, ids, agl_v1=True)
        soft, hard = v1_time_limits(self.settings, rollout.config.timeout_seconds)
        return Task(
            name=V1_TASK_NAME,
            task_id=attempt_key(rid, attempt_id),
            queue=self.queue,
            kwargs={"rollout": rollout.model_dump(mode="json"), "attempt_id": attempt_id, "queue": self.queue},
            soft_time_limit=soft,
            time_limit=hard,
            describe=ids,
        )

    def _sent(self, claim: V1Attempt, task: Task) -> None:
        self.refusals.forget(claim.rollout.rollout_id)
        log.info("[v1 rollout=%s attempt=%s] published to %s", claim.rollout.rollout_id, claim.attempt_id, task.queue)

    def _refused(self, claim: V1Attempt, error: Exception) -> None:
        rid = claim.rollout.rollout_id
        now = time.time()
        refused_for = self.refusals.since(rid, now)
        delay = self.refusals.refused(rid, now)
        said = redact_text(str(error.__cause__ or error))  # for the log and the gateway, as 0.3 masks every error
        if delay is not None:
            log.warning("[v1 rollout=%s] the broker did not take it (%s); trying again in %.0fs", rid, said, delay)
            return
        self._fail(rid, claim.attempt_id, f"the broker did not take the rollout for {refused_for:.0f}s: {said}", INFRA)

    def _unsendable(self, claim: V1Attempt, error: Exception) -> None:
        rid = claim.rollout.rollout_id
        self.refusals.forget(rid)
        why = f"the rollout could not be published: {redact_error(error)}"
        log.error("[v1 rollout=%s attempt=%s] %s", rid, claim.attempt_id, why)  # no traceback: its text is not masked
        self._fail(rid, claim.attempt_id, why, INFRA)

    def _fail(self, rollout_id: str, attempt_id: str, why: str, failure_class: str) -> None:
        """Fail the attempt on the gateway if it is still current (``GatewayClient.finish``), counted by class and
        worded as a worker words a failure (``failed_message``)."""
        if self.gateway.finish(rollout_id, attempt_id, V1State.FAILED, failed_message(failure_class, why)):
            metrics.FAILED.labels(failure_class).inc()
            log.warning("[v1 rollout=%s attempt=%s] failed: %s", rollout_id, attempt_id, why)
        else:
            log.info("[v1 rollout=%s attempt=%s] not failed (moved on): %s", rollout_id, attempt_id, why)

    def _fail_malformed(self, rollout: Malformed) -> None:
        """Fail a rollout of a listing that this project cannot read, with the fields at fault."""
        try:
            failed = self.gateway.fail_malformed(rollout)
        except GatewayError as exc:
            log.warning(
                "[v1 rollout=%s] %s; failing it on the gateway failed: %s", rollout.rollout_id, rollout.reason, exc
            )
            return
        if failed:
            metrics.FAILED.labels(INPUT).inc()
            log.warning("[v1 rollout=%s] failed: %s", rollout.rollout_id, rollout.reason)
        else:
            log.warning("[v1 rollout=%s] skipped, not failed (gone or unnamed): %s", rollout.rollout_id, rollout.reason)

    # --- repairs -------------------------------------------------------------------------------

    def _plan(self) -> V1Plan:
        """Read the facts (the gateway's running rollouts, failing those this project cannot read) and plan
        (``bridge.dispatch.v1.repairs``)."""
        running, malformed = self.gateway.list_checked(V1State.RUNNING, limit=100_000)
        for bad in malformed:
            self._fail_malformed(bad)
        return plan_v1_repairs(self._facts(running))

    def _state_key(self, key: str) -> str:
        """The deployment-scoped name of attempt ``key``'s Redis state, as the last ``_facts`` read it."""
        return self._state_keys.get(key, key)

    def _facts(self, running: list[V1Rollout]) -> V1Facts:
        """What the plan is made from: one Redis round trip for the markers, records and hand-overs."""
        now = time.time()
        current = {current_key(r): r for r in running}
        # The workers keep an attempt's markers and outcome under its deployment-scoped name (the rollout's
        # creation time included: a reused rollout id is a new attempt). An in-flight entry whose rollout no
        # longer runs has no rollout to name it by: its lease is not seen, and it is freed after the queue wait.
        self._state_keys = {
            key: scoped_attempt_key(self.scope, r, r.status.last_attempt_id or FIRST_ATTEMPT)
            for key, r in current.items()
        }
        inflight = {
            key: at
            for key, at in capacity.inflight_entries(self.redis, self.scope, self.queue).items()
            if key.startswith("v1-")
        }
        named = sorted(set(current) | set(inflight))
        rids = sorted({r.rollout_id for r in running})
        pipe = self.redis.pipeline(transaction=False)
        for key in named:
            markers.queue_reads(pipe, self._state_key(key))
        for key in current:
            pipe.get(keys.v1_result(self._state_key(key)))
        for rid in rids:
            pipe.scard(keys.v1_handovers(self.scope, rid))
        answers = iter(pipe.execute())
        executions = {key: markers.from_answers(next(answers), next(answers), next(answers)) for key in named}
        kept: dict[str, Outcome | Unreadable] = {}
        for key in current:
            raw = next(answers)
            if raw is not None:
                try:
                    kept[key] = Outcome.parse(raw)
                except ValueError as exc:
                    kept[key] = Unreadable(str(exc))
        handovers = {rid: int(next(answers)) for rid in rids}
        return V1Facts(
            running=current,
            inflight=inflight,
            executions=executions,
            kept=kept,
            handovers=handovers,
            suspects=dict(self._suspects),
            now=now,
            monotonic=time.monotonic(),
            max_queue_wait_s=self.settings.max_queue_wait_s,
            confirm_s=self.confirm_s,
            max_reruns=self.settings.agl_v1_max_reruns,
            drained=bool(inflight) and self.queue in self.drained_queues(),
        )

    def _carry_out(self, repair: Repair) -> None:
        if isinstance(repair, ApplyKept):
            self._apply(repair)
        elif isinstance(repair, Republish):
            rid, aid = repair.rollout.rollout_id, repair.attempt_id
            log.warning("[v1 rollout=%s attempt=%s] its message never started: publishing it again", rid, aid)
            if self._publish(repair.rollout, aid):
                metrics.REPUBLISHED.labels(slot_share.V1).inc()
        elif isinstance(repair, Rerun):
            self._rerun(repair)
        elif isinstance(repair, Fail):
            self._fail(repair.rollout_id, repair.attempt_id, repair.reason, INFRA)
            capacity.clear_inflight(self.redis, self.scope, self.queue, repair.key)
            self.redis.delete(keys.v1_result(self._state_key(repair.key)))
        elif isinstance(repair, FreeSlot):
            log.warning(
                "[v1 %s] in flight for %.0fs, no running rollout waits for it: slot freed",
                repair.key,
                repair.in_flight_s,
            )
            capacity.clear_inflight(self.redis, self.scope, self.queue, repair.key)
            capacity.notify_freed(self.redis, self.scope, self.queue)
            metrics.STRANDED_IN_FLIGHT.labels(slot_share.V1).inc()

    def _apply(self, repair: ApplyKept) -> None:
        """An outcome the worker could not send: set it now (current attempt only), then drop it."""
        outcome = repair.outcome
        assert outcome.state is not None
        state = V1State(outcome.state)
        if not self.gateway.finish(repair.rollout_id, repair.attempt_id, state, outcome.message()):
            log.info(
                "[v1 rollout=%s attempt=%s] kept outcome not applied: moved on", repair.rollout_id, repair.attempt_id
            )
        self.redis.delete(keys.v1_result(self._state_key(repair.key)))

    def _rerun(self, repair: Rerun) -> None:
        """Name the next attempt on the gateway, then publish it: a late report of the old one is refused. A
        rollout that finished (or moved on, or is gone) since the listing keeps its attempt and nothing is
        published (``GatewayClient.supersede``)."""
        rid, old, new = repair.rollout.rollout_id, repair.attempt_id, repair.next_attempt_id
        if repair.handover:  # counted before the gateway moves on, so a crash in between cannot lose it
            counted = keys.v1_handovers(self.scope, rid)
            self.redis.sadd(counted, old)
            self.redis.expire(counted, int(self.settings.done_marker_ttl_s))
            log.info("[v1 rollout=%s] attempt %s was handed over by a draining worker: running it as %s", rid, old, new)
        else:
            log.warning("[v1 rollout=%s] the worker running attempt %s was lost: running it again as %s", rid, old, new)
        try:
            moved = self.gateway.supersede(rid, old, new)
            if moved is None:
                log.info("[v1 rollout=%s] not run again: the gateway no longer has it", rid)
        except GatewayConflict as exc:
            log.info("[v1 rollout=%s] not run again, nothing to re-run: %s", rid, exc)
            moved = None
        capacity.clear_inflight(self.redis, self.scope, self.queue, repair.key)
        if moved is not None:
            metrics.RERUNS.labels("handover" if repair.handover else "lost").inc()
            self._publish(repair.rollout, new)
        self.redis.delete(keys.v1_result(self._state_key(repair.key)))


def run_v1(settings: DispatcherSettings, stop: threading.Event, *, metrics_port: int | None = None) -> int:
    """The 1.0 dispatch loop until ``stop`` is set; /metrics on ``metrics_port`` (default ``BRIDGE_METRICS_PORT``)."""
    if not settings.agl_v1_url:
        raise MissingSetting(
            "AGL_V1_SERVER_URL (or --server) must name the Agent Lightning 1.0 gateway", setting="AGL_V1_SERVER_URL"
        )
    start_process(settings, metrics_port, log)
    gateway = GatewayClient(settings.agl_v1_url, key=settings.agl_v1_key)
    client = coordination_redis(settings)
    try:
        V1Dispatcher(settings, gateway, client, stop).run()
    finally:
        gateway.close()
        client.close()
    return 0
