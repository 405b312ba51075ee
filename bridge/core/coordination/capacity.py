"""How the bridge knows how many rollouts the workers can take right now, queue by queue.

The attempt clock starts at dequeue (docs/store-protocol.md 6.3), so the bridge claims only what can start now.
Each worker node advertises its slots on every queue it consumes in an expiring Redis key (a dead node's
slots vanish on their own) and lists itself in the queue's node listing, which the bridge reads instead of
scanning the keyspace; the bridge records every attempt it publishes in a per-queue in-flight set that the
worker clears when the task ends. ``SlotView.rooms`` places the in-flight attempts on the nodes as a maximum
flow would, so a node's slots count once however many queues it consumes and an over-full queue's room is
negative, never a floored 0. Every function takes the deployment's ``scope`` (a digest of the Store's URL),
so deployments sharing a Redis never count each other's slots; every ``client`` is a coordination client
(``bridge.core.coordination.connection``), whose answers are ``str``. Why: docs/architecture.md, "One rollout, hop
by hop" (1) and "Design choices"; figures: docs/performance.md, "The bridge's read of the workers'
slots".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from bridge.core.coordination import keys, shared_slots
from bridge.core.coordination.slot_share import LINES

log = logging.getLogger(__name__)

CAPACITY_TTL_S = 30


# How long a node stays listed in ``keys.capacity_nodes`` after its last advertisement, in any node's clock:
# long past its slot key's expiry, so clock skew between hosts never drops a live node (a dropped one is
# listed again at its next advertisement anyway).
NODE_LISTING_S = 10 * CAPACITY_TTL_S


def advertise(client: redis.Redis, scope: str, worker: str, queues: Iterable[str], slots: int) -> None:
    """Called by each worker node on start and then periodically: its slot key on each queue, and its entry
    in the queue's node listing, where nodes gone for ``NODE_LISTING_S`` are dropped."""
    now = time.time()
    pipe = client.pipeline()
    for queue in queues:
        listing = keys.capacity_nodes(scope, queue)
        pipe.set(keys.capacity(scope, queue, worker), slots, ex=CAPACITY_TTL_S)
        pipe.zadd(listing, {worker: now})
        pipe.zremrangebyscore(listing, "-inf", now - NODE_LISTING_S)
        pipe.expire(listing, int(NODE_LISTING_S))
    pipe.execute()


def withdraw(client: redis.Redis, scope: str, worker: str, queues: Iterable[str]) -> None:
    """Called on warm shutdown so the bridge stops counting this worker at once."""
    pipe = client.pipeline()
    for queue in queues:
        pipe.delete(keys.capacity(scope, queue, worker))
        pipe.zrem(keys.capacity_nodes(scope, queue), worker)
    pipe.execute()


def missing_adverts(client: redis.Redis, scope: str, worker: str, queues: Iterable[str]) -> list[str]:
    """The queues among ``queues`` on which ``worker`` has no live slot key: empty while the node advertises on
    all of them (from ``worker_ready`` until its warm shutdown withdraws them or ``CAPACITY_TTL_S`` passes
    without a refresh). A key holding 0 (every slot stuck) still counts as advertised."""
    wanted = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in wanted:
        pipe.exists(keys.capacity(scope, queue, worker))
    return [queue for queue, present in zip(wanted, pipe.execute(), strict=True) if not present]


