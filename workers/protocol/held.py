"""The attempt protocol both lines share: what makes one delivery of an attempt safe to run on this worker,
whatever runs the episode (0.3's ``workers.execution``, 1.0's ``workers.v1.attempt``).

* ``draining``: a node that drains (``WORKER_SHUTDOWN_GRACE_S``) starts nothing new; the task hands the message
  back to the broker.
* ``HeldAttempt``: the owner/epoch lease of ``workers.protocol.lease``, renewed by the process's heartbeat monitor
  (``workers.protocol.heartbeat``) in a thread of its own, so no read of the Store or the gateway, however slow, lets it
  lapse; the monitor also stops the attempt at the node's drain. ``keep`` writes the kept result and the done
  marker in one transaction; ``close`` stops the renewals, drops the lease and frees the slot.
* ``KeptResult``: the record a 1.0 attempt keeps for its dispatcher (``keys.v1_result``), including the drain's
  hand-over (``state`` None, ``handover`` true, class ``shutdown``).
* ``release_slot``: free the attempt's in-flight entry unless another executor holds it, and wake the bridge.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import redis

from bridge.core import capacity, keys
from bridge.core.settings import get_settings
from workers.lifecycle import drain
from workers.protocol.failures import FailureClass
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Claim, Lease, free_slot

log = logging.getLogger("workers.protocol.held")


def draining(client: redis.Redis, scope: str, node: str | None) -> bool:
    """Whether this node is draining under ``WORKER_SHUTDOWN_GRACE_S`` (``workers.lifecycle.drain``); records the
    node's name for this process's heartbeat, which reads the node's stop time by it."""
    if get_settings().worker_shutdown_grace_s is None:
        return False
    if drain.clock.node is None and node:
        drain.clock.node = node
    return drain.clock.refresh(client, scope, time.time())


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


@dataclass(frozen=True)
class KeptResult:
    """An attempt's outcome kept in Redis until the trainer's side has it: JSON ``{"state", "detail",
    "failure_class", "handover"}``. ``state`` None with ``handover`` true: the worker drained and handed the
    attempt over, to run again elsewhere without counting as a failure."""

    state: str | None
    detail: str
    failure_class: FailureClass | None = None
    handover: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "state": self.state,
                "detail": self.detail,
                "failure_class": None if self.failure_class is None else str(self.failure_class),
                "handover": self.handover,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> KeptResult:
        data: dict[str, Any] = json.loads(raw)
        failure = data.get("failure_class")
        return cls(
            data.get("state"),
            str(data.get("detail", "")),
            FailureClass(failure) if failure else None,
            bool(data.get("handover", False)),
        )


class HeldAttempt:
    """One delivery's hold on an attempt: its lease (under ``lease_id``), renewed by ``monitor`` while held."""

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
        self.watch = AttemptWatch(rollout_id, lease_id, self.lease, None, interval_s, math.inf, store_fenced=False)
        self.held = False

    def claim(self, started_ttl_s: float) -> Claim:
        """Take the lease (``Lease.claim``); once taken, the monitor renews it until ``close``."""
        claim = self.lease.claim(started_ttl_s)
        if claim.acquired:
            self.held = True
            self.monitor.watch(self.watch)
        return claim

    @property
    def stop_reason(self) -> str | None:
        """Why the attempt must stop now (the lease lost or reported by another executor, the node's drain)."""
        return self.watch.stop_reason

    @property
    def shutdown(self) -> bool:
        """Stopped by the node's drain: to be handed over, never reported failed."""
        return self.watch.shutdown

    def keep(self, result: KeptResult, *, result_key: str, result_ttl_s: float, done_ttl_s: float) -> None:
        """Keep ``result`` under ``result_key`` and mark the attempt done, in one transaction: from here on a
        redelivery is dropped and the kept result is what counts. Renewals stop flagging the done marker."""
        self.watch.reporting = True
        done = "handover" if result.handover else (result.state or "skipped")
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(result_key, result.to_json(), ex=max(1, int(result_ttl_s)))
        pipe.set(keys.done(self.lease_id), done, ex=max(1, int(done_ttl_s)))
        pipe.execute()

    def close(self, scope: str, queue: str, inflight_id: str) -> None:
        """Stop renewing, drop the lease (if ours) and free the slot ``inflight_id`` holds, unless another executor
        holds the attempt (a duplicate delivery frees the slot of a finished attempt, never of a live one)."""
        self.monitor.unwatch(self.watch)
        if self.held:
            try:
                self.lease.release()
            except redis.RedisError as exc:
                log.warning("could not release the lease of %s (it expires): %r", self.lease_id, exc)
        token = self.lease.token if self.held else None
        release_slot(self.redis, scope, queue, inflight_id, token, lease_id=self.lease_id)
