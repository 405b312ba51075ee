"""Fair sharing of one worker pool between the 0.3 bridge (line ``v03``) and the 1.0 dispatcher (line ``v1``).

Both publish onto the same queue (``CELERY_DEFAULT_QUEUE``) and count the same slots
(``bridge.core.coordination.capacity``). The rule (docs/operations.md, "Sharing a worker pool between 0.3 and 1.0"): the
lines share the queue's slot-seconds in proportion to their weights (``SLOT_SHARE_WEIGHTS``) while both have rollouts
waiting. Each free slot goes, one at a time, to the line whose *projected usage* per unit of weight is lowest: its
decayed slot-seconds while both lines waited (``usage``) plus one mean episode for each of its attempts in flight and
each slot already given to it in this round. A line is offered slots only up to its rollouts waiting, so what the
other line does not want is its own (work-conserving), and never more than the queue's free room. Running
rollouts are never taken back: a line that got ahead (it filled the pool before the other's work arrived) gets
freed slots again only once the other line has caught up in slot-seconds. With no usage or no mean episode
recorded yet the rule is weighted max-min fairness on the attempts in flight (``entitlements``).

Across processes: each line's leader writes ``<waiting> <weight>`` to ``keys.slot_demand`` every tick, expiring
``DEMAND_TTL_S`` later (a dead line stops counting on its own), and tells the lines' in-flight attempts apart by id
(``v1-`` starts the 1.0 dispatcher's task ids, never a Store's attempt id). The same round trip integrates each
line's in-flight count over Redis's clock into ``keys.slot_usage`` (while both lines' published demand is above
zero; halved every ``USAGE_HALF_LIFE_S``; forgotten once nothing is in flight and at most one line waits: an instant
with nothing in flight between two rounds of a contest, as when equal episodes end together, keeps the debt, or the
line that got ahead would get half the freed slots again) and counts the attempts started
since the last reading, from which the mean episode is taken; every leader's tick advances the one integral, so both
lines read the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from bridge.core.coordination import keys

V03 = "v03"
V1 = "v1"
LINES = (V03, V1)
V1_PREFIX = "v1-"  # the 1.0 dispatcher's task ids (``bridge.core.gateway.attempt_key``)
DEMAND_TTL_S = 10  # longer than a leader's slowest tick; how long a stopped line's last demand still counts
USAGE_HALF_LIFE_S = 120.0  # how fast an old imbalance of slot-seconds stops counting
USAGE_MAX_STEP_S = 5.0  # a longer gap between readings integrates only this much (no reading saw the counts)
USAGE_TTL_S = 3600  # the usage record of a queue nobody shares any more goes away on its own

# The in-flight set's size and how many of its members are the 1.0 line's; the lines' usage advanced to now.
# KEYS: in-flight set, usage hash, the 0.3 demand, the 1.0 demand. ARGV: the 1.0 prefix, half-life, max step, TTL.
# Returns {size, v1, usage v03, usage v1, mean episode} (floats as text: Lua numbers become integers otherwise).
_READ = """
local members = redis.call('zrange', KEYS[1], 0, -1, 'WITHSCORES')
local clock = redis.call('time')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local prev = redis.call('hmget', KEYS[2], 'at', 'v03', 'v1', 'work', 'starts')
local at = tonumber(prev[1]) or now
local usage03, usage1 = tonumber(prev[2]) or 0, tonumber(prev[3]) or 0
local work, starts = tonumber(prev[4]) or 0, tonumber(prev[5]) or 0
local v1, fresh = 0, 0
for i = 1, #members, 2 do
  if string.sub(members[i], 1, string.len(ARGV[1])) == ARGV[1] then v1 = v1 + 1 end
  if tonumber(members[i + 1]) > at then fresh = fresh + 1 end
end
local size = #members / 2
local function waiting(raw)
  if not raw then return 0 end
  return tonumber(string.match(raw, '^(%d+)')) or 0
end
local step = math.max(0, math.min(now - at, tonumber(ARGV[3])))
local decay = math.pow(0.5, math.max(0, now - at) / tonumber(ARGV[2]))
usage03, usage1, work, starts = usage03 * decay, usage1 * decay, work * decay, starts * decay + fresh
work = work + size * step
local contested = waiting(redis.call('get', KEYS[3])) > 0 and waiting(redis.call('get', KEYS[4])) > 0
if contested then
  usage03 = usage03 + (size - v1) * step
  usage1 = usage1 + v1 * step