def _advertised(client: redis.Redis, scope: str, queues: list[str]) -> tuple[list[tuple[str, str, int]], list[int]]:
    """(queue, node, slots) of every live advertisement on ``queues``, and each queue's in-flight count.

    Two round trips whatever the size of the keyspace: the node listings (with the in-flight counts), then
    the listed nodes' slot keys. A listed node whose key has expired is dead or gone: it is left out."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.zrange(keys.capacity_nodes(scope, queue), 0, -1)
        pipe.zcard(keys.inflight(scope, queue))
    answers = pipe.execute()
    inflight = [int(answers[2 * i + 1]) for i in range(len(queues))]
    listed = [(queue, node) for i, queue in enumerate(queues) for node in answers[2 * i]]
    if not listed:
        return [], inflight
    values = client.mget([keys.capacity(scope, queue, node) for queue, node in listed])
    live = [(queue, node, int(value)) for (queue, node), value in zip(listed, values, strict=True) if value is not None]
    return live, inflight


def total_slots(client: redis.Redis, scope: str, queue: str) -> int:
    return read_slots(client, scope, [queue]).totals().get(queue, 0)


def mark_inflight(client: redis.Redis, scope: str, queue: str, attempt_id: str) -> None:
    client.zadd(keys.inflight(scope, queue), {attempt_id: time.time()})


def clear_inflight(client: redis.Redis, scope: str, queue: str, attempt_id: str) -> None:
    client.zrem(keys.inflight(scope, queue), attempt_id)


def inflight_count(client: redis.Redis, scope: str, queue: str) -> int:
    return int(client.zcard(keys.inflight(scope, queue)))


def inflight_ids(client: redis.Redis, scope: str, queue: str) -> set[str]:
    return set(client.zrange(keys.inflight(scope, queue), 0, -1))


def inflight_entries(client: redis.Redis, scope: str, queue: str) -> dict[str, float]:
    """Attempt id -> when it was recorded in flight (epoch seconds)."""
    entries = client.zrange(keys.inflight(scope, queue), 0, -1, withscores=True)
    return {m: float(score) for m, score in entries}


def oldest_inflight_age(client: redis.Redis, scope: str, queue: str) -> float | None:
    oldest = client.zrange(keys.inflight(scope, queue), 0, 0, withscores=True)
    return time.time() - float(oldest[0][1]) if oldest else None


def prune_stale(client: redis.Redis, scope: str, queue: str, max_age_s: float) -> list[str]:
    """Forget entries older than any task could live: their workers died without a trace."""
    cutoff = time.time() - max_age_s
    stale = client.zrangebyscore(keys.inflight(scope, queue), "-inf", cutoff)
    if stale:
        client.zremrangebyscore(keys.inflight(scope, queue), "-inf", cutoff)
        log.warning("dropped %d stale in-flight entries on queue %s", len(stale), queue)
    return list(stale)


@dataclass(frozen=True)
class SlotView:
    """One reading of the advertised slots and the in-flight counts of the bridge's queues."""

    nodes: dict[str, tuple[int, frozenset[str]]]  # worker node -> (its slots, which of our queues it consumes)
    inflight: dict[str, int]  # queue -> attempts published to it and not finished

    def slots(self) -> int:
        """Every live node's slots on our queues."""
        return sum(slots for slots, queues in self.nodes.values() if queues)

    def totals(self) -> dict[str, int]:
        """Each queue's slots: those of every live node consuming it (a node on two queues counts on both)."""
        totals = dict.fromkeys(self.inflight, 0)
        for slots, queues in self.nodes.values():
            for queue in queues:
                totals[queue] = totals.get(queue, 0) + slots
        return totals

    def served(self) -> set[str]:
        """The queues at least one live node consumes."""
        return {q for _, queues in self.nodes.values() for q in queues}

    def rooms(self) -> dict[str, int]:
        """How many more rollouts each queue can start now (negative: its unplaced excess).

        Nodes are grouped by the set of our queues they consume (slots summed). Where no group consumes two
        queues, a queue's room is its groups' slots minus its in-flight count; nodes shared by queues need
        the flow computation of ``bridge.core.coordination.shared_slots``.
        """
        groups: dict[frozenset[str], int] = {}
        for slots, queues in self.nodes.values():
            if queues:
                groups[queues] = groups.get(queues, 0) + slots
        if all(len(queues) == 1 for queues in groups):
            return {q: sum(n for g, n in groups.items() if q in g) - count for q, count in self.inflight.items()}
        return shared_slots.rooms(groups, self.inflight)


HELD_TTL_S = 10  # the leader rewrites it every second; a dead bridge's record fades with it


