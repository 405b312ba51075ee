"""Shared, expensive processes for the integration tests, started once per session.

Redis (the one on 127.0.0.1:6379 if it answers, on a database of its own, else a fresh redis-server),
a real ``agl store``, the WebShop server and the LLM stand-in live for the whole session. Workers and
the bridge are started per module, because tests kill and reconfigure them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from bridge.core.store import API
from bridge_lab.procs import redis_answers
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import TEST_REDIS_URL, cancel_unfinished


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration starts real processes: ``-m "not integration"`` skips it."""
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.integration)


SHARED_STACK_PARAM = "agent_stack"  # module-scoped, parametrized with (agent, pool): test_litagent.py


class SharedStackOrder:
    """Runs the tests that share a ``SHARED_STACK_PARAM`` value back to back, so each stack starts once.

    pytest's own reordering for higher-scoped parameters goes by the parameter's index in each test's
    list, which pairs unrelated values across test functions; this runs after it (trylast) and keeps
    every other item in place.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        slots = [i for i, item in enumerate(items) if _stack_param(item) is not None]
        first: dict[object, int] = {}
        for i in slots:
            first.setdefault(_stack_param(items[i]), i)
        ordered = sorted((items[i] for i in slots), key=lambda item: first[_stack_param(item)])
        for i, item in zip(slots, ordered, strict=True):
            items[i] = item


def _stack_param(item: pytest.Item) -> object:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(SHARED_STACK_PARAM) if callspec is not None else None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SharedStackOrder(), "shared-stack-order")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack-logs")


@pytest.fixture(scope="session")
def services(log_dir: Path) -> Iterator[LocalStack]:
    """Broker, Store, WebShop server and LLM stand-in: started once, torn down at the end."""
    broker = TEST_REDIS_URL if redis_answers(TEST_REDIS_URL) else None
    if broker:
        redis.Redis.from_url(broker).flushdb()
    # No Prometheus tracker: it adds 20-40% to every request's CPU; tests/integration/test_bench.py, which reads the
    # Store's request counters, starts a Store of its own with it.
    config = StackConfig(broker_url=broker, workers=0, bridge=False, log_dir=log_dir)
    stack = LocalStack(config)
    try:
        stack.start_services(lambda message: print(message))
        yield stack
    finally:
        stack.stop()


NEUTRAL_RESOURCES = {
    "note": {
        "resource_type": "prompt_template",
        "template": "no main_llm: workers use OPENAI_API_BASE",
        "engine": "f-string",
    }
}


@pytest.fixture(autouse=True)
def no_leftover_llm_resource(request: pytest.FixtureRequest) -> None:
    """Each test starts with no ``main_llm`` in the Store's latest resources, as on a fresh Store.

    The Store cannot delete resources, and rollouts enqueued without ``resources_id`` are stamped with the
    latest ones: a ``main_llm`` published by one test (the benchmark, the LLM proxy test) would otherwise
    route every later test's LLM calls. A neutral update makes the latest carry none again.
    """
    if "services" not in request.fixturenames:
        return
    services: LocalStack = request.getfixturevalue("services")
    latest = httpx.get(f"{services.store_url}{API}/resources/latest", timeout=30).json()
    if latest and "main_llm" in (latest.get("resources") or {}):
        httpx.post(f"{services.store_url}{API}/resources", json=NEUTRAL_RESOURCES, timeout=30).raise_for_status()


@pytest.fixture
def clean_store(services: LocalStack) -> Iterator[LocalStack]:
    """Starts from, and leaves behind, no unfinished rollout for the next test's bridge and a clean broker database
    (a test that kills or drains workers leaves messages unacknowledged, which the next module's workers would be
    handed once their visibility timeout passes)."""
    cancel_unfinished(services.store_url)
    redis.Redis.from_url(services.broker_url).flushdb()
    yield services
    cancel_unfinished(services.store_url)
    redis.Redis.from_url(services.broker_url).flushdb()
