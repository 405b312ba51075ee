"""The Celery task that runs one Agent Lightning 1.0 attempt (``bridge.core.agl_v1.V1_TASK_NAME``); its task id
is the attempt's key, and the same workers serve it beside 0.3's ``workers.run_rollout``."""

from __future__ import annotations

from typing import Any

from celery import Task

from bridge.core.agl_v1 import V1_TASK_NAME, V1Rollout
from bridge.core.coordination import deployment_scope
from workers.app import app
from workers.resources import get_coordination
from workers.v1_attempt import V1Attempt


@app.task(name=V1_TASK_NAME, bind=True)
def run_v1_rollout(self: Task, rollout: dict[str, Any], attempt_id: str, queue: str) -> dict[str, Any]:
    """Run the rollout's agent program for ``attempt_id`` and report the outcome to the 1.0 gateway."""
    settings, client = get_coordination()  # no Store: a 1.0-only worker has none (docs/agl-v1.md)
    attempt = V1Attempt(
        V1Rollout.model_validate(rollout),
        attempt_id,
        settings=settings,
        client=client,
        scope=deployment_scope(settings),
        queue=queue,
    )
    return attempt.run().as_dict()
