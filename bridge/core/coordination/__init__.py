"""What the dispatchers and the workers agree on through the coordination Redis: its connection and the
deployment's scope, every key name (``keys``), worker slots and in-flight attempts (``capacity``,
``shared_slots``), the lines' share of a pool and their demand (``slot_share``, ``line_demand``), an
attempt's markers (``markers``) and workers seen under another spelling of the URL (``scope_check``).

Those modules are public as modules (``keys.lease(...)``, ``capacity.advertise(...)``); the connection's
names are imported from here.
"""

from bridge.core.coordination import capacity, keys, line_demand, markers, scope_check, shared_slots, slot_share
from bridge.core.coordination.connection import (
    coordination_client,
    coordination_redis,
    deployment_endpoint,
    deployment_scope,
)

__all__ = [
    "capacity",
    "coordination_client",
    "coordination_redis",
    "deployment_endpoint",
    "deployment_scope",
    "keys",
    "line_demand",
    "markers",
    "scope_check",
    "shared_slots",
    "slot_share",
]
