"""What one delivery of ``workers.run_rollout`` returns: the task's result, shown in Flower and counted by
``workers.lifecycle.metrics.observe_outcome``.

``OutcomeStatus`` is the delivery's outcome, not the Store's attempt status: ``skipped`` means this delivery
wrote no final status (a duplicate, a fenced or superseded executor, an unknown rollout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from workers.protocol.failures import FailureClass


class OutcomeStatus(StrEnum):
    SUCCEEDED = "succeeded"  # a ``succeeded`` report reached the Store
    FAILED = "failed"  # a ``failed`` report reached the Store (or was kept for a retry that sends it)
    SKIPPED = "skipped"  # nothing reported by this delivery


@dataclass(frozen=True)
class Outcome:
    """One delivery's result; ``as_dict`` is the task's return value (plain JSON strings, never enum objects)."""

    status: OutcomeStatus
    reason: str = ""
    failure_class: FailureClass | None = None
    reward: float | None = None

    def as_dict(self) -> dict[str, Any]:
        data = {
            "status": str(self.status),
            "reason": self.reason,
            "failure_class": None if self.failure_class is None else str(self.failure_class),
            "reward": self.reward,
        }
        return {k: v for k, v in data.items() if v not in (None, "")}


def skipped(log: logging.Logger | logging.LoggerAdapter[Any], reason: str) -> Outcome:
    """Log why this delivery writes nothing and return its ``skipped`` outcome."""
    log.warning("%s", reason)
    return Outcome(OutcomeStatus.SKIPPED, reason)
