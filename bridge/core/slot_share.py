"""Fair sharing of one worker pool between the 0.3 bridge (line ``v03``) and the 1.0 dispatcher (line ``v1``).

Both publish onto the same queue (``CELERY_DEFAULT_QUEUE``) and count the same slots (``bridge.core.capacity``).
The rule (docs/operations.md, "Sharing a worker pool between 0.3 and 1.0"): each line's *want* is its attempts in
flight on that queue plus its rollouts waiting; the queue's slots are split among the lines by weighted max-min
fairness (``entitlements``: a line never gets more than it wants, what it leaves goes to the others in
proportion to their weights, ``SLOT_SHARE_WEIGHTS``). A line may start at most ``its entitlement - its in
flight`` more, computed as if it wanted every slot, so what the other line does not want is its own
(work-conserving), and never more than the queue's free room. Nothing is taken back from a line above its share:
it gets nothing more until its attempts finish and free slots go to the line below its share.

Across processes: each line's leader writes ``<waiting> <weight>`` to ``keys.slot_demand`` every tick, expiring
``DEMAND_TTL_S`` later (a dead line stops counting on its own), and tells the lines' in-flight attempts apart by
id (``v1-`` starts the 1.0 dispatcher's task ids, never a Store's attempt id).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from bridge.core import keys

V03 = "v03"
V1 = "v1"
LINES = (V03, V1)
V1_PREFIX = "v1-"  # the 1.0 dispatcher's task ids (``bridge.core.agl_v1.attempt_key``)
DEMAND_TTL_S = 10  # longer than a leader's slowest tick; how long a stopped line's last demand still counts

# The in-flight set's size and how many of its members are the 1.0 line's, in one step.
_COUNT = """
local members = redis.call('zrange', KEYS[1], 0, -1)
local v1 = 0
for _, m in ipairs(members) do
  if string.sub(m, 1, string.len(ARGV[1])) == ARGV[1] then v1 = v1 + 1 end
end
return {#members, v1}
"""


def line_of(attempt_key: str) -> str:
    """The line that published an in-flight entry."""
    return V1 if attempt_key.startswith(V1_PREFIX) else V03


def entitlements(total: float, wants: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair split of ``total`` slots: each line gets at most what it wants; the rest is shared in
    proportion to ``weights`` (missing: 1) among the lines that want more. Lines wanting nothing get 0."""
    out = dict.fromkeys(wants, 0.0)
    active = {line for line, want in wants.items() if want > 0}
    remaining = float(total)
    while active and remaining > 0:
        weight_sum = sum(weights.get(line, 1.0) for line in active)
        fair = {line: remaining * weights.get(line, 1.0) / weight_sum for line in active}
        satisfied = {line for line in active if wants[line] <= fair[line]}
        if not satisfied:
            out.update(fair)
            break
        for line in satisfied:
            out[line] = float(wants[line])
            remaining -= wants[line]
        active -= satisfied
    return out


def allowance(
    line: str,
    *,
    total: int,
    room: int,
    inflight: Mapping[str, int],
    waiting: Mapping[str, int],
    weights: Mapping[str, float],
) -> int:
    """How many more rollouts ``line`` may start on the shared queue now (the module docstring): its entitlement
    when it wants every slot, minus its attempts in flight, rounded up, within ``room``; never negative."""
    wants: dict[str, float] = {other: inflight.get(other, 0) + waiting.get(other, 0) for other in LINES}
    wants[line] = max(float(total), 1.0)
    share = entitlements(total, wants, weights)[line]
    return max(0, min(room, math.ceil(share - inflight.get(line, 0) - 1e-9)))


@dataclass(frozen=True)
class Reading:
    """One line's view of the shared queue: every line's attempts in flight, and the other lines' published
    waiting counts and weights (absent: not published within ``DEMAND_TTL_S``)."""

    inflight: dict[str, int]
    waiting: dict[str, int]
    weights: dict[str, float]


def exchange(client: redis.Redis, scope: str, queue: str, line: str, waiting: int, weight: float) -> Reading:
    """Write ``line``'s demand on ``queue`` (``waiting``, ``weight``; expiring in ``DEMAND_TTL_S``) and read every
    line's in-flight count and published demand, in one round trip. Raises RedisError."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.slot_demand(scope, queue, line), f"{max(0, waiting)} {weight:g}", ex=DEMAND_TTL_S)
    pipe.eval(_COUNT, 1, keys.inflight(scope, queue), V1_PREFIX)
    for other in LINES:
        pipe.get(keys.slot_demand(scope, queue, other))
    _, (size, v1), *demands = pipe.execute()
    waiting_by: dict[str, int] = {}
    weights: dict[str, float] = {}
    for other, value in zip(LINES, demands, strict=True):
        if value:
            count, _, published = str(value).partition(" ")
            waiting_by[other], weights[other] = int(count), float(published or 1.0)
    return Reading({V03: int(size) - int(v1), V1: int(v1)}, waiting_by, weights)


def claimable(
    client: redis.Redis,
    scope: str,
    queue: str,
    line: str,
    *,
    total: int,
    room: int,
    waiting: int,
    weights: Mapping[str, float],
) -> int:
    """Publish ``line``'s demand (``waiting``, its weight from ``weights``), read the other line's, and return how
    many rollouts ``line`` may start on ``queue`` now (``allowance``). Each line's weight is the one its own
    dispatcher publishes, so two dispatchers configured differently still split consistently. Raises RedisError."""
    own_weight = weights.get(line, 1.0)
    reading = exchange(client, scope, queue, line, waiting, own_weight)
    return allowance(
        line,
        total=total,
        room=room,
        inflight=reading.inflight,
        waiting=reading.waiting,
        weights={**reading.weights, line: own_weight},
    )
