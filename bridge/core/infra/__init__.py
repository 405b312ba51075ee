"""What every part of the project leans on that is no concept of its own: the exception hierarchy, secret
masking, the one retry schedule, HTTP clients, TLS options for broker and Redis URLs, logging and tracing
set-up, and what a process keeps for its lifetime.

``tls`` and ``process_state`` are public as modules; the other modules are private: import their names from here.
"""

from bridge.core.infra import process_state, tls
from bridge.core.infra.backoff import MAX_DOUBLINGS, Retries, backoff_delay, retry_until
from bridge.core.infra.errors import (
    EXIT_CONFIG_ERROR,
    BridgeError,
    ConfigError,
    DuplicateDelivery,
    InvalidInputError,
    LeaseUnproven,
    LLMError,
    LLMPaused,
    MissingSetting,
    PublishError,
    StoreError,
    StoreRejected,
    StoreUnavailable,
    Superseded,
    TelemetryError,
    UnknownIdError,
    WebShopError,
)
from bridge.core.infra.http import (
    ABORT_ON_CLOSE,
    KEEPALIVE_S,
    HTTPClient,
    PerThreadTransport,
    default_tls,
    pooled_transport,
    retry_after_s,
    service_client,
    shared_transport,
)
from bridge.core.infra.logs import JsonFormatter, RedactingFormatter, RolloutLogger, configure_logging
from bridge.core.infra.redact import redact_error, redact_text, redact_url
from bridge.core.infra.tracing import operator_collector_configured, setup_process_tracing
from bridge.core.infra.undumpable import is_dumpable, make_undumpable

__all__ = [
    "ABORT_ON_CLOSE",
    "EXIT_CONFIG_ERROR",
    "KEEPALIVE_S",
    "MAX_DOUBLINGS",
    "BridgeError",
    "ConfigError",
    "DuplicateDelivery",
    "HTTPClient",
    "InvalidInputError",
    "JsonFormatter",
    "LLMError",
    "LLMPaused",
    "LeaseUnproven",
    "MissingSetting",
    "PerThreadTransport",
    "PublishError",
    "RedactingFormatter",
    "Retries",
    "RolloutLogger",
    "StoreError",
    "StoreRejected",
    "StoreUnavailable",
    "Superseded",
    "TelemetryError",
    "UnknownIdError",
    "WebShopError",
    "backoff_delay",
    "configure_logging",
    "default_tls",
    "is_dumpable",
    "make_undumpable",
    "operator_collector_configured",
    "pooled_transport",
    "process_state",
    "redact_error",
    "redact_text",
    "redact_url",
    "retry_after_s",
    "retry_until",
    "service_client",
    "setup_process_tracing",
    "shared_transport",
    "tls",
]
