"""Publishing one attempt as a Celery task, by name, for either line: the one publisher.

A line builds the ``Task`` (its name, arguments, task id, queue, time limits and expiry); ``Publisher.send`` puts it
in the broker with the client's bounded retries (``BRIDGE_PUBLISH_RETRIES``) and raises PublishError when the broker
did not take it. The task id is the attempt id (the idempotency key end to end); ``describe`` is what Flower shows,
never a secret. A message must end (hard limit) before the broker redelivers it (``BROKER_VISIBILITY_TIMEOUT_S``,
RabbitMQ: ``BROKER_CONSUMER_TIMEOUT_S``, less ``BRIDGE_MAX_QUEUE_WAIT_S``): ``clamp_timeout``, the one clamp both
lines build their time limits through, lowers a ``timeout_seconds`` that asks for more to the longest budget the
broker covers, with a warning and ``agl_bridge_timeouts_clamped_total``. Why clamp rather than fail:
docs/architecture.md, "Guarantees" (Time limits) and "Design choices".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from celery import Celery
from kombu.exceptions import OperationalError

from bridge.core.infra import PublishError
from bridge.core.settings import DispatcherSettings
from bridge.core.task import clamp_to_broker, publishing_app
from bridge.dispatch import metrics

log = logging.getLogger("bridge.publisher")

BROKER_REFUSALS: tuple[type[BaseException], ...] = (OperationalError, OSError, ConnectionError)
"""What a publish raises when the broker did not take the message (after the client's own retries): transient,
the same message may go later. Anything else (the message cannot be encoded, a bug) is permanent."""


def retry_policy(settings: DispatcherSettings) -> dict[str, Any]:
    """The broker client's bounded retries of a publish's connection errors (``BRIDGE_PUBLISH_RETRIES``)."""
    return {
        "retry": True,
        "retry_policy": {
            "max_retries": settings.publish_retries,
            "interval_start": 0.5,
            "interval_step": 1.0,
            "interval_max": 5.0,
        },
    }


@dataclass(frozen=True)
class Task:
    """One attempt's message as a line builds it: ``describe`` is what monitoring shows (ids, never secrets);
    ``expires``: seconds the message may wait in the broker (None: no expiry)."""

    name: str
    task_id: str
    queue: str
    kwargs: dict[str, Any]
    soft_time_limit: float
    time_limit: float
    describe: str
    expires: float | None = None


class Publisher:
    def __init__(self, settings: DispatcherSettings, *, agent: str | None = None, app: Celery | None = None) -> None:
        """``agent``: the agent path every 0.3 message names, so a worker running another agent refuses it
        (default ``AGENT``; ``bridge.runner.CeleryRunner`` passes the class path of the trainer's agent). ``app``:
        the Celery app to send through (default: the bridge's, ``bridge.core.task.message.publishing_app``)."""
        self.app = app if app is not None else publishing_app(settings)[0]
        self._settings = settings
        self.agent = agent or settings.agent

    def send(self, task: Task) -> None:
        """Send one task; the broker client retries connection errors with its own bounded policy. Raises
        PublishError when the broker did not take it (``BROKER_REFUSALS``)."""
        options: dict[str, Any] = {
            "task_id": task.task_id,
            "queue": task.queue,
            "soft_time_limit": task.soft_time_limit,
            "time_limit": task.time_limit,
            "argsrepr": "()",
            "kwargsrepr": task.describe,
            **retry_policy(self._settings),
        }
        if task.expires is not None:
            options["expires"] = task.expires
        started = time.perf_counter()
        try:
            self.app.send_task(task.name, kwargs=task.kwargs, **options)
        except BROKER_REFUSALS as exc:
            raise PublishError(f"broker did not take {task.describe}: {exc!r}") from exc
        log.debug("published %s to %s in %.1f ms", task.describe, task.queue, (time.perf_counter() - started) * 1e3)

    def close(self) -> None:
        """Close the broker connections and pools of this publisher's Celery app (idempotent)."""
        try:
            self.app.close()
        except Exception as exc:  # closing must never hide what stopped the loop
            log.warning("could not close the publisher's broker connections: %r", exc)


class _TimedConfig(Protocol):
    @property
    def timeout_seconds(self) -> float | None: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...


class _Timed(Protocol):
    @property
    def config(self) -> _TimedConfig: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...


Timed = TypeVar("Timed", bound=_Timed)


def clamp_timeout(rollout: Timed, settings: DispatcherSettings, ids: str, *, agl_v1: bool = False) -> Timed:
    """The rollout as it is published: unchanged, or with ``config.timeout_seconds`` lowered to what the broker
    covers (``published_timeout``; a 1.0 rollout's in whole seconds, ``agl_v1``)."""
    asked = rollout.config.timeout_seconds
    if not asked or asked <= 0:
        return rollout
    bound = published_timeout(asked, settings, ids, agl_v1=agl_v1)
    if bound == asked:
        return rollout
    config = rollout.config.model_copy(update={"timeout_seconds": int(bound) if agl_v1 else bound})
    return rollout.model_copy(update={"config": config})


def published_timeout(asked: float, settings: DispatcherSettings, ids: str, *, agl_v1: bool = False) -> float:
    """``bridge.core.task.time_budget.clamp_to_broker`` (the rule the workers apply too), with a warning naming ``ids``
    and ``agl_bridge_timeouts_clamped_total`` counted when ``asked`` is longer than the broker covers."""
    bound = clamp_to_broker(settings, asked, agl_v1=agl_v1)
    if asked <= bound:
        return asked
    metrics.TIMEOUTS_CLAMPED.inc()
    name = "BROKER_CONSUMER_TIMEOUT_S" if settings.broker_is_amqp else "BROKER_VISIBILITY_TIMEOUT_S"
    log.warning(
        "[%s] timeout_seconds %gs is longer than the broker covers: the message would be "
        "redelivered while it runs (%s %gs - BRIDGE_MAX_QUEUE_WAIT_S %gs); "
        "running it with %gs instead. Raise %s to allow longer rollouts",
        ids,
        asked,
        name,
        settings.redelivery_timeout_s,
        settings.max_queue_wait_s,
        bound,
        name,
    )
    return bound
