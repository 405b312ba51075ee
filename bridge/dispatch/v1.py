"""``python -m bridge v1``: Agent Lightning 1.0 rollouts on the Celery cluster, as a runner type beside 1.0's
``local`` and ``k8s`` (docs/agl-v1.md).

Each tick, as leader: as many ``queuing`` rollouts as the workers have free slots are published as
``workers.run_v1_rollout`` (task id ``attempt_key``), recorded in flight in the same accounting the 0.3 bridge
uses, and marked ``running``. Each reconcile, for every ``running`` rollout's current attempt: an outcome kept in
Redis is applied; a live lease is left alone; a message that never started within the queue wait is published
again under the same id; an attempt that started and lost its executor is run again under the next attempt id
(``AGL_V1_MAX_RERUNS`` times), else failed. Every step is safe to repeat, so a dispatcher killed anywhere is
restarted (or replaced by a standby) without running a rollout twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

from bridge.core import capacity, keys, slot_share
from bridge.core.agl_v1 import (
    FIRST_ATTEMPT,
    V1_TASK_NAME,
    GatewayClient,
    GatewayConflict,
    GatewayError,
    V1Rollout,
    V1State,
    attempt_key,
    next_attempt,
)
from bridge.core.coordination import coordination_redis, deployment_scope
from bridge.core.errors import MissingSetting
from bridge.core.logs import configure_logging
from bridge.core.message import base_app
from bridge.core.redact import redact_url
from bridge.core.settings import Settings
from bridge.dispatch.leader import STANDBY_RETRY_S, LeaderLock

log = logging.getLogger("bridge.v1")

IDLE_POLL_S = 1.0  # between gateway reads while nothing is queuing or no slot is free
BUSY_POLL_S = 0.2  # after a tick that published
ERROR_WAIT_S = 5.0


class V1Dispatcher:
    def __init__(self, settings: Settings, gateway: GatewayClient, client: redis.Redis, stop: threading.Event) -> None:
        self.settings, self.gateway, self.redis, self.stop = settings, gateway, client, stop
        self.queue = settings.default_queue
        self.scope = deployment_scope(settings)  # the workers' slots: the same cluster as the 0.3 bridge
        self.app = base_app(settings, "bridge-v1")
        self._lock = LeaderLock(client, f"{settings.dispatcher_id}-v1", scope=f"{self.scope}:v1")
        self.confirm_s = 2 * settings.heartbeat_interval_s + 5.0  # as the 0.3 bridge's reconcile
        self._next_reconcile = 0.0
        self._suspects: dict[str, float] = {}  # attempt key -> when first seen started, unleased, unfinished

    def run(self) -> None:
        log.info(
            "1.0 dispatcher %s: gateway %s, queue %s (Redis key scope %s)",
            self.settings.dispatcher_id,
            redact_url(self.gateway.base_url),
            self.queue,
            self.scope,
        )
        try:
            while not self.stop.is_set():
                try:
                    wait = self.tick()
                except (GatewayError, redis.RedisError) as exc:
                    log.warning("%s; retrying in %.0fs", exc, ERROR_WAIT_S)
                    wait = ERROR_WAIT_S
                except Exception:
                    log.exception("unexpected error in the 1.0 dispatch loop; going on in %.0fs", ERROR_WAIT_S)
                    wait = ERROR_WAIT_S
                self.stop.wait(wait)
        finally:
            self._lock.release()
            self.app.close()
        log.info("1.0 dispatcher stopped")

    def tick(self) -> float:
        """One round; returns how long to wait before the next."""
        leading, newly = self._lock.ensure()
        if not leading:
            return STANDBY_RETRY_S
        if newly or time.monotonic() >= self._next_reconcile:
            self.reconcile()
            self._next_reconcile = time.monotonic() + self.settings.reconcile_interval_s
        view = capacity.read_slots(self.redis, self.scope, self.settings.all_queues())
        total = view.totals().get(self.queue, 0)
        if self.queue not in view.served() or total < 1:
            return IDLE_POLL_S
        # Up to every slot's worth of queuing rollouts, so the 0.3 bridge beside it sees this line's demand.
        queuing = self.gateway.list_rollouts(V1State.QUEUING, limit=total)
        room = slot_share.claimable(
            self.redis,
            self.scope,
            self.queue,
            slot_share.V1,
            total=total,
            room=view.rooms()[self.queue],
            waiting=len(queuing),
            weights=self.settings.slot_share_weights,
        )
        for rollout in queuing[:room]:
            if not self._lock.valid():  # the fence: leadership lapsed while this tick ran
                return STANDBY_RETRY_S
            self._start(rollout)
        if room < len(queuing):  # work waits for a slot: look again as soon as one frees
            capacity.wait_for_freed(self.redis, self.scope, [self.queue], IDLE_POLL_S)
            return 0.0
        return BUSY_POLL_S if queuing else IDLE_POLL_S

    # --- one rollout ---------------------------------------------------------------------------

    def _start(self, rollout: V1Rollout) -> None:
        """Publish a queuing rollout's first attempt and mark it running."""
        local = rollout.config.local
        if local is None or not local.agent_class:
            self._fail(rollout.rollout_id, FIRST_ATTEMPT, "invalid rollout config: missing config.local.agent_class")
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
        key = attempt_key(rollout.rollout_id, attempt_id)
        timeout = rollout.config.timeout_seconds
        capacity.mark_inflight(self.redis, self.scope, self.queue, key)
        try:
            self.app.send_task(
                V1_TASK_NAME,
                kwargs={"rollout": rollout.model_dump(mode="json"), "attempt_id": attempt_id, "queue": self.queue},
                task_id=key,
                queue=self.queue,
                # Above the worker's own deadline: it kills the program at timeout_seconds and then reports.
                soft_time_limit=timeout + self.settings.lease_ttl_s + 30,
                time_limit=timeout + self.settings.lease_ttl_s + 60,
                argsrepr="()",
                kwargsrepr=f"v1 rollout={rollout.rollout_id} attempt={attempt_id}",
            )
        except Exception as exc:  # the broker refused it: the rollout stays as it is and is tried again
            capacity.clear_inflight(self.redis, self.scope, self.queue, key)
            log.warning("[v1 rollout=%s] the broker did not take it (%r); retried later", rollout.rollout_id, exc)
            return False
        log.info("[v1 rollout=%s attempt=%s] published to %s", rollout.rollout_id, attempt_id, self.queue)
        return True

    def _fail(self, rollout_id: str, attempt_id: str, why: str) -> None:
        if self.gateway.finish(rollout_id, attempt_id, V1State.FAILED, why):
            log.warning("[v1 rollout=%s attempt=%s] failed: %s", rollout_id, attempt_id, why)
        else:
            log.info("[v1 rollout=%s attempt=%s] not failed (moved on): %s", rollout_id, attempt_id, why)

    # --- repairs -------------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Repair what a lost message, a lost worker or a dispatcher killed mid-step left (module docstring)."""
        now = time.time()
        inflight = capacity.inflight_entries(self.redis, self.scope, self.queue)
        running = {
            attempt_key(r.rollout_id, r.status.last_attempt_id or FIRST_ATTEMPT): r
            for r in self.gateway.list_rollouts(V1State.RUNNING, limit=100_000)
        }
        ours = set(running) | {key for key in inflight if key.startswith("v1-")}
        facts = capacity.executions(self.redis, ours)  # leases, started and done markers: one round trip
        kept = dict(zip(running, self.redis.mget([keys.v1_result(k) for k in running]), strict=True)) if running else {}
        for key, rollout in running.items():
            self._repair(rollout, key, facts[key], kept[key], inflight.get(key), now)
        for key in ours - set(running):  # slots held by v1 attempts no running rollout waits for
            if now - inflight[key] > self.settings.max_queue_wait_s and not facts[key].leased:
                capacity.clear_inflight(self.redis, self.scope, self.queue, key)
                capacity.notify_freed(self.redis, self.scope, self.queue)
        self._suspects = {k: v for k, v in self._suspects.items() if k in running}

    def _repair(
        self,
        rollout: V1Rollout,
        key: str,
        fact: capacity.Execution,
        kept: str | None,
        published: float | None,
        now: float,
    ) -> None:
        rid, attempt_id = rollout.rollout_id, rollout.status.last_attempt_id or FIRST_ATTEMPT
        if kept is not None:
            self._apply(rollout, attempt_id, key, kept)
            return
        if fact.leased or fact.done:
            self._suspects.pop(key, None)
            return
        if not fact.started:
            if published is not None and now - published < self.settings.max_queue_wait_s + self.confirm_s:
                return  # waiting in the broker for a worker
            log.warning("[v1 rollout=%s attempt=%s] its message never started: publishing it again", rid, attempt_id)
            self._publish(rollout, attempt_id)
            return
        first = self._suspects.setdefault(key, now)
        if now - first < self.confirm_s:
            return
        self._suspects.pop(key, None)
        capacity.clear_inflight(self.redis, self.scope, self.queue, key)
        if int(attempt_id) < self.settings.agl_v1_max_reruns:
            retry = next_attempt(attempt_id)
            log.warning(
                "[v1 rollout=%s] the worker running attempt %s was lost: running it again as %s", rid, attempt_id, retry
            )
            try:
                self.gateway.patch_status(rid, last_attempt_id=retry)
            except GatewayConflict as exc:
                log.info("[v1 rollout=%s] not run again: %s", rid, exc)
                return
            self._publish(rollout, retry)
            return
        self._fail(
            rid,
            attempt_id,
            f"the worker running attempt {attempt_id} was lost "
            f"(AGL_V1_MAX_RERUNS={self.settings.agl_v1_max_reruns} re-runs used)",
        )

    def _apply(self, rollout: V1Rollout, attempt_id: str, key: str, kept: str) -> None:
        """An outcome the worker could not send: set it now (current attempt only), then drop it."""
        data: dict[str, Any] = json.loads(kept)
        state, detail = V1State(data["state"]), str(data.get("detail", ""))
        if not self.gateway.finish(rollout.rollout_id, attempt_id, state, detail):
            log.info("[v1 rollout=%s attempt=%s] kept outcome not applied: moved on", rollout.rollout_id, attempt_id)
        self.redis.delete(keys.v1_result(key))


def run_v1(settings: Settings, stop: threading.Event) -> int:
    """The 1.0 dispatch loop until ``stop`` is set."""
    if not settings.agl_v1_url:
        raise MissingSetting(
            "AGL_V1_SERVER_URL (or --server) must name the Agent Lightning 1.0 gateway", setting="AGL_V1_SERVER_URL"
        )
    configure_logging(settings.log_level, settings.log_json)
    gateway = GatewayClient(settings.agl_v1_url, key=settings.agl_v1_key)
    client = coordination_redis(settings)
    try:
        V1Dispatcher(settings, gateway, client, stop).run()
    finally:
        gateway.close()
        client.close()
    return 0
