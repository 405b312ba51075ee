"""What both lines' reconcile planners share (``bridge.dispatch.v03_repairs``, ``bridge.dispatch.v1_repairs``).

A repair made because nothing shows an executor (no lease, no marker) is made only once it looked so on two scans
``confirm_s`` apart: a Redis restart without persistence loses leases and markers until their holders renew
them on their next heartbeat. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping


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
