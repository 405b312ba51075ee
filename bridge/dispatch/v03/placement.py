"""How many rollouts the bridge may claim in one dequeue, when the Store cannot be asked for a mode.

A dequeue takes the head of the Store's one queue whatever its mode, so a batch must fit *any* mix of modes:
``min(room over every consumed queue, BRIDGE_MAX_BATCH)`` while all have room, **one** rollout while some
are full (held by ``bridge.dispatch.v03.hold`` if it routes to a full queue; nothing more is claimed until it
goes), none while all are. A queue no live node consumes is left out of the batch size. At most
``BRIDGE_MAX_HELD`` rollouts are ever claimed beyond the slots (tests/integration/test_backpressure.py).
Why one and not a batch handed back: docs/architecture.md, "Design choices".
"""

from __future__ import annotations


def claim_limit(rooms: dict[str, int], served: set[str], max_batch: int) -> int:
    """How many rollouts one dequeue may claim (0: none); see the module docstring."""
    open_rooms = [rooms.get(queue, 0) for queue in served]
    if not open_rooms or max(open_rooms) < 1:
        return 0
    if min(open_rooms) < 1:
        return 1
    return min(min(open_rooms), max_batch)


def fits(queue: str, rooms: dict[str, int], served: set[str]) -> bool:
    """A rollout for ``queue`` can be published now: a live node consumes its queue and it has room."""
    return queue in served and rooms.get(queue, 0) >= 1