def record_held(client: redis.Redis, scope: str, held: dict[str, int], served: set[str]) -> None:
    """The leader's held rollouts per queue and the held queues nobody consumes, for ``status``."""
    unserved = ",".join(sorted(q for q in held if q not in served))
    key = keys.bridge_held(scope)
    pipe = client.pipeline()
    pipe.delete(key)
    pipe.hset(key, mapping={"unserved": unserved, **{f"queue:{q}": n for q, n in held.items()}})
    pipe.expire(key, HELD_TTL_S)
    pipe.execute()


def read_held(client: redis.Redis, scope: str) -> tuple[dict[str, int], list[str]]:
    """What ``record_held`` wrote: held rollouts per queue, and the held queues nobody consumes."""
    raw: dict[str, str] = client.hgetall(keys.bridge_held(scope))
    held = {k.removeprefix("queue:"): int(v) for k, v in raw.items() if k.startswith("queue:")}
    return held, [q for q in raw.get("unserved", "").split(",") if q]


def read_slots(client: redis.Redis, scope: str, queues: Iterable[str]) -> SlotView:
    """Every live node's slots on ``queues`` and each queue's in-flight count (``_advertised``)."""
    ours = list(queues)
    live, counts = _advertised(client, scope, ours)
    slots: dict[str, int] = {}
    consumed: dict[str, set[str]] = {}
    for queue, node, value in live:
        slots[node] = max(slots.get(node, 0), value)  # the same number on each queue: counted once
        consumed.setdefault(node, set()).add(queue)
    inflight = dict(zip(ours, counts, strict=True))
    return SlotView({node: (slots[node], frozenset(consumed[node])) for node in slots}, inflight)


def notify_freed(client: redis.Redis, scope: str, queue: str) -> None:
    """Wake every dispatch line's dispatcher that waits in ``wait_for_freed`` on ``queue`` (called after
    ``clear_inflight``, never before). Each line has its own list, so the line the share gives the slot to hears
    of it even when the other line woke first. The lists are capped and expire: they only ever hold "something
    changed", never state."""
    pipe = client.pipeline(transaction=False)
    for line in LINES:
        key = keys.slot_freed(scope, queue, line)
        pipe.lpush(key, 1)
        pipe.ltrim(key, 0, 15)
        pipe.expire(key, 60)
    pipe.execute()


def wait_for_freed(
    client: redis.Redis, scope: str, queues: Iterable[str], timeout_s: float, line: str = LINES[0]
) -> bool:
    """Block until a worker frees a slot on one of ``queues`` or ``timeout_s`` passes; True if woken. ``line``:
    whose wake-up list to wait on (``notify_freed`` pushes to each line's).

    The wake-ups that piled up are dropped at once: the caller re-counts free slots right after, which
    sees every slot freed before its wake-up was pushed, so one count serves a burst of them.
    """
    names = [keys.slot_freed(scope, q, line) for q in queues]
    woken = client.blpop(names, timeout=timeout_s) is not None
    if woken:
        client.delete(*names)
    return woken


def listed_scopes(client: redis.Redis, queues: Iterable[str]) -> set[str]:
    """The scopes of every deployment that lists worker nodes on one of ``queues``, for a caller that does not
    know its Store yet (``CeleryRunner.init``). It walks the keyspace (SCAN): once at start, never per tick."""
    found: set[str] = set()
    for queue in queues:
        head, tail = keys.capacity_nodes("\n", queue).split("\n")
        for name in client.scan_iter(match=f"{head}*{tail}", count=1000):
            scope = name[len(head) : len(name) - len(tail)]
            if scope and ":" not in scope:
                found.add(scope)
    return found


def advertised_agents(client: redis.Redis, scope: str, queues: list[str]) -> dict[str, str | None]:
    """Every live worker node consuming one of ``queues`` -> the agent it advertises (None: nothing yet)."""
    nodes = sorted(read_slots(client, scope, queues).nodes)
    if not nodes:
        return {}
    values = client.mget([keys.worker_agent(scope, node) for node in nodes])
    return dict(zip(nodes, values, strict=True))
