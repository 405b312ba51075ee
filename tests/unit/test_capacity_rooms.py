"""Room per queue (``bridge.core.coordination.capacity.SlotView.rooms``) and the claim size built on it
(``bridge.dispatch.v03.placement``): a node's slots count once however many queues it consumes, a queue
claimed beyond its slots shows a negative room that no other queue's free slots hide, and a dequeue is
sized so that any mix of modes in it can start.

Slot adverts and in-flight entries are written to the test process's own Redis (``tests/redis_for_tests.py``)
exactly as workers and the bridge write them (``capacity.advertise``/``mark_inflight``).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import capacity, keys, shared_slots
from bridge.dispatch.v03 import placement
from tests.helpers import drop_adverts

SCOPE = keys.store_scope("http://store.test:4747")  # the deployment these keys belong to


@pytest.fixture
def queues(redis_client: redis.Redis) -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    pair = (f"train-{tag}", f"val-{tag}")
    yield pair
    for queue in pair:
        drop_adverts(redis_client, SCOPE, queue)
        redis_client.delete(keys.inflight(SCOPE, queue))


def fill(client: redis.Redis, queue: str, count: int) -> None:
    for _ in range(count):
        capacity.mark_inflight(client, SCOPE, queue, f"at-{uuid.uuid4().hex[:10]}")


def test_a_node_on_two_queues_counts_its_slots_once(redis_client: redis.Redis, queues: tuple[str, str]) -> None:
    train, val = queues
    capacity.advertise(redis_client, SCOPE, "shared@host", [train, val], 4)
    capacity.advertise(redis_client, SCOPE, "trainer@host", [train], 4)
    view = capacity.read_slots(redis_client, SCOPE, [train, val])
    assert view.nodes == {"shared@host": (4, frozenset({train, val})), "trainer@host": (4, frozenset({train}))}
    assert view.rooms() == {train: 8, val: 4}
    fill(redis_client, val, 4)  # the shared node is busy with val: train has only its own node left
    assert capacity.read_slots(redis_client, SCOPE, [train, val]).rooms() == {train: 4, val: 0}
    fill(redis_client, train, 4)
    rooms = capacity.read_slots(redis_client, SCOPE, [train, val]).rooms()
    assert rooms == {train: 0, val: 0}  # summed per queue, as before, this read 8 + 4 - 8 = 4 free slots
    assert placement.claim_limit(rooms, {train, val}, 64) == 0


def test_a_queue_claimed_beyond_its_slots_stays_negative(redis_client: redis.Redis, queues: tuple[str, str]) -> None:
    train, val = queues
    capacity.advertise(redis_client, SCOPE, "trainer@host", [train], 4)
    capacity.advertise(redis_client, SCOPE, "validator@host", [val], 4)
    fill(redis_client, train, 10)
    rooms = capacity.read_slots(redis_client, SCOPE, [train, val]).rooms()
    assert rooms == {train: -6, val: 4}  # not floored at 0, and val's slots do not count for train
    # val has room, train has none: any rollout may be a train one, so one at a time.
    assert placement.claim_limit(rooms, {train, val}, 64) == 1
    assert not placement.fits(train, rooms, {train, val})
    assert placement.fits(val, rooms, {train, val})


def test_a_batch_is_sized_for_any_mix_of_modes(redis_client: redis.Redis, queues: tuple[str, str]) -> None:
    train, val = queues
    capacity.advertise(redis_client, SCOPE, "trainer@host", [train], 8)
    capacity.advertise(redis_client, SCOPE, "validator@host", [val], 3)
    view = capacity.read_slots(redis_client, SCOPE, [train, val, "nobody-consumes-this"])
    rooms = view.rooms()
    assert view.served() == {train, val}
    assert placement.claim_limit(rooms, view.served(), 64) == 3  # three of either mode fit
    assert placement.claim_limit(rooms, view.served(), 2) == 2
    assert not placement.fits("nobody-consumes-this", rooms, view.served())  # parked, never published


def test_the_single_default_queue_claims_a_whole_batch(redis_client: redis.Redis, queues: tuple[str, str]) -> None:
    train, _ = queues
    assert placement.claim_limit(capacity.read_slots(redis_client, SCOPE, [train]).rooms(), set(), 64) == 0  # no worker
    capacity.advertise(redis_client, SCOPE, "a@host", [train], 8)
    capacity.advertise(redis_client, SCOPE, "b@host", [train], 8)
    fill(redis_client, train, 3)
    view = capacity.read_slots(redis_client, SCOPE, [train])
    assert view.rooms() == {train: 13}
    assert placement.claim_limit(view.rooms(), view.served(), 64) == 13
    assert placement.claim_limit(view.rooms(), view.served(), 4) == 4


def test_rooms_of_a_large_cluster() -> None:
    """The flow groups nodes by the queues they consume, so a large cluster is as cheap as a small one."""
    nodes = {
        f"n{i}@host": (8, frozenset({"a", "b"} if i % 3 == 0 else {"a"} if i % 3 == 1 else {"c"})) for i in range(300)
    }
    view = capacity.SlotView(nodes, {"a": 700, "b": 10, "c": 5})
    # a: 100 nodes on {a, b} and 100 on {a}: 1600 slots in all, 10 of them held by b.
    assert view.rooms() == {"a": 1600 - 700 - 10, "b": 800 - 10 - max(0, 700 - 800), "c": 800 - 5}


def test_the_fast_path_for_queues_on_separate_nodes_agrees_with_the_flow() -> None:
    """Where no node consumes two of the queues, rooms are slots minus in flight, exactly what the max flow says."""
    rng = random.Random(7)
    for _ in range(300):
        names = [f"q{i}" for i in range(rng.randint(1, 4))]
        nodes = {
            f"n{i}": (rng.randint(0, 8), frozenset({rng.choice(names)}) if rng.random() < 0.9 else frozenset())
            for i in range(rng.randint(0, 6))
        }
        inflight = {q: rng.randint(0, 12) for q in names}
        view = capacity.SlotView(nodes, inflight)
        groups: dict[frozenset[str], int] = {}
        for slots, consumed in nodes.values():
            if consumed:
                groups[consumed] = groups.get(consumed, 0) + slots
        assert view.rooms() == shared_slots.rooms(groups, inflight), (nodes, inflight)
