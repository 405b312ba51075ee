"""The one place that decides which failure class (``bridge.core.task.outcome.FailureClass``) an error belongs to.

The class lands in the attempt's metadata (``failure_class``) so an operator, and the trainer, can tell
a broken environment from a broken input without reading logs.
"""

from __future__ import annotations

from celery.exceptions import SoftTimeLimitExceeded

from bridge.core.infra import (
    BridgeError,
    InvalidInputError,
    LLMError,
    LLMPaused,
    StoreError,
    Superseded,
    TelemetryError,
    WebShopError,
)
from bridge.core.task import FailureClass


class AgentError(BridgeError):
    """A configured LitAgent failed the attempt: it raised (the cause is chained), returned a value of an
    unsupported type, or is not the agent the message expected. Class ``agent``: the Store's retry policy
    decides, as for any other failed attempt."""


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