elseif size == 0 then
  usage03, usage1 = 0, 0
end
if now > at or not prev[1] then
  redis.call('hset', KEYS[2], 'at', tostring(now), 'v03', tostring(usage03), 'v1', tostring(usage1),
    'work', tostring(work), 'starts', tostring(starts))
  redis.call('expire', KEYS[2], tonumber(ARGV[4]))
end
local episode = 0
if starts >= 1 then episode = work / starts end
return {size, v1, tostring(usage03), tostring(usage1), tostring(episode)}
"""


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
    usage: Mapping[str, float] | None = None,
    episode_s: float = 0.0,
) -> int:
    """How many more rollouts ``line`` may start on the shared queue now (the module docstring): of the ``room``
    free slots, those it gets when each goes in turn to the line of lowest projected usage per weight, ``line``
    wanting every slot and every other line at most its ``waiting``. Without ``usage`` or a mean episode (before
    any), it is ``line``'s max-min entitlement when it wants every slot, minus its attempts in flight, within
    ``room``."""
    used = usage or {}
    if episode_s <= 0 or not any(used.get(other, 0.0) > 0 for other in LINES):
        wants: dict[str, float] = {other: inflight.get(other, 0) + waiting.get(other, 0) for other in LINES}
        wants[line] = max(float(total), 1.0)
        share = entitlements(total, wants, weights)[line]
        return max(0, min(room, math.ceil(share - inflight.get(line, 0) - 1e-9)))
    episode = max(episode_s, 0.0)
    given = dict.fromkeys(LINES, 0)
    for _ in range(max(0, room)):
        offered = [other for other in LINES if other == line or given[other] < waiting.get(other, 0)]
        if not offered:
            break

        def projected(other: str) -> tuple[float, float, str]:
            running = inflight.get(other, 0) + given[other]
            weight = weights.get(other, 1.0)
            return ((used.get(other, 0.0) + running * episode) / weight, running / weight, other)

        given[min(offered, key=projected)] += 1
    return given[line]


def parse_demand(value: str) -> tuple[int, float]:
    """A line's published demand, ``<waiting> <weight>`` (``keys.slot_demand``), as (waiting, weight); weight 1
    where none is written."""
    count, _, published = value.partition(" ")
    return int(count), float(published or 1.0)


@dataclass(frozen=True)
class Reading:
    """One line's view of the shared queue: every line's attempts in flight, the other lines' published waiting
    counts and weights (absent: not published within ``DEMAND_TTL_S``), each line's usage (decayed slot-seconds
    while both waited) and the mean episode (slot-seconds per start; 0 before any start was seen)."""

    inflight: dict[str, int]
    waiting: dict[str, int]
    weights: dict[str, float]
    usage: dict[str, float] = field(default_factory=dict)
    episode_s: float = 0.0


def exchange(client: redis.Redis, scope: str, queue: str, line: str, waiting: int, weight: float) -> Reading:
    """Write ``line``'s demand on ``queue`` (``waiting``, ``weight``; expiring in ``DEMAND_TTL_S``), advance the lines'
    usage and read every line's in-flight count, usage and published demand, in one round trip. Raises RedisError."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.slot_demand(scope, queue, line), f"{max(0, waiting)} {weight:g}", ex=DEMAND_TTL_S)
    pipe.eval(
        _READ,
        4,
        keys.inflight(scope, queue),
        keys.slot_usage(scope, queue),
        keys.slot_demand(scope, queue, V03),
        keys.slot_demand(scope, queue, V1),
        V1_PREFIX,
        USAGE_HALF_LIFE_S,
        USAGE_MAX_STEP_S,
        USAGE_TTL_S,
    )
    for other in LINES:
        pipe.get(keys.slot_demand(scope, queue, other))
    _, (size, v1, usage03, usage1, episode), *demands = pipe.execute()
    waiting_by: dict[str, int] = {}
    weights: dict[str, float] = {}
    for other, value in zip(LINES, demands, strict=True):
        if value:
            waiting_by[other], weights[other] = parse_demand(value)
    usage = {V03: float(usage03), V1: float(usage1)}
    return Reading({V03: int(size) - int(v1), V1: int(v1)}, waiting_by, weights, usage, float(episode))


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
        usage=reading.usage,
        episode_s=reading.episode_s,
    )
