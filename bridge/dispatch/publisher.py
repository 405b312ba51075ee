"""Publishing a dequeued rollout as the Celery task ``workers.run_rollout``, by name.

The task id is the attempt id (the idempotency key end to end). The message carries the rollout as the
Store returned it, which holds no secret; Flower's ``argsrepr``/``kwargsrepr`` show the ids and the start of
the instruction. A rollout must end (hard limit) before the broker redelivers it (``BROKER_VISIBILITY_TIMEOUT_S``,
RabbitMQ: ``BROKER_CONSUMER_TIMEOUT_S``, less ``BRIDGE_MAX_QUEUE_WAIT_S``); a ``timeout_seconds`` that asks
for more is clamped to the longest budget the broker covers, with a warning and
``agl_bridge_timeouts_clamped_total``. Why clamp rather than fail: docs/architecture.md, "Guarantees" (Time
limits) and "Design choices".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.exceptions import OperationalError

from bridge.core.errors import PublishError
from bridge.core.message import publishing_app, task_kwargs
from bridge.core.models import AttemptedRollout
from bridge.core.settings import Settings
from bridge.core.time_budget import clamp_to_broker, hard_time_limit, soft_time_limit
from bridge.dispatch import metrics

log = logging.getLogger("bridge.publisher")

_INSTRUCTION_PREVIEW = 60

BROKER_REFUSALS: tuple[type[BaseException], ...] = (OperationalError, OSError, ConnectionError)
"""What a publish raises when the broker did not take the message (after the client's own retries): transient,
the same message may go later. Anything else (the message cannot be encoded, a bug) is permanent."""


def retry_policy(settings: Settings) -> dict[str, Any]:
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


def describe(rollout: AttemptedRollout) -> str:
    """What monitoring shows for a task: ids and the start of the instruction, never secrets."""
    instruction = ""
    if isinstance(rollout.input, dict) and isinstance(rollout.input.get("instruction"), str):
        instruction = rollout.input["instruction"][:_INSTRUCTION_PREVIEW]
    ids = f"rollout={rollout.rollout_id} attempt={rollout.attempt.attempt_id}"
    return f"{ids} mode={rollout.mode} instruction={instruction!r}"


class Publisher:
    def __init__(self, settings: Settings, *, agent: str | None = None) -> None:
        """``agent``: the agent path every message names, so a worker running another agent refuses it
        (default ``AGENT``; ``bridge.runner.CeleryRunner`` passes the class path of the trainer's agent)."""
        self.app, self._task = publishing_app(settings)
        self._settings = settings
        self.agent = agent or settings.agent

    def publish(self, rollout: AttemptedRollout, queue: str) -> None:
        """Send one task; the broker client retries connection errors with its own bounded policy."""
        settings = self._settings
        rollout = clamp_timeout(rollout, settings)
        timeout = rollout.config.timeout_seconds
        options: dict[str, Any] = {
            "task_id": rollout.attempt.attempt_id,
            "queue": queue,
            "expires": settings.max_queue_wait_s,
            "soft_time_limit": soft_time_limit(settings, timeout),
            "time_limit": hard_time_limit(settings, timeout),
            "argsrepr": "()",
            "kwargsrepr": describe(rollout),
            **retry_policy(settings),
        }
        started = time.perf_counter()
        try:
            self._task.apply_async(kwargs=task_kwargs(rollout, queue, self.agent), **options)
        except BROKER_REFUSALS as exc:
            raise PublishError(f"broker did not take rollout {rollout.rollout_id}: {exc!r}") from exc
        log.debug("published %s to %s in %.1f ms", describe(rollout), queue, (time.perf_counter() - started) * 1e3)

    def close(self) -> None:
        """Close the broker connections and pools of this publisher's Celery app (idempotent)."""
        try:
            self.app.close()
        except Exception as exc:  # closing must never hide what stopped the loop
            log.warning("could not close the publisher's broker connections: %r", exc)


def clamp_timeout(rollout: AttemptedRollout, settings: Settings) -> AttemptedRollout:
    """The rollout as it is published: unchanged, or with ``timeout_seconds`` lowered to what the broker covers."""
    asked = rollout.config.timeout_seconds
    if not asked or asked <= 0:
        return rollout
    bound = published_timeout(asked, settings, f"rollout={rollout.rollout_id} attempt={rollout.attempt.attempt_id}")
    if bound == asked:
        return rollout
    config = rollout.config.model_copy(update={"timeout_seconds": bound})
    return rollout.model_copy(update={"config": config})


def published_timeout(asked: float, settings: Settings, ids: str, *, agl_v1: bool = False) -> float:
    """``bridge.core.time_budget.clamp_to_broker`` (the rule the workers apply too), with a warning naming ``ids`` and
    ``agl_bridge_timeouts_clamped_total`` counted when ``asked`` is longer than the broker covers."""
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
