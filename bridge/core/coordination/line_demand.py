"""The slots a queue needs now, counted across the dispatch lines that share it: ``agl_bridge_desired_slots{queue}``,
the autoscaling signal (docs/operations.md, "Autoscaling signal").

    desired = attempts in flight on the queue + each line's backlog on it

The attempts in flight are every line's, read once from the queue's one in-flight set
(``bridge.core.coordination.capacity``); a line's *backlog* is what waits for it: the 0.3 bridge's rollouts ``queuing``
or ``requeuing`` in the Store plus those it holds, the 1.0 dispatcher's rollouts ``queuing`` on the gateway. Each line's
leader writes its backlog per queue to Redis (``keys.line_backlog``, expiring ``BACKLOG_TTL_S`` after its last write, so
a stopped line stops counting on its own) and reads the other lines', so every leader exports the queue's whole demand
and nothing is counted twice: the autoscalers take the max over the dispatchers' series, as over a leader and its
standbys, and never their sum.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import redis

from bridge.core.coordination import keys
from bridge.core.coordination.slot_share import LINES

log = logging.getLogger(__name__)

BACKLOG_TTL_S = 15  # a leader writes about every second; longer than its slowest tick


def desired_slots(in_flight: int, own: int, others: Mapping[str, int]) -> int:
    """The queue's desired slots: its attempts in flight (all lines'), this line's backlog read fresh, and the other
    lines' published backlogs (a line absent from ``others`` has none, or stopped)."""
    return max(0, in_flight) + max(0, own) + sum(max(0, count) for count in others.values())


def parse_backlog(raw: object) -> int | None:
    """A published backlog as written by ``exchange``; None for anything else (not counted)."""
    try:
        count = int(str(raw))
    except ValueError:
        return None
    return count if count >= 0 else None


def exchange(client: redis.Redis, scope: str, line: str, own: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Write ``line``'s backlog on each queue of ``own`` and read the other lines' on the same queues, in one round
    trip: queue -> {other line: its backlog}. Raises RedisError."""
    others = [other for other in LINES if other != line]
    pipe = client.pipeline(transaction=False)
    for queue, count in own.items():
        pipe.set(keys.line_backlog(scope, queue, line), max(0, count), ex=BACKLOG_TTL_S)
    for queue in own:
        for other in others:
            pipe.get(keys.line_backlog(scope, queue, other))
    answers = iter(pipe.execute()[len(own) :])
    read: dict[str, dict[str, int]] = {}
    for queue in own:
        for other in others:
            raw = next(answers)
            published = parse_backlog(raw) if raw is not None else None
            if published is not None:
                read.setdefault(queue, {})[other] = published
    return read


class BacklogExchange:
    """``exchange`` for one line's leader, keeping the last answer when Redis fails (a blip leaves the desired slots
    as they were rather than dropping the other lines' part)."""

    def __init__(self, client: redis.Redis, scope: str, line: str) -> None:
        self.client, self.scope, self.line = client, scope, line
        self._last: dict[str, dict[str, int]] = {}

    def others(self, own: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """Publish ``own`` (queue -> this line's backlog); the other lines' backlogs per queue."""
        try:
            self._last = exchange(self.client, self.scope, self.line, own)
        except redis.RedisError as exc:
            log.debug("the lines' backlogs not exchanged this time: %r", exc)
        return self._last

    def forget(self) -> None:
        """Leadership lost: a later term starts from a fresh exchange."""
        self._last = {}
