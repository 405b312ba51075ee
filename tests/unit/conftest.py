"""Unit-test fixtures: no process is started here but this process's Redis (``tests/redis_for_tests.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import coordination_client
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from tests.fakes.lines import line  # noqa: F401 (the fixture: each dispatch line in turn, tests.fakes.lines)
from tests.helpers import TEST_REDIS_URL
from workers.agents.capture import AttemptCapture
from workers.telemetry.spans import AttemptTelemetry


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """This test process's Redis database (the shared server's ``TEST_REDIS_URL`` database or a private server),
    through a client built as the processes build theirs (``coordination_client``: answers are ``str``)."""
    connection = coordination_client(TEST_REDIS_URL, socket_timeout=5)
    connection.ping()
    yield connection
    connection.close()


@pytest.fixture
def capture() -> Iterator[AttemptCapture]:
    """A LitAgent attempt's capture whose telemetry keeps its spans and exports none (no Store answers)."""
    store = StoreClient("http://127.0.0.1:9", retries=0)
    telemetry = AttemptTelemetry(store, rollout_id="ro-u", attempt_id="at-u", service_name="unit", export=False)
    settings = load_settings(store_url="http://127.0.0.1:9")
    yield AttemptCapture(telemetry, settings, lambda: None, None, lambda model: None)
    telemetry.close()
    store.close()
