"""The Celery application, configured for long, expensive, at-least-once tasks.

* ``acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only after the rollout
  finished, so a killed worker's rollout is redelivered instead of lost; the Redis lease in
  ``workers.lease`` makes that redelivery harmless.
* ``worker_prefetch_multiplier = 1``: a worker holds no more messages than it has free slots, so the
  bridge's slot count is what really runs.
* ``visibility_timeout`` above the hard time limit plus the longest queue wait (checked in settings),
  or Redis would hand a still-running rollout to a second worker.
"""

from __future__ import annotations

from celery import Celery

from bridge.settings import Settings, get_settings

TASK_NAME = "workers.run_rollout"


def create_app(settings: Settings) -> Celery:
    app = Celery("workers", broker=settings.broker_url, include=["workers.tasks", "workers.signals"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=settings.default_queue,
        task_create_missing_queues=True,
        broker_transport_options={"visibility_timeout": int(settings.visibility_timeout_s)},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_soft_time_limit=settings.soft_time_limit(None),
        task_time_limit=settings.hard_time_limit(None),
        worker_send_task_events=settings.task_events,  # for Flower; measurable CPU in the pool's parent
        task_send_sent_event=settings.task_events,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_pool_limit=64,
    )
    return app


app = create_app(get_settings())
