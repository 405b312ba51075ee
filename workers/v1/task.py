"""The Celery task that runs one Agent Lightning 1.0 attempt (``bridge.core.gateway.V1_TASK_NAME``); its task id
is the attempt's key, and the same workers serve it beside 0.3's ``workers.run_rollout``."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import Reject

from bridge.core.coordination import deployment_scope
from bridge.core.gateway import V1_TASK_NAME, V1Rollout
from workers.app import app
from workers.lifecycle.resources import get_coordination, get_monitor
from workers.protocol import held as protocol
from workers.protocol import unserved
from workers.v1.attempt import V1Attempt

log = logging.getLogger("workers.v1")


@app.task(name=V1_TASK_NAME, bind=True)
def run_v1_rollout(self: Task, rollout: dict[str, Any], attempt_id: str, queue: str) -> dict[str, Any]:
    """Run the rollout's agent program for ``attempt_id`` and report the outcome to the 1.0 gateway; on a node
    that drains, or one without a gateway (``workers.protocol.unserved``), hand the message back to the broker
    unstarted (as the 0.3 task does)."""
    settings, client = get_coordination()  # no Store: a 1.0-only worker has none (docs/agl-v1.md)
    if not settings.agl_v1_url:  # a 0.3-only worker: back to the broker for one with a gateway
        raise unserved.hand_back("1.0", str(self.request.id), "AGL_V1_SERVER_URL")
    scope = deployment_scope(settings)
    if protocol.draining(client, scope, self.request.hostname):
        log.warning("task %s: this worker drains; the message goes back to the broker", self.request.id)
        raise Reject("the worker drains (WORKER_SHUTDOWN_GRACE_S)", requeue=True)
    attempt = V1Attempt(
        V1Rollout.model_validate(rollout),
        attempt_id,
        settings=settings,
        client=client,
        scope=scope,
        queue=queue,
        monitor=get_monitor(),
    )
    return attempt.run().as_dict()
