"""The fixed facts of one delivery of an attempt, decided once when the task starts.

``Attempt`` is immutable: everything that changes while the attempt runs (the lease, the freshest view of
the rollout, the heartbeat watch, the report) lives in the collaborators that ``workers.execution`` builds
around it. ``read_payload`` is the only place that turns the task's payload into an ``Attempt``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from bridge.core.infra import RolloutLogger
from bridge.core.store import AttemptedRollout
from workers.protocol import clock
from workers.protocol.lease import executor_id
from workers.telemetry.spans import current_trace_id

log = logging.getLogger("workers.execution")


@dataclass(frozen=True)
class Attempt:
    """One delivery of one Store attempt: ids, the validated rollout, timing and who executes it.

    ``rollout`` is None only for a payload that names its ids but is not a valid ``AttemptedRollout``:
    such an attempt is reported failed (``input``) and never run. ``dequeued_at`` is the Store's dequeue
    (the attempt's ``start_time``) on this host's clock: the attempt's time budget and the Store's watchdog
    are judged from it (docs/store-protocol.md 6.3).
    """

    rollout_id: str
    attempt_id: str
    celery_task_id: str
    rollout: AttemptedRollout | None
    payload: Any = field(compare=False, repr=False)  # the task's payload as sent (a LitAgent receives it as is)
    expected_agent: str | None  # the message's ``agent`` (None: sent before messages named one)
    started: float  # epoch s when the task started
    dequeued_at: float
    executor: str = field(default_factory=executor_id)  # host:pid:thread, the attempt's worker_id
    trace_id: str | None = field(default_factory=current_trace_id)

    @cached_property
    def log(self) -> RolloutLogger:
        return RolloutLogger(
            log, {"rollout_id": self.rollout_id, "attempt_id": self.attempt_id, "task_id": self.celery_task_id}
        )

    def span_attributes(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Attributes of the attempt's root span: its ids and executor, then ``extra``."""
        return {
            "agentlightning.rollout_id": self.rollout_id,
            "agentlightning.attempt_id": self.attempt_id,
            "celery.task_id": self.celery_task_id,
            "worker.id": self.executor,
            **extra,
        }


@dataclass(frozen=True)
class Rejected:
    """A payload that is not an ``AttemptedRollout``: with its ids (``attempt``) it is reported failed
    (``input``), without them it cannot be reported and is dropped."""

    message: str
    celery_task_id: str
    attempt: Attempt | None


def read_payload(payload: Any, *, celery_task_id: str, expected_agent: str | None) -> Attempt | Rejected:
    """The attempt a task's payload describes, or why it cannot be run."""
    started = time.time()
    try:
        rollout = AttemptedRollout.model_validate(payload)
    except ValidationError as exc:
        return _rejected(payload, exc, celery_task_id=celery_task_id, started=started)
    # The Store's clock stamped the dequeue: on ours, the attempt's budget and the watchdog are judged right.
    start = rollout.attempt.start_time
    return Attempt(
        rollout_id=rollout.rollout_id,
        attempt_id=rollout.attempt.attempt_id,
        celery_task_id=celery_task_id,
        rollout=rollout,
        payload=payload,
        expected_agent=expected_agent,
        started=started,
        dequeued_at=clock.to_local(start) if start else started,
    )


def _rejected(payload: Any, exc: ValidationError, *, celery_task_id: str, started: float) -> Rejected:
    rid = payload.get("rollout_id") if isinstance(payload, dict) else None
    sent = payload.get("attempt") if isinstance(payload, dict) else None
    aid = sent.get("attempt_id") if isinstance(sent, dict) else None
    message = f"task payload is not an AttemptedRollout: {exc.errors()[0].get('msg') if exc.errors() else exc}"
    if not (isinstance(rid, str) and isinstance(aid, str)):
        return Rejected(message, celery_task_id, None)
    return Rejected(
        message, celery_task_id, Attempt(rid, aid, celery_task_id, None, payload, None, started, dequeued_at=started)
    )
