"""The Celery task both processes agree on: its message (name, keyword arguments, the Celery settings both
sides share), an attempt's time budget, and how the attempt ended (``Outcome``).
"""

from bridge.core.task.message import (
    DEFAULT_AGENT,
    TASK_NAME,
    agent_identity,
    base_app,
    broker_transport_options,
    publishing_app,
    task_kwargs,
)
from bridge.core.task.outcome import (
    DETAIL_CHARS,
    ERROR_CHARS,
    HEADLINE_CHARS,
    FailureClass,
    Outcome,
    OutcomeStatus,
    error_text,
    failed_message,
    failure_class_of,
    skipped,
)
from bridge.core.task.time_budget import (
    clamp_to_broker,
    hard_time_limit,
    longest_hard_limit_s,
    longest_timeout_s,
    soft_time_limit,
    v1_longest_timeout_s,
    v1_time_limits,
)

__all__ = [
    "DEFAULT_AGENT",
    "DETAIL_CHARS",
    "ERROR_CHARS",
    "HEADLINE_CHARS",
    "TASK_NAME",
    "FailureClass",
    "Outcome",
    "OutcomeStatus",
    "agent_identity",
    "base_app",
    "broker_transport_options",
    "clamp_to_broker",
    "error_text",
    "failed_message",
    "failure_class_of",
    "hard_time_limit",
    "longest_hard_limit_s",
    "longest_timeout_s",
    "publishing_app",
    "skipped",
    "soft_time_limit",
    "task_kwargs",
    "v1_longest_timeout_s",
    "v1_time_limits",
]
