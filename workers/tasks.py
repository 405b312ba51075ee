"""The Celery task: one message = one Store attempt; the task id *is* the attempt id."""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Task
from celery.exceptions import Reject

from bridge.core.coordination import deployment_scope
from bridge.core.infra import DuplicateDelivery, backoff_delay
from bridge.core.settings import get_settings
from bridge.core.task import TASK_NAME, Outcome, OutcomeStatus
from workers.app import app
from workers.execution import Delivery, is_retryable_before_progress
from workers.lifecycle.resources import get_resources
from workers.protocol import held as protocol
from workers.protocol import unserved

log = logging.getLogger("workers.tasks")

MAX_INFRA_RETRIES = 5


@app.task(name=TASK_NAME, bind=True, max_retries=MAX_INFRA_RETRIES)
def run_rollout(
    self: Task, rollout: dict[str, Any], queue: str | None = None, agent: str | None = None
) -> dict[str, Any]:
    """Run this worker's agent (``AGENT``) for one dequeued rollout and report it to the Store.

    ``agent`` names the agent the sender expects (absent: ``webshop``, ``bridge.core.task.message.DEFAULT_AGENT``);
    it is only compared with this worker's configuration, never imported.
    """
    task_id = str(self.request.id)
    settings = get_settings()
    if settings.store_url is None:  # a 1.0-only worker: back to the broker for one with a Store
        raise unserved.hand_back("0.3", task_id, "AGENT_LIGHTNING_STORE_URL")
    res = get_resources()
    if _draining(res.redis, deployment_scope(res.settings), self.request.hostname):
        # Reserved, never started: back to the broker for another node (its in-flight entry stays, as it is
        # still the bridge's published attempt), instead of starting an episode the drain would stop.
        log.warning("task %s: this worker drains; the message goes back to the broker", task_id)
        raise Reject("the worker drains (WORKER_SHUTDOWN_GRACE_S)", requeue=True)
    final = True
    slot = (deployment_scope(res.settings), queue or res.settings.default_queue)
    delivery = Delivery(rollout, celery_task_id=task_id, expected_agent=agent, res=res, slot=slot)
    try:
        return delivery.execute().as_dict()
    except DuplicateDelivery as exc:
        final = False  # the slot belongs to the executor holding the lease
        if self.request.retries < MAX_INFRA_RETRIES:
            log.warning("task %s: %s; re-checking in %.0fs", task_id, exc, exc.retry_in_s + 1.0)
            raise self.retry(exc=exc, countdown=exc.retry_in_s + 1.0) from exc
        log.warning("task %s: %s; duplicate delivery dropped", task_id, exc)
        return Outcome(OutcomeStatus.SKIPPED, f"duplicate delivery: {exc}").as_dict()
    except Exception as exc:
        # Broker/Store outages before the episode made progress: a Celery retry with backoff, same task id.
        if is_retryable_before_progress(exc) and self.request.retries < MAX_INFRA_RETRIES:
            final = False
            countdown = backoff_delay(self.request.retries, base_s=2.0, cap_s=60.0)
            log.warning("task %s: infrastructure error before start (%s); retry in %.0fs", task_id, exc, countdown)
            raise self.retry(exc=exc, countdown=countdown) from exc
        raise
    finally:
        if final:  # after the attempt released its lease (``Delivery.execute``)
            delivery.release_slot(*slot)


def _draining(client: redis.Redis, scope: str, node: str | None) -> bool:
    """Whether this node is draining (``workers.protocol.held.draining``, shared with the 1.0 task)."""
    return protocol.draining(client, scope, node)
