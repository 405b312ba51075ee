"""Process helpers of the tools: ports, readiness, teardown, process-tree readings, and the bridge's probe."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bridge.core import keys
from bridge_lab.bench import metrics
from bridge_lab.procs import ManagedProcess, StackError, free_port, http_ok, serving
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import TEST_REDIS_URL

STORE_URL = "http://store.test:4747"  # never contacted: it only names the stacks' deployment (their key scope)
SCOPE = keys.store_scope(STORE_URL)
OTHER_SCOPE = keys.store_scope("http://other-store.test:4747")  # another deployment on the same Redis


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_serving_waits_for_health_and_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with serving("http", argv, f"http://127.0.0.1:{port}/", timeout_s=30, log_dir=tmp_path) as server:
        assert server.alive() and http_ok(f"http://127.0.0.1:{port}/")
    assert not server.alive()


def test_a_process_that_exits_while_starting_fails_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    process = ManagedProcess("bad", argv, tmp_path / "bad.log", lambda: False, startup_timeout_s=10)
    process.start()
    with pytest.raises(StackError, match="exited with code 3") as raised:
        process.wait_healthy()
    assert "boom" in str(raised.value)


def test_process_tree_readings_include_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in metrics.tree([os.getpid()])
        assert metrics.rss_mb(child.pid) > 0 and metrics.tree([0]) == []
        assert metrics.tree_cpu_seconds([child.pid]) < 5.0  # a sleeping child has used next to no CPU
    finally:
        child.kill()
        child.wait()
    assert metrics.rss_mb(child.pid) == 0.0 and metrics.cpu_seconds(child.pid) == 0.0


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(TEST_REDIS_URL, socket_timeout=5)
    conn.delete(keys.bridge_leader(SCOPE), keys.bridge_leader(OTHER_SCOPE))
    yield conn
    conn.delete(keys.bridge_leader(SCOPE), keys.bridge_leader(OTHER_SCOPE))
    conn.close()


def test_bridge_is_up_once_the_leader_lock_changes_hands(client: redis.Redis, tmp_path: Path) -> None:
    stack: Any = LocalStack(StackConfig(store_url=STORE_URL, broker_url=TEST_REDIS_URL, log_dir=tmp_path))
    client.set(keys.bridge_leader(SCOPE), "celery-bridge:old")  # a killed bridge's lock, not yet lapsed
    probe = stack._leader_changed_hands()
    assert not probe()
    client.delete(keys.bridge_leader(SCOPE))
    assert not probe()
    client.set(keys.bridge_leader(OTHER_SCOPE), "celery-bridge:theirs")
    assert not probe()  # another Store's bridge on the same Redis leads its own deployment
    client.set(keys.bridge_leader(SCOPE), "celery-bridge:new")
    assert probe()


def test_a_worker_is_up_once_it_advertises_slots(client: redis.Redis, tmp_path: Path) -> None:
    stack: Any = LocalStack(StackConfig(store_url=STORE_URL, broker_url=TEST_REDIS_URL, log_dir=tmp_path))
    worker = f"unit{time.monotonic_ns()}@host"
    assert not stack._worker_advertised(worker)
    client.set(keys.capacity(SCOPE, "rollouts", worker), 4, ex=30)
    try:
        assert stack._worker_advertised(worker)
    finally:
        client.delete(keys.capacity(SCOPE, "rollouts", worker))
