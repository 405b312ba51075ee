"""Each task's dequeue-to-start time and outcome in the worker's Prometheus series (``workers.lifecycle.metrics``).

Behind Celery's ``task_prerun`` and ``task_postrun``, which the process that runs the task sends (a prefork child, or
the main process of a threads or solo worker), where no bootstep reaches. The step ``TaskMetrics`` connects them in
``create``, before the pool forks, so every child inherits the connections; they record whether or not the node
serves its series (``WORKER_METRICS_PORT``).
"""

from __future__ import annotations

import time
from typing import Any

from celery import bootsteps, signals

from bridge.core.gateway import V1_TASK_NAME
from bridge.core.task import TASK_NAME
from workers.lifecycle import metrics
from workers.lifecycle.steps.startup import NodeStartup
from workers.protocol import clock


class TaskMetrics(bootsteps.StartStopStep):
    """Hooks ``task_started`` and ``task_ended`` on Celery's task signals before the pool forks."""

    label = "task metrics"
    requires = (NodeStartup,)

    def create(self, w: Any) -> None:
        signals.task_prerun.connect(task_started, weak=False, dispatch_uid=__name__)
        signals.task_postrun.connect(task_ended, weak=False, dispatch_uid=__name__)


def task_started(sender: Any = None, task: Any = None, kwargs: Any = None, **_: Any) -> None:
    """A 0.3 task's first delivery starts: the time since the Store's dequeue (``DEQUEUE_TO_START``)."""
    if getattr(sender, "name", None) != TASK_NAME or not isinstance(kwargs, dict):
        return
    if getattr(getattr(task, "request", None), "retries", 0):
        return  # a Celery retry starts late on purpose; only first deliveries measure the dispatch path
    rollout = kwargs.get("rollout")
    attempt = rollout.get("attempt") if isinstance(rollout, dict) else None
    started = attempt.get("start_time") if isinstance(attempt, dict) else None
    if isinstance(started, (int, float)):
        started = clock.to_local(started)  # stamped by the Store's clock
    metrics.observe_start(kwargs.get("queue"), started, time.time())


def task_ended(sender: Any = None, retval: Any = None, state: str | None = None, **_: Any) -> None:
    """A task of either line ended other than by a Celery retry: its outcome (``ROLLOUTS``)."""
    if getattr(sender, "name", None) not in (TASK_NAME, V1_TASK_NAME) or state == "RETRY":
        return
    metrics.observe_outcome(retval)
