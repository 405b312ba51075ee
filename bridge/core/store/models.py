"""Typed views of the Store's JSON (docs/store-protocol.md section 4).

Extra fields are kept (``extra="allow"``) so a newer Store that adds fields does not break us.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AttemptStatus(StrEnum):
    PREPARING = "preparing"  # claimed, no sign of progress yet
    RUNNING = "running"  # progress seen (a span or an explicit report)
    SUCCEEDED = "succeeded"  # episode ran to its end, whatever the reward
    FAILED = "failed"  # infrastructure broke or the input was invalid
    TIMEOUT = "timeout"  # set by the Store's watchdog
    UNRESPONSIVE = "unresponsive"  # set by the Store's watchdog


class RolloutStatus(StrEnum):
    QUEUING = "queuing"  # enqueued, never claimed
    PREPARING = "preparing"  # an attempt exists
    RUNNING = "running"  # the latest attempt made progress
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REQUEUING = "requeuing"  # back in the queue for a retry


ACTIVE_ATTEMPT = frozenset({AttemptStatus.PREPARING, AttemptStatus.RUNNING})
# Ended for good: a span revives an ``unresponsive`` attempt to ``running``, never one of these.
FINISHED_ATTEMPT = frozenset({AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.TIMEOUT})
ACTIVE_ROLLOUT = frozenset({RolloutStatus.PREPARING, RolloutStatus.RUNNING})
FINISHED_ROLLOUT = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED})


class _StoreModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class RolloutConfig(_StoreModel):
    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: int = 1
    retry_condition: list[str] = Field(default_factory=list)


class Attempt(_StoreModel):
    rollout_id: str
    attempt_id: str
    sequence_id: int = 1
    start_time: float | None = None
    end_time: float | None = None
    status: str = AttemptStatus.PREPARING
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


class Rollout(_StoreModel):
    rollout_id: str
    input: Any = None
    start_time: float | None = None
    end_time: float | None = None
    mode: str | None = None
    resources_id: str | None = None
    status: str = RolloutStatus.QUEUING
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: dict[str, Any] | None = None


class AttemptedRollout(Rollout):
    attempt: Attempt


class LLMResource(_StoreModel):
    resource_type: Literal["llm", "proxy_llm"]
    endpoint: str
    model: str
    api_key: str | None = None
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)


class ResourcesUpdate(_StoreModel):
    resources_id: str
    version: int = 1
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
