"""One rollout executed at once on the cluster, for ``CeleryRunner.step``.

Like Agent Lightning's own ``step``, it bypasses the Store's queue: once a live worker has a free slot on the
mode's queue (``wait_for_room``), it creates the rollout with an attempt claimed under the bridge's dispatcher
id and hands it to ``V03Dispatcher.dispatch``, so no loop has to run and a running bridge's reconcile repairs it
like any rollout it dequeued. Waits are bounded by the rollout's own budget. A retry (the rollout back in the
Store's queue) is awaited only while some dispatch loop holds the leader lock; with none, ``step`` raises
``RolloutFailedError`` with status ``requeuing`` at once. Contract: docs/agents.md section 2 (``step``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from bridge.core.coordination import capacity
from bridge.core.infra import PublishError
from bridge.core.settings import DispatcherSettings
from bridge.core.store import API, FINISHED_ROLLOUT, AttemptedRollout, Rollout, RolloutStatus, StoreClient
from bridge.core.task import clamp_to_broker, hard_time_limit
from bridge.dispatch.v03 import V03Dispatcher, fits

log = logging.getLogger(__name__)

WAIT_SLICE_S = 2.0  # one long-poll of /waits/rollouts
ROOM_POLL_S = 0.5  # polled, not woken: the slot-freed wake-ups belong to the dispatch loop
WAIT_MARGIN_S = 60.0  # beyond the rollout's own bound: the worker's final report and the Store's bookkeeping


class RolloutFailedError(RuntimeError):
    """A rollout ``CeleryRunner.step`` ran did not succeed.

    Carries what the worker reported in the attempt's metadata: ``error`` (its message) and
    ``failure_class`` (``agent``, ``llm``, ``timeout``, ... see docs/operations.md), with the ids and the
    final ``status`` (``failed`` or ``cancelled``).
    """

    def __init__(
        self, rollout_id: str, attempt_id: str | None, status: str, error: str | None, failure_class: str | None
    ) -> None:
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.status = status
        self.error = error
        self.failure_class = failure_class
        outcome = (
            "ended and was put back in the Store's queue; no dispatch loop runs to retry it (a `python -m bridge` "
            "or CeleryRunner.iter started later will)"
            if status == RolloutStatus.REQUEUING
            else f"ended {status}"
        )
        super().__init__(
            f"rollout {rollout_id} (attempt {attempt_id}) {outcome}"
            f" [failure_class={failure_class or 'unknown'}]: {error or 'no error reported'}"
        )


def add_resources(store: StoreClient, resources: dict[str, Any]) -> str:
    """Publish named resources (JSON-ready) as the Store's latest; returns their id."""
    data = store.request("POST", API + "/resources", json=resources).json()
    return str(data["resources_id"])


def start_rollout(
    store: StoreClient, settings: DispatcherSettings, task: Any, *, mode: str | None, resources_id: str | None
) -> AttemptedRollout:
    """Create the rollout with an attempt already claimed by the bridge's dispatcher id.

    Never retried blindly: a lost answer would have created a rollout, and a retry would create another.
    """
    body = {"input": task, "mode": mode, "resources_id": resources_id, "worker_id": settings.dispatcher_id}
    data = store.request("POST", API + "/rollouts", json=body, retries=0).json()
    return AttemptedRollout.model_validate(data)


def wait_for_room(dispatcher: V03Dispatcher, mode: str | None) -> None:
    """Block until a live worker has a free slot on the queue ``mode`` routes to.

    ScopeMismatchError within seconds when this Store's workers serve the queues only under another spelling
    of its URL (``bridge.core.coordination.scope_check``). TimeoutError when no worker consumes that queue for
    ``BRIDGE_MAX_QUEUE_WAIT_S``, or when it stays full
    for that plus one attempt's hard time limit (every busy slot should have freed by then). An unreachable
    Redis counts as no room: the wait goes on, within the same bound.
    """
    settings = dispatcher.settings
    queue = settings.queue_for_mode(mode)
    busy_bound = settings.max_queue_wait_s + hard_time_limit(settings, None)
    started = time.monotonic()
    said = False
    while True:
        served: set[str] = set()
        try:
            view = capacity.read_slots(dispatcher.redis, dispatcher.scope, dispatcher.queues)
            served = view.served()
            if fits(queue, view.rooms(), served):
                return
            dispatcher.scope_watch.check(served)  # ScopeMismatchError: our workers under another URL spelling
        except redis.RedisError as exc:
            log.warning("step: could not read the free slots (%r); waiting", exc)
        waited = time.monotonic() - started
        if queue not in served and waited > settings.max_queue_wait_s:
            raise TimeoutError(
                f"step: no live worker consumed queue {queue!r} (mode {mode!r}) for {waited:.0f}s; "
                "start one with `celery -A workers worker -Q " + queue + "` or route the mode elsewhere (QUEUE_BY_MODE)"
            )
        if waited > busy_bound:
            raise TimeoutError(f"step: queue {queue!r} had no free slot for {waited:.0f}s")
        if not said:
            said = True
            log.info("step: queue %s has no free slot on a live worker; waiting for one", queue)
        time.sleep(ROOM_POLL_S)


def publish(dispatcher: V03Dispatcher, rollout: AttemptedRollout) -> None:
    """Hand the rollout to the broker exactly as the dispatch loop does; raise when the broker refused it.

    A refused rollout was handed back to the Store queue, where a running dispatch loop picks it up.
    """
    if not dispatcher.dispatch(rollout):
        raise PublishError(
            f"the broker did not take rollout {rollout.rollout_id}; it was handed back to the Store queue"
        )


def wait_finished(
    store: StoreClient, settings: DispatcherSettings, rollout: AttemptedRollout, dispatching: Callable[[], bool]
) -> Rollout:
    """Block until the rollout is succeeded, failed or cancelled, or back in the queue with no dispatch loop
    (``dispatching()`` false) to retry it; TimeoutError past its own bound."""
    per_attempt = hard_time_limit(settings, clamp_to_broker(settings, rollout.config.timeout_seconds))
    bound = (per_attempt + settings.max_queue_wait_s) * rollout.config.max_attempts  # the Store keeps it >= 1
    deadline = time.monotonic() + bound + WAIT_MARGIN_S
    while True:
        done = store.wait_rollouts([rollout.rollout_id], timeout_s=WAIT_SLICE_S)
        if done and done[0].status in FINISHED_ROLLOUT:
            return done[0]
        current = store.get_rollout(rollout.rollout_id)
        if current.status in FINISHED_ROLLOUT:
            return current
        if current.status == RolloutStatus.REQUEUING and not dispatching():
            return current
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rollout {rollout.rollout_id} did not finish within {bound:.0f}s: "
                "is a worker consuming its queue, and is AGENT the same on the workers?"
            )
        if not done:
            time.sleep(0.2)  # a Store that answers at once (timeout not honoured) is not spun on


def failure(store: StoreClient, rollout: Rollout) -> RolloutFailedError:
    """The error to raise for a rollout that did not succeed, from its latest attempt's metadata."""
    attempts = store.list_attempts(rollout.rollout_id)
    latest = max(attempts, key=lambda a: a.sequence_id) if attempts else None
    meta = (latest.metadata if latest else None) or {}
    error = meta.get("error")
    failure_class = meta.get("failure_class")
    return RolloutFailedError(
        rollout.rollout_id,
        latest.attempt_id if latest else None,
        str(rollout.status),
        str(error) if error is not None else None,
        str(failure_class) if failure_class is not None else None,
    )
