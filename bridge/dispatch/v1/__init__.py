"""The 1.0 line of the one dispatcher (``python -m bridge v1``): an Agent Lightning 1.0 gateway's rollouts on the
Celery cluster, repaired by a plan made from facts alone.
"""

from bridge.dispatch.v1.backlog import GatewayCounts, read_gateway_counts
from bridge.dispatch.v1.dispatcher import V1Dispatcher, run_v1
from bridge.dispatch.v1.repairs import V1Facts, V1Plan, plan_v1_repairs

__all__ = ["GatewayCounts", "V1Dispatcher", "V1Facts", "V1Plan", "plan_v1_repairs", "read_gateway_counts", "run_v1"]
