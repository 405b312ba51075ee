"""The attempt protocol both lines share: what makes one delivery of an attempt safe to run on this worker,
whatever runs the episode (0.3's ``workers.execution``, 1.0's ``workers.v1.attempt``); both hold their attempt here.

* ``draining``: a node that drains (``WORKER_SHUTDOWN_GRACE_S``) starts nothing new; the task hands the message
  back to the broker.
* ``HeldAttempt``: the owner/epoch lease of ``workers.protocol.lease``, renewed by the process's heartbeat monitor
  (``workers.protocol.heartbeat``) in a thread of its own, so no read of the Store or the gateway, however slow, lets it
  lapse; the monitor also stops the attempt at the node's drain. The watch is the protocol's own (lease and drain,
  registered at the claim: 1.0) or one the line built and registers with ``follow`` (0.3's Store-fenced watch with
  the attempt's telemetry). A line whose agent runs on the attempt's own thread (0.3) registers its hand-over with
  ``hand_over_at_drain``: the drain then hands the attempt over, releases the lease and frees the slot even when the
  agent never returns (1.0's program runs in a process of its own, which the attempt's thread kills at the stop).
  ``keep`` writes the kept outcome (``bridge.core.task.outcome.Outcome``, a drain's hand-over included) and the done
  marker in one transaction (1.0; 0.3 keeps its Store report in
  ``workers.protocol.reporting``); ``release`` stops the renewals and drops the lease;
  ``release_slot`` frees the slot; ``close`` does both (1.0; 0.3's task frees the slot itself, as only it knows
  whether Celery retries the message).
* ``release_slot``: free the attempt's in-flight entry unless another executor holds it, and wake the bridge.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import redis

from bridge.core.coordination import capacity, keys
from bridge.core.settings import get_settings
from bridge.core.task import Outcome
from workers.lifecycle import state
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Claim, Lease, free_slot

log = logging.getLogger("workers.protocol.held")


def draining(client: redis.Redis, scope: str, node: str | None) -> bool:
    """Whether this node is draining under ``WORKER_SHUTDOWN_GRACE_S`` (``workers.lifecycle.drain``); records the
    node's name for this process's heartbeat, which reads the node's stop time by it."""
    if get_settings().worker_shutdown_grace_s is None:
        return False
    clock = state.process.drain_clock
    if clock.node is None and node:
        clock.node, clock.incarnation = node, state.node.incarnation
    return clock.refresh(client, scope, time.time())


def release_slot(
    client: redis.Redis, scope: str, queue: str, attempt_id: str, token: str | None, *, lease_id: str | None = None
) -> None:
    """Free the attempt's slot in its deployment's (``scope``) in-flight set, unless another executor holds the
    attempt right now, and wake that deployment's bridge.

    The in-flight entry is keyed by attempt id (the task id) and shared by every delivery of it: a duplicate that
    was skipped, or an executor that was taken over, must not free the slot of the live execution (the bridge
    would then claim one rollout more than the workers can run). ``token`` is ours if we held the lease;
    ``lease_id`` names the lease when it is not kept under the task id (a 1.0 attempt's scoped key).
    """
    try:
        if free_slot(client, scope, queue, attempt_id, token, lease_id=lease_id):
            capacity.notify_freed(client, scope, queue)
    except redis.RedisError as exc:
        log.warning("could not clear in-flight entry %s (the bridge prunes it later): %r", attempt_id, exc)


