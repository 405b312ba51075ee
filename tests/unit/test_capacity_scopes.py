"""Two deployments on one Redis (``bridge.core.coordination.keys``): every key that holds one deployment's state carries
its Store's scope, so neither counts the other's slots, in-flight attempts, wake-ups, held rollouts or agents, and
each has its own leader lock. Same queue and node names on both sides, the worst case. Real Redis: this test
process's (``tests/redis_for_tests.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

import workers.lifecycle.resources
from bridge.core.coordination import capacity, deployment_scope, keys
from bridge.core.infra import ConfigError
from bridge.core.settings import load_settings
from bridge.dispatch.leader import LeaderLock, dispatching
from bridge.dispatch.v03.dispatcher import V03Dispatcher
from bridge.runner_support.fleet import AgentMismatchError, check_fleet
from tests.helpers import drop_adverts
from workers.lifecycle.shared_resources import RedisResources
from workers.protocol.lease import free_slot


@pytest.fixture
def scopes(redis_client: redis.Redis) -> Iterator[tuple[str, str, str]]:
    """Two deployments' scopes (their Stores differ by port only) and the queue name both use."""
    tag = uuid.uuid4().hex[:8]
    one, two = keys.store_scope(f"http://store-{tag}:4747"), keys.store_scope(f"http://store-{tag}:4748")
    queue = f"rollouts-{tag}"
    yield one, two, queue
    for scope in (one, two):
        drop_adverts(redis_client, scope, queue)
        redis_client.delete(
            keys.inflight(scope, queue),
            keys.slot_freed(scope, queue),
            keys.bridge_held(scope),
            keys.bridge_leader(scope),
            keys.worker_agent(scope, "worker1@host"),
        )


def test_the_scope_is_derived_from_the_store_url_in_one_place() -> None:
    settings = load_settings(store_url="http://Store.example:4747/", broker_url="redis://127.0.0.1:6379/0")
    assert deployment_scope(settings) == keys.store_scope("http://store.example:4747")
    assert deployment_scope(settings) != keys.store_scope("http://store.example:4748")
    assert keys.inflight("abc", "rollouts") == "agl:inflight:abc:rollouts"
    assert keys.ratelimit("gpt-4o") == "agl:ratelimit:gpt-4o"  # shared by every deployment on purpose


def test_a_named_scope_lets_processes_spell_the_store_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's host reaches the Store as localhost, the workers as ``store``: one REDIS_KEY_SCOPE joins them,
    and it reaches the worker's fence board and shared resources too (``workers.lifecycle.resources``)."""
    spellings = ("http://127.0.0.1:4747", "http://store:4747")
    named = [load_settings(store_url=url, broker_url="redis://r:6379/0", redis_key_scope="team-a") for url in spellings]
    assert {deployment_scope(s) for s in named} == {"team-a"}
    assert (
        len({deployment_scope(load_settings(store_url=url, broker_url="redis://r:6379/0")) for url in spellings}) == 2
    )
    with pytest.raises(ConfigError, match="REDIS_KEY_SCOPE"):
        load_settings(store_url=spellings[0], broker_url="redis://r:6379/0", redis_key_scope="a:b")
    worker = named[1].model_copy(update={"fence_board": True})
    monkeypatch.setattr(workers.lifecycle.resources, "get_settings", lambda: worker)
    built = workers.lifecycle.resources.get_resources()
    try:
        shared = built.store.shared_resources
        assert isinstance(shared, RedisResources) and shared.scope == "team-a"
        assert built.monitor.board is not None and built.monitor.board.scope == "team-a"
    finally:
        built.store.close()


def test_slots_and_in_flight_attempts_are_counted_per_deployment(
    redis_client: redis.Redis, scopes: tuple[str, str, str]
) -> None:
    one, two, queue = scopes
    capacity.advertise(redis_client, one, "worker1@host", [queue], 4)
    capacity.advertise(redis_client, two, "worker1@host", [queue], 2)
    capacity.advertise(redis_client, two, "worker2@host", [queue], 2)
    capacity.mark_inflight(redis_client, one, queue, "at-one")
    view_one, view_two = (
        capacity.read_slots(redis_client, one, [queue]),
        capacity.read_slots(redis_client, two, [queue]),
    )
    assert view_one.nodes == {"worker1@host": (4, frozenset({queue}))} and view_one.rooms() == {queue: 3}
    assert set(view_two.nodes) == {"worker1@host", "worker2@host"} and view_two.rooms() == {queue: 4}
    assert capacity.inflight_ids(redis_client, two, queue) == set()
    capacity.withdraw(redis_client, two, "worker1@host", [queue])  # the other deployment's node of that name
    assert capacity.total_slots(redis_client, one, queue) == 4 and capacity.total_slots(redis_client, two, queue) == 2
    assert not free_slot(redis_client, two, queue, "at-one")  # not in that deployment's set
    assert free_slot(redis_client, one, queue, "at-one")
    assert capacity.inflight_count(redis_client, one, queue) == 0


