"""The Celery application, configured for long, expensive, at-least-once tasks.

* ``acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only after the rollout
  finished, so a killed worker's rollout is redelivered instead of lost; the Redis lease in
  ``workers.protocol.lease`` makes that redelivery harmless.
* ``worker_prefetch_multiplier = 1``: a worker holds no more messages than it has free slots, so the
  bridge's slot count is what really runs.
* ``visibility_timeout`` above the hard time limit plus the longest queue wait (checked in settings),
  or Redis would hand a still-running rollout to a second worker.
* the node's lifecycle (start-up, 1.0 program server, metrics exporter, slot adverts, expired messages' hand-back,
  drain) as worker bootsteps, one per concern (``workers.lifecycle.steps``).
* under ``-P threads``, two corrections of Celery's internals (``bridge.core.patches``): task events that
  reach Flower, and a consumer loop woken when a task finishes.
"""

from __future__ import annotations

from celery import Celery

from bridge.core.patches import celery_task_events as events
from bridge.core.patches.celery_loop_wake import LoopWaker
from bridge.core.settings import WorkerSettings, get_settings
from bridge.core.task import base_app, hard_time_limit, soft_time_limit
from workers.lifecycle.steps import STARTUP, WORKER_STEPS

__all__ = ["app", "create_app"]


def create_app(settings: WorkerSettings) -> Celery:
    app = base_app(settings, "workers", include=("workers.tasks", "workers.v1.task", STARTUP))
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_connection_max_retries=None,
        task_soft_time_limit=soft_time_limit(settings, None),
        task_time_limit=hard_time_limit(settings, None),
        worker_send_task_events=settings.task_events,  # for Flower's task list
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    events.install(app)
    app.steps["consumer"].add(LoopWaker)
    app.steps["worker"].update(WORKER_STEPS)  # the node's lifecycle, one step per concern
    return app


app = create_app(get_settings())
