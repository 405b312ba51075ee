"""Process helpers of the tools: ports, readiness, teardown, process-tree readings, and the bridge's probe."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bridge.core.coordination import keys
from bridge_lab import reaper
from bridge_lab.bench import metrics
from bridge_lab.procs import ManagedProcess, StackError, free_port, http_ok, serving, stop_all
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import TEST_REDIS_URL, process_alive, wait_for

ROOT = Path(__file__).resolve().parents[2]
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


# A starter that starts a child whose own child shares its process group (as a Celery worker's pool does), prints
# both pids, then waits to be killed. SIGINT arrives ignored, as it does in a CI runner's background job.
_STARTER = """
import sys, time
from pathlib import Path
from bridge_lab.procs import ManagedProcess
code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
code += "print(c.pid, flush=True); time.sleep(600)"
child = ManagedProcess("child", [sys.executable, "-c", code], Path(sys.argv[1]), lambda: True)
child.start()
log = Path(sys.argv[1])
while not log.read_text().strip():
    time.sleep(0.05)
print(child.pid, log.read_text().strip(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_a_starter_that_dies_without_its_teardown_takes_its_childrens_whole_group_with_it(
    signum: int, tmp_path: Path
) -> None:
    """However the starter ends (SIGKILL: no teardown runs; SIGTERM and SIGHUP with Python's defaults: none either),
    its reaper (``bridge_lab.reaper``) kills the group it started, grandchildren included, within its grace."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert starter.stdout is not None
        pids = [int(p) for p in starter.stdout.readline().split()]
        assert len(pids) == 2 and all(process_alive(pid) for pid in pids)
        starter.send_signal(signum)
        starter.wait(timeout=10)
        wait_for(lambda: not any(process_alive(pid) for pid in pids), reaper.GRACE_S + 5, "the child's group gone")
    finally:
        starter.kill()
        starter.wait()


def test_a_group_number_another_process_was_given_since_is_never_signalled() -> None:
    """pids are reused (32,768 on this machine class; a test run goes round): a number whose process started at
    another time than the one recorded is not ours, and neither the reaper nor a stop signals it."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True) as child:
        started = reaper.start_time(child.pid)
        assert started is not None and reaper.ours(child.pid, started)
        assert not reaper.ours(child.pid, started - 1)  # as if the number had been given to a later process
        reaper.reap({child.pid: started - 1}, grace_s=0.2)
        assert child.poll() is None  # not signalled
        reaper.reap({child.pid: started}, grace_s=1)  # it stays a zombie (ours to reap) through the grace
        assert child.wait(timeout=5) == -signal.SIGTERM
    assert reaper.start_time(child.pid) is None and reaper.ours(child.pid, started)  # gone: its stragglers are ours


def test_stop_all_stops_processes_together_within_the_bound_and_kills_one_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
    stubborn += "time.sleep(600)"
    argv = [sys.executable, "-c", stubborn]
    processes = [ManagedProcess(f"p{i}", argv, tmp_path / f"p{i}.log", lambda: True) for i in range(3)]
    for process in processes:
        process.start()
    wait_for(lambda: all("up" in p.tail() for p in processes), 30, "three processes ignoring SIGTERM")
    heard: list[str] = []
    started = time.monotonic()
    stop_all(processes, timeout_s=2.0, say=heard.append)
    took = time.monotonic() - started
    assert not any(p.alive() for p in processes)
    assert 2.0 <= took < 5.0, took  # one bound for all three, not three in a row
    assert any("did not stop within 2s of SIGTERM; killing it" in line for line in heard), heard


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