def test_wake_ups_held_rollouts_and_agents_stay_in_their_deployment(
    redis_client: redis.Redis, scopes: tuple[str, str, str]
) -> None:
    one, two, queue = scopes
    capacity.notify_freed(redis_client, one, queue)
    assert capacity.wait_for_freed(redis_client, two, [queue], 0.1) is False
    assert capacity.wait_for_freed(redis_client, one, [queue], 1.0) is True
    capacity.record_held(redis_client, one, {queue: 3}, set())
    assert capacity.read_held(redis_client, one) == ({queue: 3}, [queue])
    assert capacity.read_held(redis_client, two) == ({}, [])
    for scope, agent in ((one, "webshop"), (two, "pkg.agents:Other")):
        capacity.advertise(redis_client, scope, "worker1@host", [queue], 1)
        redis_client.set(keys.worker_agent(scope, "worker1@host"), agent, ex=30)
    assert capacity.advertised_agents(redis_client, one, [queue]) == {"worker1@host": "webshop"}
    assert capacity.advertised_agents(redis_client, two, [queue]) == {"worker1@host": "pkg.agents:Other"}


def test_each_deployment_has_its_own_leader(redis_client: redis.Redis, scopes: tuple[str, str, str]) -> None:
    one, two, _ = scopes
    first, standby = LeaderLock(redis_client, "bridge-a", scope=one), LeaderLock(redis_client, "bridge-b", scope=one)
    other = LeaderLock(redis_client, "bridge-c", scope=two)
    assert not dispatching(redis_client, two)
    try:
        assert first.ensure() == (True, True)
        assert standby.ensure() == (False, False)  # the same deployment: one leads
        assert other.ensure() == (True, True)  # another Store's bridge on the same Redis leads its own
        assert dispatching(redis_client, one) and dispatching(redis_client, two)
    finally:
        for lock in (first, standby, other):
            lock.release()
    assert not dispatching(redis_client, one) and not dispatching(redis_client, two)


def test_before_the_store_is_known_the_fleet_check_reads_every_deployment_on_the_queues(
    redis_client: redis.Redis, scopes: tuple[str, str, str]
) -> None:
    """``CeleryRunner.init`` before ``init_worker`` names the Store: the only time a keyspace walk is made."""
    one, two, queue = scopes
    capacity.advertise(redis_client, one, "worker1@host", [queue], 1)
    redis_client.set(keys.worker_agent(one, "worker1@host"), "pkg.agents:Mine", ex=30)
    capacity.advertise(redis_client, two, "worker2@host", [queue], 1)
    redis_client.set(keys.worker_agent(two, "worker2@host"), "webshop", ex=30)
    try:
        assert {one, two} <= capacity.listed_scopes(redis_client, [queue])
        assert check_fleet(redis_client, one, [queue], "pkg.agents:Mine") == {"worker1@host": "pkg.agents:Mine"}
        with pytest.raises(AgentMismatchError) as caught:
            check_fleet(redis_client, None, [queue], "pkg.agents:Mine")
        assert caught.value.mismatched == {"worker2@host": "webshop"}
    finally:
        redis_client.delete(keys.worker_agent(two, "worker2@host"))


def test_a_bridge_whose_queues_are_served_under_another_spelling_of_its_store_says_so(
    redis_client: redis.Redis, scopes: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The same Store spelled differently by the bridge and its workers (``localhost`` against ``store``, which
    no canonical form can prove equal) is two scopes: the idle bridge logs an error naming both URLs."""
    _, _, queue = scopes
    theirs = "http://store-" + queue + ":4747"
    two = keys.store_scope(theirs)
    settings = load_settings(store_url="http://localhost:4747", broker_url="redis://127.0.0.1:9/0", default_queue=queue)
    dispatcher = V03Dispatcher(settings, None, redis_client, None)  # type: ignore[arg-type]
    capacity.advertise(redis_client, two, "worker1@host", [queue], 2)
    redis_client.set(keys.scope_endpoint(two), theirs, ex=30)  # what such workers advertise beside their slots
    try:
        with caplog.at_level("WARNING", logger="bridge.scope"):
            dispatcher.scope_watch.check(set())
            dispatcher.scope_watch.check(set())  # once a minute at most
    finally:
        drop_adverts(redis_client, two, queue)
        redis_client.delete(keys.scope_endpoint(two))
    [error] = [r for r in caplog.records if "two spellings" in r.getMessage()]
    assert error.levelname == "ERROR"
    message = error.getMessage()
    assert theirs in message and "http://localhost:4747" in message and dispatcher.scope in message
    assert "REDIS_KEY_SCOPE" in message
