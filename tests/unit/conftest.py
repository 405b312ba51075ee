"""Unit-test fixtures: no process is started here but this process's Redis (``tests/redis_for_tests.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from bridge.core.coordination import coordination_client
from tests.helpers import TEST_REDIS_URL


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """This test process's Redis database (the shared server's ``TEST_REDIS_URL`` database or a private server),
    through a client built as the processes build theirs (``coordination_client``: answers are ``str``)."""
    connection = coordination_client(TEST_REDIS_URL, socket_timeout=5)
    connection.ping()
    yield connection
    connection.close()
