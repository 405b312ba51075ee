"""Agent Lightning 1.0's API gateway as both processes use it (docs/agl-v1.md): a 1.0 rollout's shape and the
names of its attempt's task and keys, and the HTTP client of the gateway's calls.
"""

from bridge.core.gateway.client import GatewayClient, GatewayConflict, GatewayError, ProxyPause
from bridge.core.gateway.rollouts import (
    FIRST_ATTEMPT,
    V1_TASK_NAME,
    Malformed,
    V1Config,
    V1LocalConfig,
    V1Rollout,
    V1State,
    V1Status,
    agent_environment,
    attempt_key,
    parse_rollout,
    scoped_attempt_key,
)

__all__ = [
    "FIRST_ATTEMPT",
    "V1_TASK_NAME",
    "GatewayClient",
    "GatewayConflict",
    "GatewayError",
    "Malformed",
    "ProxyPause",
    "V1Config",
    "V1LocalConfig",
    "V1Rollout",
    "V1State",
    "V1Status",
    "agent_environment",
    "attempt_key",
    "parse_rollout",
    "scoped_attempt_key",
]
