"""How many rollouts the bridge may claim in one dequeue, when the Store cannot be asked for a mode.

A dequeue takes the head of the Store's one queue whatever its mode, and the mode decides the broker
queue (``QUEUE_BY_MODE``). So a batch is safe only if *any* mix of modes in it can start now:

* every queue a live node consumes has room: claim ``min(room over those queues, BRIDGE_MAX_BATCH)``.
  Any mix of that many fits (a queue's room is the minimum cut from it to the nodes, so no set of
  queues receives more than it can take). With one queue, as by default, this is ``min(free slots,
  BRIDGE_MAX_BATCH)``: the same single request per batch as without queues per mode;
* some consumed queues are full, others have room: claim **one** rollout. If it routes to a queue with
  room it is published; if not, it is *held* in the bridge (``bridge.dispatch.hold``) and published as
  soon as its queue frees a slot; nothing more is claimed until then (``Hold.waits_on``). The cost
  is one dequeue request per rollout while a queue is full, instead of one per batch (measured in
  tests/integration/test_backpressure.py);
* no consumed queue has room: claim nothing and block on the workers' slot-freed wake-up.

A queue that no live node consumes is left out of the batch size, so a queue mapped for a mode the
trainer never uses does not slow the others; a rollout routed to it is held until a node consumes the
queue, and the queue is reported. The dispatcher never claims more than the hold has room for
(``BRIDGE_MAX_HELD``), so at most that many rollouts are ever claimed beyond the slots.

The alternative, claiming a batch and handing back at once what cannot be placed, was rejected: each
hand-back is one more Store request *and* uses up one of the rollout's ``max_attempts``
(docs/store-protocol.md 10, "Handing a rollout back"), and the handed-back rollout moves to the tail of
the Store queue, so a busy train queue would burn its own retries while idle val slots kept pulling it.
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
