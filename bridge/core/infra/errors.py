"""The project's exception hierarchy, in one place.

Transient errors are worth retrying; permanent ones are not. Callers branch on the class, never on
message text.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every error this project raises on purpose."""


class StoreError(BridgeError):
    """The Agent Lightning Store could not do what was asked."""

    def __init__(self, message: str, *, status_code: int | None = None, path: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.path = path


class StoreUnavailable(StoreError):
    """Connection error, timeout or a 5xx that is not a store-level ValueError: retry later."""


class StoreRejected(StoreError):
    """A 4xx, or a store-level ``ValueError``: retrying the same request cannot help."""


class UnknownIdError(StoreRejected):
    """The Store does not know this rollout or attempt (typically: it restarted and lost its state)."""


class PublishError(BridgeError):
    """The broker did not take a message after all retries."""


class WebShopError(BridgeError):
    """The WebShop server failed (5xx, timeouts, malformed answers) after bounded retries."""


class LLMError(BridgeError):
    """The LLM endpoint failed after bounded retries."""


class LLMPaused(BridgeError):
    """The LLM gateway stayed paused (a trainer's weight update: 429 with ``X-Agl-Paused``) until the attempt's
    deadline. Class ``infra``, never ``llm`` or ``agent``: the episode was not at fault."""


class InvalidInputError(BridgeError):
    """The rollout's input cannot be run (no instruction, wrong types, too large)."""


class TelemetryError(BridgeError):
    """Spans, above all the reward span, could not be delivered to the Store."""


class Superseded(BridgeError):
    """The attempt is no longer ours to run: superseded, timed out, cancelled or finished elsewhere."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LeaseUnproven(BridgeError):
    """Redis could not confirm that an attempt is still ours: write nothing into it until it can.

    A host cut off from Redis cannot tell an outage (nobody can take the attempt over) from its own
    partition (the other hosts can, and may have): docs/cluster.md.
    """


class DuplicateDelivery(BridgeError):
    """Another executor holds this attempt's lease: check again once it lapses (its holder may be dead)."""

    def __init__(self, message: str, *, retry_in_s: float) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s


class ConfigError(BridgeError):
    """The configuration is invalid: ``message`` says why, ``setting`` names the variable at fault when one is.

    An ordinary exception: entry points (``python -m bridge``, a worker's start-up) print the message and
    exit with ``EXIT_CONFIG_ERROR``; a library caller (``CeleryRunner``) sees it raised.
    """

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.setting = setting


class MissingSetting(ConfigError):
    """A required variable is not set; ``setting`` names it (the first one, if several are)."""


EXIT_CONFIG_ERROR = 2
"""The exit code of a process stopped by a ConfigError."""
