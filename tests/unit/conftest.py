"""Unit-test fixtures: no process is started here, a Redis that already answers is used when there is one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.helpers import TEST_REDIS_URL


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """The Redis at ``TEST_REDIS_URL`` (``redis://127.0.0.1:6379/11`` by default); the test skips without one."""
    connection = redis.Redis.from_url(TEST_REDIS_URL, socket_timeout=5)
    try:
        connection.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {TEST_REDIS_URL}: {exc}")
    yield connection
    connection.close()
