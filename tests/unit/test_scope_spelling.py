"""One Store under several spellings of its URL (``bridge.core.coordination.keys.canonical_endpoint``) is one Redis key
scope; spellings that cannot be proved equal are caught at run time (``bridge.core.coordination.scope_check``):
CeleryRunner raises within seconds, naming both URLs and the fix. Real Redis: this test process's
(``tests/redis_for_tests.py``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import agentlightning as agl
import pytest
import redis

from bridge.core.coordination import capacity, deployment_endpoint, deployment_scope, keys, scope_check
from bridge.core.coordination.scope_check import ScopeMismatchError, ScopeWatch
from bridge.core.settings import load_settings
from bridge.runner import CeleryRunner
from tests.fakes.runner_agents import OtherAgent
from tests.helpers import drop_adverts
from tests.redis_for_tests import url as redis_url


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://localhost:4747", "http://127.0.0.1:4747"),
        ("http://localhost:4747/", "http://127.0.0.1:4747"),
        ("http://LOCALHOST:4747", "http://[::1]:4747/"),
        ("http://127.0.0.2:4747", "http://0.0.0.0:4747"),
        ("http://localhost:4747/v1/agl", "http://127.0.0.1:4747"),
        ("http://store.example/", "HTTP://Store.Example:80"),
        ("https://store.example", "https://store.example:443/"),
        ("http://user:pw@store.example:4747", "http://store.example:4747?x=1"),
    ],
)
def test_spellings_of_one_endpoint_are_one_scope(one: str, other: str) -> None:
    assert keys.canonical_endpoint(one) == keys.canonical_endpoint(other)
    assert keys.store_scope(one) == keys.store_scope(other)
    assert keys.gateway_scope(one) == keys.gateway_scope(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://localhost:4747", "http://localhost:4748"),  # another Store on this machine
        ("http://localhost:4747", "https://localhost:4747"),
        ("http://store:4747", "http://localhost:4747"),  # compose's name against the host's: not provable
        ("http://store.example:4747/a", "http://store.example:4747/b"),
    ],
)
def test_other_endpoints_stay_other_scopes(one: str, other: str) -> None:
    assert keys.store_scope(one) != keys.store_scope(other)


def test_settings_spelled_either_way_give_the_workers_scope() -> None:
    workers = load_settings(store_url="http://127.0.0.1:4747")
    trainer = load_settings(store_url="http://localhost:4747/")
    assert deployment_scope(workers) == deployment_scope(trainer)


@pytest.fixture
def tag(redis_client: redis.Redis) -> Iterator[str]:
    tag = uuid.uuid4().hex[:8]
    yield tag
    for url in (f"http://store-{tag}:4747", f"http://other-{tag}:9999", f"http://localhost-{tag}:4747"):
        scope = keys.store_scope(url)
        drop_adverts(redis_client, scope, f"q-{tag}")
        redis_client.delete(keys.scope_endpoint(scope))


def _workers_of(client: redis.Redis, store_url: str, queue: str) -> str:
    """Advertise one worker node on ``queue`` as a worker whose AGENT_LIGHTNING_STORE_URL is ``store_url`` does."""
    scope = keys.store_scope(store_url)
    capacity.advertise(client, scope, "worker1@host", [queue], 2)
    client.set(keys.scope_endpoint(scope), store_url, ex=capacity.CAPACITY_TTL_S)
    return scope


def test_strict_watch_raises_within_seconds_naming_both_urls(redis_client: redis.Redis, tag: str) -> None:
    queue = f"q-{tag}"
    _workers_of(redis_client, f"http://store-{tag}:4747", queue)
    ours = f"http://localhost-{tag}:4747"
    watch = ScopeWatch(redis_client, keys.store_scope(ours), ours, [queue], who="CeleryRunner", strict=True)
    started = time.monotonic()
    with pytest.raises(ScopeMismatchError) as caught:
        while time.monotonic() - started < 10:
            watch.check(set())
            time.sleep(0.05)
    assert time.monotonic() - started < scope_check.STRICT_AFTER_S + 2
    message = str(caught.value)
    assert f"http://store-{tag}:4747" in message and ours in message and "REDIS_KEY_SCOPE" in message


def test_workers_of_another_store_are_not_taken_for_ours(
    redis_client: redis.Redis, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another port: another Store sharing the Redis and the queue names. Not an error, however long."""
    queue = f"q-{tag}"
    _workers_of(redis_client, f"http://other-{tag}:9999", queue)
    ours = f"http://localhost-{tag}:4747"
    watch = ScopeWatch(redis_client, keys.store_scope(ours), ours, [queue], who="CeleryRunner", strict=True)
    monkeypatch.setattr(scope_check, "STRICT_AFTER_S", 0.0)  # a mismatch would raise at once: this is none
    watch.check(set())


def test_served_queues_never_raise(redis_client: redis.Redis, tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = f"q-{tag}"
    _workers_of(redis_client, f"http://store-{tag}:4747", queue)
    ours = f"http://localhost-{tag}:4747"
    watch = ScopeWatch(redis_client, keys.store_scope(ours), ours, [queue], who="CeleryRunner", strict=True)
    monkeypatch.setattr(scope_check, "STRICT_AFTER_S", 0.0)
    watch.check({queue})  # our own workers serve it: whatever else is listed there is not our problem


def test_a_worker_advertises_the_url_its_scope_comes_from(redis_client: redis.Redis, tag: str) -> None:
    from workers.lifecycle.steps.advertising import advertise

    settings = load_settings(store_url=f"http://store-{tag}:4747")
    scope = deployment_scope(settings)
    advertise(redis_client, scope, "w@h", [f"q-{tag}"], 2, "webshop", endpoint=deployment_endpoint(settings))
    assert redis_client.get(keys.scope_endpoint(scope)) == f"http://store-{tag}:4747"
    assert 0 < redis_client.ttl(keys.scope_endpoint(scope)) <= capacity.CAPACITY_TTL_S


def test_celery_runner_step_raises_when_its_workers_spell_the_store_otherwise(
    redis_client: redis.Redis, tag: str
) -> None:
    """The trainer names the Store ``localhost-<tag>``, the workers ``store-<tag>`` (compose's service name):
    ``step`` raises within seconds with both URLs, instead of waiting out BRIDGE_MAX_QUEUE_WAIT_S."""
    queue = f"q-{tag}"
    _workers_of(redis_client, f"http://store-{tag}:4747", queue)
    runner = CeleryRunner(broker_url=redis_url(), default_queue=queue, max_queue_wait_s=120)
    runner.init_worker(0, agl.LightningStoreClient(f"http://localhost-{tag}:4747"))
    runner.init(OtherAgent())  # no worker of the trainer's spelling of the Store: nothing to check
    started = time.monotonic()
    try:
        with pytest.raises(ScopeMismatchError) as caught:
            asyncio.run(runner.step({"question": "?"}))
    finally:
        runner.teardown_worker(0)
    assert time.monotonic() - started < 15
    assert f"http://store-{tag}:4747" in str(caught.value) and f"http://localhost-{tag}:4747" in str(caught.value)