class HeldAttempt:
    """One delivery's hold on an attempt: its lease (under ``lease_id``), renewed by ``monitor`` while watched.

    Order of use: ``claim``; ``follow`` (a line's own watch, when the claim registered none); ``keep`` (1.0);
    ``release`` once the final report is out, then ``release_slot`` (or ``close`` for both). Renewals stop before the
    lease is dropped, and a dropped lease stays dropped (``Lease.release``).
    """

    def __init__(
        self,
        client: redis.Redis,
        monitor: HeartbeatMonitor,
        lease_id: str,
        *,
        rollout_id: str,
        ttl_s: float,
        interval_s: float,
    ) -> None:
        self.redis, self.monitor, self.lease_id = client, monitor, lease_id
        self.lease = Lease(client, lease_id, ttl_s)
        # The protocol's own watch: lease renewals and the node's drain, no Store (``follow`` replaces it).
        self.watch = AttemptWatch(rollout_id, lease_id, self.lease, None, interval_s, math.inf, store_fenced=False)
        self.held = False

    def claim(self, started_ttl_s: float, *, renew: bool = True) -> Claim:
        """Take the lease (``Lease.claim``: ``done_status`` when the attempt was finished already, ``first_start``
        unless another executor started it before) and, once taken, ``start_renewing`` (with ``renew`` False the
        line calls it itself, where a failure to start the monitor is its to report)."""
        claim = self.lease.claim(started_ttl_s)
        if claim.acquired:
            self.held = True
            if renew:
                self.start_renewing()
        return claim

    def start_renewing(self) -> None:
        """Have the monitor renew the held lease through the protocol's own watch, or the one the line gives
        ``follow``, until ``release``: no read the line makes, however slow, lets it lapse."""
        self.monitor.watch(self.watch)

    def follow(self, watch: AttemptWatch) -> None:
        """Register ``watch``, built by the line on this attempt's lease, with the monitor in place of the protocol's
        own watch: from now on it renews the lease, carries the stop reasons and is the one ``keep`` and ``release``
        act on. Raises ``RuntimeError`` unless the lease is held (a watch nobody holds would renew a lease nobody
        runs) and ``ValueError`` for a watch on another lease."""
        if not self.held:
            raise RuntimeError(f"no lease held on {self.lease_id}: claim it before watching it")
        if watch.lease is not self.lease:
            raise ValueError(f"the watch of {watch.attempt_id} renews another lease than {self.lease_id}'s")
        previous = self.watch
        self.monitor.watch(watch)
        self.watch = watch
        if previous is not watch:
            self.monitor.unwatch(previous)

    def hand_over_at_drain(self, hand_over: Callable[[], object], *, slot: tuple[str, str, str] | None) -> None:
        """Have the drain hand the attempt over in its thread's place when that thread has begun neither its report
        nor its hand-over ``drain.HAND_OVER_AFTER_S`` after the stop (``HeartbeatMonitor.stop_for_drain``): an agent
        that swallows the stop and the interrupt keeps it from ever getting there, and the process's forced exit at the
        end of the grace would leave the attempt leased and unreported for the slow path (lease expiry, reconcile).

        On a thread of its own: claim the hand-over (``AttemptWatch.take_hand_over``; the thread reports nothing after
        that), send none of the attempt's spans from then on (a batch in flight lands first), run ``hand_over`` (the
        line's, shared with its thread through ``AttemptWatch.hand_over_once``), then ``release`` the lease and free the
        in-flight entry ``slot`` (scope, queue, entry) when given. Registered on the watch that runs (after
        ``follow``)."""
        watch = self.watch

        def in_place() -> None:
            if not watch.take_hand_over():
                return  # the attempt's thread began its report or its hand-over: it finishes what it began
            try:
                if watch.telemetry is not None:
                    watch.telemetry.seal()
                watch.hand_over_once(hand_over)
            except Exception:  # what the hand-over could not do is left to the slow path; the lease goes regardless
                log.exception("attempt %s: the hand-over in the stopped agent's place failed", watch.attempt_id)
            finally:
                self.release()
                if slot is not None:
                    self.release_slot(*slot)

        watch.in_place = in_place

    def unwatch(self) -> None:
        """Stop the renewals and the monitor's checks (safe to repeat): the lease lapses unless released first."""
        self.monitor.unwatch(self.watch)

    @property
    def stop_reason(self) -> str | None:
        """Why the attempt must stop now (the lease lost or reported by another executor, the node's drain)."""
        return self.watch.stop_reason

    @property
    def shutdown(self) -> bool:
        """Stopped by the node's drain: to be handed over, never reported failed."""
        return self.watch.shutdown

    def keep(self, result: Outcome, *, result_key: str, result_ttl_s: float, done_ttl_s: float) -> None:
        """Keep ``result`` under ``result_key`` and mark the attempt done, in one transaction: from here on a
        redelivery is dropped and the kept result is what counts. Renewals stop flagging the done marker."""
        self.watch.reporting = True
        done = "handover" if result.handover else (result.state or "skipped")
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(result_key, result.to_json(), ex=max(1, int(result_ttl_s)))
        pipe.set(keys.done(self.lease_id), done, ex=max(1, int(done_ttl_s)))
        pipe.execute()

    def release(self) -> None:
        """Stop renewing, then drop the lease if ours (never another executor's); a Redis error only logs it, the
        lease then expires."""
        self.unwatch()
        if self.held:
            try:
                self.lease.release()
            except redis.RedisError as exc:
                log.warning("could not release the lease of %s (it expires): %r", self.lease_id, exc)

    def release_slot(self, scope: str, queue: str, inflight_id: str) -> None:
        """Free the slot ``inflight_id`` holds (``release_slot``), unless another executor holds the attempt: a
        duplicate delivery frees the slot of a finished attempt, never of a live one."""
        token = self.lease.token if self.held else None
        release_slot(self.redis, scope, queue, inflight_id, token, lease_id=self.lease_id)

    def close(self, scope: str, queue: str, inflight_id: str) -> None:
        """``release``, then ``release_slot``: the end of a delivery whose slot no retry of the message needs."""
        self.release()
        self.release_slot(scope, queue, inflight_id)
