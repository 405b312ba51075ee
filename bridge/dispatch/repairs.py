"""What both lines' reconcile planners share (``bridge.dispatch.v03.repairs``, ``bridge.dispatch.v1.repairs``).

A repair made because nothing shows an executor (no lease, no marker) is made only once it looked so on two scans
``confirm_s`` apart: a Redis restart without persistence loses leases and markers until their holders renew
them on their next heartbeat. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

LOST_ON_DRAINED_QUEUE_S = 10.0
"""How long an unstarted in-flight entry may wait on a drained queue (``queue_wait_limit``) before it counts as lost:
far above a message's trip from the publish to an idle worker's claim (under a second; a few on a loaded machine)."""


def confirm_suspects(
    seen: set[str], suspects: Mapping[str, float], now: float, confirm_s: float
) -> tuple[set[str], dict[str, float]]:
    """The two-scan rule: of the ids ``seen`` in need of repair now, those first seen (``suspects``, else now) at
    least ``confirm_s`` ago are confirmed; the others are the next scan's suspects, with when they were first
    seen. An id no longer seen is forgotten."""
    first_seen = {key: suspects.get(key, now) for key in seen}
    confirmed = {key for key, first in first_seen.items() if now - first >= confirm_s}
    return confirmed, {key: first for key, first in first_seen.items() if key not in confirmed}


def confirm_s(heartbeat_interval_s: float) -> float:
    """How far apart the two scans are: longer than it takes every live executor to renew its lease (one
    heartbeat) after Redis lost them."""
    return 2 * heartbeat_interval_s + 5.0


def queue_wait_limit(drained: bool, max_queue_wait_s: float) -> float:
    """How long an in-flight entry no executor started may wait before it counts as lost with the broker.

    ``max_queue_wait_s`` where messages may still be queued; ``LOST_ON_DRAINED_QUEUE_S`` on a *drained* queue: the
    broker holds no message for it while its workers have a free slot for every attempt in flight, so each message
    that reached the broker was taken, and one that no executor started within seconds is gone (a broker crash
    before its append-only file synced, a lost RabbitMQ queue). A message that is there after all is delivered twice,
    which the lease makes harmless.
    """
    return min(LOST_ON_DRAINED_QUEUE_S, max_queue_wait_s) if drained else max_queue_wait_s
