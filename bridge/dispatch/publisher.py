"""Publishing a dequeued rollout as the Celery task ``workers.run_rollout``, by name.

The task id is the attempt id (the idempotency key end to end). The message carries the rollout as the
Store returned it, which holds no secret: the LLM key and endpoint are read by the worker from its own
settings or the Store's resources. Flower shows ``argsrepr``/``kwargsrepr``, set here to the ids and the
start of the instruction.
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

log = logging.getLogger("bridge.publisher")

_INSTRUCTION_PREVIEW = 60


def describe(rollout: AttemptedRollout) -> str:
    """What monitoring shows for a task: ids and the start of the instruction, never secrets."""
    instruction = ""
    if isinstance(rollout.input, dict) and isinstance(rollout.input.get("instruction"), str):
        instruction = rollout.input["instruction"][:_INSTRUCTION_PREVIEW]
    ids = f"rollout={rollout.rollout_id} attempt={rollout.attempt.attempt_id}"
    return f"{ids} mode={rollout.mode} instruction={instruction!r}"


class Publisher:
    def __init__(self, settings: Settings) -> None:
        self.app, self._task = publishing_app(settings)
        self._settings = settings

    def publish(self, rollout: AttemptedRollout, queue: str) -> None:
        """Send one task; the broker client retries connection errors with its own bounded policy."""
        settings = self._settings
        timeout = rollout.config.timeout_seconds
        options: dict[str, Any] = {
            "task_id": rollout.attempt.attempt_id,
            "queue": queue,
            "expires": settings.max_queue_wait_s,
            "soft_time_limit": settings.soft_time_limit(timeout),
            "time_limit": settings.hard_time_limit(timeout),
            "argsrepr": "()",
            "kwargsrepr": describe(rollout),
            "retry": True,
            "retry_policy": {
                "max_retries": settings.publish_retries,
                "interval_start": 0.5,
                "interval_step": 1.0,
                "interval_max": 5.0,
            },
        }
        started = time.perf_counter()
        try:
            self._task.apply_async(kwargs=task_kwargs(rollout, queue), **options)
        except (OperationalError, OSError, ConnectionError) as exc:
            raise PublishError(f"broker did not take rollout {rollout.rollout_id}: {exc!r}") from exc
        log.debug("published %s to %s in %.1f ms", describe(rollout), queue, (time.perf_counter() - started) * 1e3)
