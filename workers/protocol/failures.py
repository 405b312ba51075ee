"""The one place that decides which failure class an error belongs to.

The class lands in the attempt's metadata (``failure_class``) so an operator, and the trainer, can tell
a broken environment from a broken input without reading logs.
"""

from __future__ import annotations

from enum import StrEnum

from celery.exceptions import SoftTimeLimitExceeded

from bridge.core.errors import (
    BridgeError,
    InvalidInputError,
    LLMError,
    LLMPaused,
    StoreError,
    Superseded,
    TelemetryError,
    WebShopError,
)


class AgentError(BridgeError):
    """A configured LitAgent failed the attempt: it raised (the cause is chained), returned a value of an
    unsupported type, or is not the agent the message expected. Class ``agent``: the Store's retry policy
    decides, as for any other failed attempt."""


class FailureClass(StrEnum):
    INFRA = "infra"  # broker, Store, network, worker lost
    ENV = "env"  # the WebShop server failed
    LLM = "llm"  # the LLM endpoint failed after retries
    INPUT = "input"  # the rollout's input cannot be run
    TELEMETRY = "telemetry"  # spans (the reward span above all) could not be delivered
    TIMEOUT = "timeout"  # the episode ran out of its time budget
    CANCELLED = "cancelled"  # the rollout was cancelled or superseded while running
    AGENT = "agent"  # a configured LitAgent raised, returned an unsupported value, or is not the one expected
    SHUTDOWN = "shutdown"  # the worker drained (WORKER_SHUTDOWN_GRACE_S) before the episode finished


def classify(error: BaseException) -> FailureClass:
    """The failure class of ``error``, by its type alone (never its message); anything else is ``infra``."""
    if isinstance(error, AgentError):
        return FailureClass.AGENT
    if isinstance(error, InvalidInputError):
        return FailureClass.INPUT
    if isinstance(error, WebShopError):
        return FailureClass.ENV
    if isinstance(error, LLMError):
        return FailureClass.LLM
    if isinstance(error, TelemetryError):
        return FailureClass.TELEMETRY
    if isinstance(error, (SoftTimeLimitExceeded, TimeoutError)):
        return FailureClass.TIMEOUT
    if isinstance(error, Superseded):
        return FailureClass.CANCELLED
    if isinstance(error, (StoreError, LLMPaused)):
        return FailureClass.INFRA
    return FailureClass.INFRA
