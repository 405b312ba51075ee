"""One fence read per heartbeat interval for every running attempt of the cluster, shared through Redis.

Each process lists its running attempts in a sorted set; the process whose beat comes due first takes the
round (``SET NX PX``), reads every listed attempt's rollout and posts a verdict per attempt (when the read
was sent, on the Store's clock, and why it must stop, if it must); every process fetches its attempts'
verdicts at most ``CHECK_EVERY_S`` apart and takes each newer one as its own read. A verdict only says what
the Store said: who may write is still decided by the lease alone. An attempt with no fresh verdict is read
by its own process ``GRACE_S`` after its beat was due; keys carry a digest of the Store's URL.
Why and figures: docs/performance.md, "Prefork: one fence read and one resources read for the whole fleet".
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from bridge.core.coordination import keys
from bridge.core.infra import StoreError
from bridge.core.store import ROLLOUTS_PER_READ, AttemptedRollout, Rollout, StoreClient
from workers.protocol import clock
from workers.protocol.fencing import fence

log = logging.getLogger("workers.protocol.fence_board")

CHECK_EVERY_S = 0.5  # between fetches of this process's verdicts: bounds how late a posted stop is seen
GRACE_S = 1.0  # an attempt whose beat is this overdue with no fresh verdict is read by its own process
ROUND_SHARE = 0.9  # a round is held for this share of the interval, so the next one can start on time
# ... and never longer than GRACE_S: the taker's interval need not be the shortest of the cluster (a rollout's
# unresponsive_seconds shortens its attempt's interval to a third), and a process whose attempts need reading
# sooner must be able to take the next round itself. The rounds' cadence still follows the due beats, which
# every verdict pushes back by an interval, so a short hold does not make more rounds.
LISTING_LAPSES_INTERVALS = 3  # a listed attempt nobody lists again is dropped after this many intervals
MIN_READ_S = 0.5  # less of the round's budget left than this: leave the rest unread


@dataclass(frozen=True)
class Verdict:
    read_at: float  # epoch s on this host's clock when the read was sent (a conservative age)
    reason: str | None  # why the attempt must stop, None when it passed the fence


Attempt = tuple[str, str]  # (rollout_id, attempt_id)


class FenceBoard:
    def __init__(self, redis_client: redis.Redis, scope: str) -> None:
        """``scope``: the deployment's Redis key scope (``bridge.core.coordination.deployment_scope``), which every
        key it reads and writes names."""
        self._redis = redis_client
        self.scope = scope
        self._listing = keys.fence_listing(scope)
        self._round = keys.fence_round(scope)
        self._token = uuid.uuid4().hex
        self._next_check = 0.0
        self._listed: set[Attempt] = set()
        self._listed_until = 0.0  # monotonic: list again before the entries could lapse

    def exchange(self, attempts: Iterable[Attempt], interval_s: float) -> dict[str, Verdict] | None:
        """List ``attempts`` and fetch their verdicts (attempt id -> verdict) in one round trip.

        None when the last exchange was under ``CHECK_EVERY_S`` ago, or Redis did not answer (the process then
        reads its own attempts, as without the board).
        """
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_EVERY_S
        current = set(attempts)
        gone, new = self._listed - current, current - self._listed
        relist = now >= self._listed_until
        pipe = self._redis.pipeline(transaction=False)
        if gone:
            pipe.zrem(self._listing, *(_member(a) for a in gone))
        if current and (new or relist):
            lapses = time.time() + LISTING_LAPSES_INTERVALS * interval_s
            pipe.zadd(self._listing, {_member(a): lapses for a in (current if relist else new)})
        ordered = [aid for _, aid in current]
        if ordered:
            pipe.mget([keys.fence_verdict(self.scope, aid) for aid in ordered])
        try:
            results = pipe.execute()
        except redis.RedisError as exc:
            log.debug("fence board unreachable: %r", exc)
            self._listed_until = 0.0  # list everything again once it answers (it may have lost its data)
            return None
        self._listed = current
        if relist:
            self._listed_until = now + interval_s
        raw = results[-1] if ordered else []
        return {aid: verdict for aid, value in zip(ordered, raw, strict=True) if (verdict := _parse(value))}

    def take_round(self, interval_s: float) -> bool:
        """Become this round's reader of every listed attempt; False when another process holds the round."""
        ms = max(1, int(min(interval_s * ROUND_SHARE, GRACE_S) * 1000))
        try:
            return bool(self._redis.set(self._round, self._token, nx=True, px=ms))
        except redis.RedisError:
            return False

    def listed(self) -> list[Attempt]:
        """Every attempt some process listed and still runs; drops the lapsed entries of processes that died."""
        now = time.time()
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.zremrangebyscore(self._listing, "-inf", now)
            pipe.zrangebyscore(self._listing, now, "+inf")
            members = pipe.execute()[1]
        except redis.RedisError as exc:
            log.debug("fence board listing unreadable: %r", exc)
            return []
        return [attempt for raw in members if (attempt := _attempt(raw))]

    def read(self, store: StoreClient, rollout_ids: list[str], budget: float) -> dict[str, Rollout | AttemptedRollout]:
        """The rest of a round's read, for other processes' attempts: best effort within ``budget`` seconds in all.

        The reader's own attempts come first, in its own request (``HeartbeatMonitor.beat``); a slow or failing
        Store must not then hold its beats and flushes for a request per hundred attempts of the cluster. What
        is not read here gets no verdict, and its process reads it itself.
        """
        views: dict[str, Rollout | AttemptedRollout] = {}
        deadline = time.monotonic() + budget
        for start in range(0, len(rollout_ids), ROLLOUTS_PER_READ):
            left = deadline - time.monotonic()
            if left < MIN_READ_S:
                break
            try:
                views.update(
                    store.get_rollouts(rollout_ids[start : start + ROLLOUTS_PER_READ], retries=0, timeout=left)
                )
            except StoreError as exc:
                log.debug("fence board read of other processes' attempts stopped: %s", exc)
                break
        return views

    def post(
        self, attempts: Iterable[Attempt], views: Mapping[str, Rollout | AttemptedRollout], sent_at: float, ttl_s: float
    ) -> None:
        """Publish what the read sent at ``sent_at`` (this host's clock) said of each attempt whose rollout it found."""
        stamp = f"{sent_at + clock.store_offset_s():.3f}"
        expiry = max(1, math.ceil(ttl_s))
        pipe = self._redis.pipeline(transaction=False)
        for rollout_id, attempt_id in attempts:
            view = views.get(rollout_id)
            if view is None:
                continue
            reason = fence(view, attempt_id)
            pipe.set(keys.fence_verdict(self.scope, attempt_id), f"{stamp} {reason or ''}".rstrip(), ex=expiry)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("could not post fence verdicts: %r", exc)


def _member(attempt: Attempt) -> str:
    return f"{attempt[0]} {attempt[1]}"


def _attempt(raw: str) -> Attempt | None:
    rollout_id, _, attempt_id = raw.partition(" ")
    return (rollout_id, attempt_id) if rollout_id and attempt_id else None


def _parse(raw: str | None) -> Verdict | None:
    if raw is None:
        return None
    stamp, _, reason = raw.partition(" ")
    try:
        store_time = float(stamp)
    except ValueError:
        return None
    return Verdict(clock.to_local(store_time), reason or None)
