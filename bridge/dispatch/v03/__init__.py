"""The 0.3 line of the one dispatcher (``python -m bridge``): a Store's rollouts, claimed only as workers can start
them, held while their queue is full, published in coalesced batches, and repaired by a plan made from facts alone.
"""

from bridge.dispatch.v03.backlog import read_backlog
from bridge.dispatch.v03.coalesce import Coalescer
from bridge.dispatch.v03.dispatcher import V03Dispatcher, rollout_task
from bridge.dispatch.v03.hold import Hold
from bridge.dispatch.v03.placement import claim_limit, fits
from bridge.dispatch.v03.repairs import Facts, Plan, plan_repairs
from bridge.dispatch.v03.service import dispatch_until, run_bridge

__all__ = [
    "Coalescer",
    "Facts",
    "Hold",
    "Plan",
    "V03Dispatcher",
    "claim_limit",
    "dispatch_until",
    "fits",
    "plan_repairs",
    "read_backlog",
    "rollout_task",
    "run_bridge",
]
