"""How the bridge knows how many rollouts the workers can take right now.

The attempt clock starts at dequeue (docs/store-protocol.md 6.3), so rollouts must not wait in the broker.
Each worker advertises its execution slots per queue in Redis (an expiring key, refreshed every few
seconds, so a dead worker's slots vanish on their own). The bridge records every attempt it publishes
in a per-queue sorted set; the worker removes it when the task ends, whatever the outcome.

    free slots(queue) = sum of advertised slots on queue - attempts in flight on queue

This needs no Celery ``inspect`` broadcast (slow, and silent while workers are busy) and counts
messages still waiting in the broker, which ``inspect active`` would miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from bridge.core import keys

log = logging.getLogger("bridge.core.capacity")

CAPACITY_TTL_S = 30


def advertise(client: redis.Redis, worker: str, queues: Iterable[str], slots: int) -> None:
    """Called by each worker node on start and then periodically."""
    pipe = client.pipeline()
    for queue in queues:
        pipe.set(keys.capacity(queue, worker), slots, ex=CAPACITY_TTL_S)
    pipe.execute()


def withdraw(client: redis.Redis, worker: str, queues: Iterable[str]) -> None:
    """Called on warm shutdown so the bridge stops counting this worker at once."""
    client.delete(*[keys.capacity(q, worker) for q in queues])


def total_slots(client: redis.Redis, queue: str) -> int:
    names = list(client.scan_iter(match=keys.capacity_pattern(queue), count=500))
    if not names:
        return 0
    return sum(int(v) for v in client.mget(names) if v is not None)


def mark_inflight(client: redis.Redis, queue: str, attempt_id: str) -> None:
    client.zadd(keys.inflight(queue), {attempt_id: time.time()})


def clear_inflight(client: redis.Redis, queue: str, attempt_id: str) -> None:
    client.zrem(keys.inflight(queue), attempt_id)


def inflight_count(client: redis.Redis, queue: str) -> int:
    return int(client.zcard(keys.inflight(queue)))


def inflight_ids(client: redis.Redis, queue: str) -> set[str]:
    return {m.decode() if isinstance(m, bytes) else str(m) for m in client.zrange(keys.inflight(queue), 0, -1)}


@dataclass(frozen=True)
class Execution:
    """What Redis says about an attempt's execution (``workers.lease``)."""

    leased: bool  # an executor holds it now
    started: bool  # an executor started it at some point
    reported: str | None  # the final status it was reported with (its ``done`` marker), if any

    @property
    def done(self) -> bool:
        return self.reported is not None


def executions(client: redis.Redis, attempt_ids: Iterable[str]) -> dict[str, Execution]:
    ids = list(attempt_ids)
    if not ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for aid in ids:
        pipe.exists(keys.lease(aid))
        pipe.exists(keys.started(aid))
        pipe.get(keys.done(aid))
    answers = pipe.execute()
    return {
        aid: Execution(bool(answers[3 * i]), bool(answers[3 * i + 1]), _text(answers[3 * i + 2]))
        for i, aid in enumerate(ids)
    }


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def oldest_inflight_age(client: redis.Redis, queue: str) -> float | None:
    oldest = client.zrange(keys.inflight(queue), 0, 0, withscores=True)
    return time.time() - float(oldest[0][1]) if oldest else None


def prune_stale(client: redis.Redis, queue: str, max_age_s: float) -> list[str]:
    """Forget entries older than any task could live: their workers died without a trace."""
    cutoff = time.time() - max_age_s
    stale = client.zrangebyscore(keys.inflight(queue), "-inf", cutoff)
    if stale:
        client.zremrangebyscore(keys.inflight(queue), "-inf", cutoff)
        log.warning("dropped %d stale in-flight entries on queue %s", len(stale), queue)
    return [m.decode() if isinstance(m, bytes) else str(m) for m in stale]


def free_slots(client: redis.Redis, queues: Iterable[str]) -> dict[str, int]:
    return {q: max(0, total_slots(client, q) - inflight_count(client, q)) for q in queues}


def notify_freed(client: redis.Redis, queue: str) -> None:
    """Wake a bridge that waits in ``wait_for_freed`` (called after ``clear_inflight``, never before).

    Without it a full bridge re-counts slots every ``FULL_CAPACITY_WAIT_S``, so each freed slot idled
    for half that on average before the next rollout was dequeued. The list is capped and expires: it
    only ever holds "something changed", never state.
    """
    pipe = client.pipeline(transaction=False)
    pipe.lpush(keys.slot_freed(queue), 1)
    pipe.ltrim(keys.slot_freed(queue), 0, 15)
    pipe.expire(keys.slot_freed(queue), 60)
    pipe.execute()


def wait_for_freed(client: redis.Redis, queues: Iterable[str], timeout_s: float) -> bool:
    """Block until a worker frees a slot on one of ``queues`` or ``timeout_s`` passes; True if woken.

    The wake-ups that piled up are dropped at once: the caller re-counts free slots right after, which
    sees every slot freed before its wake-up was pushed, so one count serves a burst of them.
    """
    names = [keys.slot_freed(q) for q in queues]
    woken = client.blpop(names, timeout=timeout_s) is not None
    if woken:
        client.delete(*names)
    return woken
