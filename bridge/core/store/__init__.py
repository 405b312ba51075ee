"""The Agent Lightning Store as both processes use it (docs/store-protocol.md): the one REST client, typed
views of its JSON, and handing a claimed rollout back to its queue (``handback``, public as a module).
"""

from bridge.core.store import handback
from bridge.core.store.client import API, ROLLOUTS_PER_READ, TRACES, SharedResources, StoreClient
from bridge.core.store.models import (
    ACTIVE_ATTEMPT,
    ACTIVE_ROLLOUT,
    FINISHED_ATTEMPT,
    FINISHED_ROLLOUT,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    LLMResource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutStatus,
)

__all__ = [
    "ACTIVE_ATTEMPT",
    "ACTIVE_ROLLOUT",
    "API",
    "FINISHED_ATTEMPT",
    "FINISHED_ROLLOUT",
    "ROLLOUTS_PER_READ",
    "TRACES",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "LLMResource",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutStatus",
    "SharedResources",
    "StoreClient",
    "handback",
]
