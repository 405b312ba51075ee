"""``python -m workers.lifecycle.health``, the worker's readiness probe: it answers 0 exactly while the node's slot
advert (``bridge.core.coordination.capacity.advertise``, the key the worker writes) is present on every queue asked
about.

Real Redis: this test process's (``tests/redis_for_tests.py``); settings from a clean environment.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bridge.core.coordination import capacity, keys
from tests.helpers import TEST_REDIS_URL, drop_adverts
from workers.lifecycle import health

STORE_URL = "http://store.test:4747"
SCOPE = keys.store_scope(STORE_URL)  # what the probe derives from AGENT_LIGHTNING_STORE_URL


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The worker's settings as a pod gets them, and no .env file from the working directory."""
    monkeypatch.chdir(tmp_path)
    for name in ("REDIS_URL", "REDIS_KEY_SCOPE", "CELERY_DEFAULT_QUEUE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE_URL)
    monkeypatch.setenv("CELERY_BROKER_URL", TEST_REDIS_URL)


@pytest.fixture
def queues(redis_client: redis.Redis) -> Iterator[list[str]]:
    names = [f"health-{uuid.uuid4().hex[:8]}", f"health-{uuid.uuid4().hex[:8]}"]
    yield names
    for name in names:
        drop_adverts(redis_client, SCOPE, name)


def test_ready_exactly_while_the_node_advertises_on_every_queue(
    env: None, queues: list[str], redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    node = f"worker@pod-{uuid.uuid4().hex[:6]}"
    argv = ["--node", node, "-Q", ",".join(queues)]
    assert health.main(argv) == 1  # not started yet
    capacity.advertise(redis_client, SCOPE, node, queues[:1], 8)
    assert health.main(argv) == 1  # one queue still missing, and named
    assert queues[1] in capsys.readouterr().err
    capacity.advertise(redis_client, SCOPE, node, queues, 0)  # every slot stuck: still advertised
    assert health.main(argv) == 0
    assert health.main(["--node", "worker@another-pod", "-Q", ",".join(queues)]) == 1
    capacity.withdraw(redis_client, SCOPE, node, queues)  # warm shutdown
    assert health.main(argv) == 1


def test_the_default_node_and_queue_are_the_workers_own(
    env: None, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    queue = f"health-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("CELERY_DEFAULT_QUEUE", queue)
    try:
        assert health.main([]) == 1
        capacity.advertise(redis_client, SCOPE, health.default_node(), [queue], 4)  # -n worker@%h
        assert health.main([]) == 0
    finally:
        drop_adverts(redis_client, SCOPE, queue)


def test_redis_down_is_not_ready_and_bad_settings_exit_2(
    env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://:hunter2@127.0.0.1:9/0")
    assert health.main(["--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "Redis did not answer" in err and "hunter2" not in err
    monkeypatch.setenv("STORE_TIMEOUT_S", "-1")
    assert health.main([]) == 2


def test_nothing_naming_the_deployment_is_a_configuration_error_not_a_redis_one(
    env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGENT_LIGHTNING_STORE_URL")  # no Store, no 1.0 gateway, no REDIS_KEY_SCOPE: no key scope
    assert health.main([]) == 2
    err = capsys.readouterr().err
    assert "AGENT_LIGHTNING_STORE_URL" in err and "Redis did not answer" not in err
