"""Claimed rollouts the bridge holds until their queue has room: bounded, first in first out per queue.

A rollout for a full queue, or for one no live worker consumes, is held here instead of published
(``bridge.dispatch.v03.placement``), at most ``BRIDGE_MAX_HELD`` of them. A full queue's held rollouts go out
oldest first as slots free, and one held past ``BRIDGE_MAX_QUEUE_WAIT_S`` is handed back; an unserved queue's
stay held and the queue is reported (log, ``agl_bridge_unserved_queue``, ``status``) rather than cycled through
hand-backs. Reconcile re-reads every held rollout and drops the ones the Store moved on from, so a cancelled
rollout is never published or requeued from here. Hop by hop: docs/architecture.md, "One rollout, hop by
hop" (1); tests/integration/test_backpressure.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from bridge.core.store import AttemptedRollout


@dataclass(frozen=True)
class Held:
    rollout: AttemptedRollout
    queue: str
    since: float = field(default_factory=time.monotonic)

    @property
    def attempt_id(self) -> str:
        return self.rollout.attempt.attempt_id


class Hold:
    """The held rollouts, in the order they were claimed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: list[Held] = []

    def __len__(self) -> int:
        return len(self._items)

    def room(self) -> int:
        return max(0, self.capacity - len(self._items))

    def add(self, rollout: AttemptedRollout, queue: str) -> None:
        self._items.append(Held(rollout, queue))

    def attempt_ids(self) -> set[str]:
        return {item.attempt_id for item in self._items}

    def rollout_ids(self) -> list[str]:
        return [item.rollout.rollout_id for item in self._items]

    def by_queue(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self._items:
            counts[item.queue] = counts.get(item.queue, 0) + 1
        return counts

    def waits_on(self, served: set[str]) -> bool:
        """A held rollout waits for a consumed (full) queue: the bridge then claims nothing more, so no
        queue is claimed beyond its slots by more than one rollout."""
        return any(item.queue in served for item in self._items)

    def placeable(self, rooms: dict[str, int], served: set[str]) -> list[Held]:
        """Take out, oldest first, every held rollout whose queue has room now; ``rooms`` is charged for them."""
        out: list[Held] = []
        for item in list(self._items):
            if item.queue in served and rooms.get(item.queue, 0) >= 1:
                rooms[item.queue] -= 1
                self._items.remove(item)
                out.append(item)
        return out

    def overdue(self, served: set[str], max_wait_s: float) -> list[Held]:
        """Take out the rollouts held longer than ``max_wait_s`` for a queue that is consumed but full."""
        now = time.monotonic()
        out = [item for item in self._items if item.queue in served and now - item.since > max_wait_s]
        self._drop(out)
        return out

    def discard(self, attempt_ids: Iterable[str]) -> list[Held]:
        """Take out the rollouts of these attempts (the Store moved on from them)."""
        gone = set(attempt_ids)
        out = [item for item in self._items if item.attempt_id in gone]
        self._drop(out)
        return out

    def take_all(self) -> list[Held]:
        out, self._items = self._items, []
        return out

    def _drop(self, items: list[Held]) -> None:
        ids = {id(item) for item in items}
        self._items = [item for item in self._items if id(item) not in ids]
