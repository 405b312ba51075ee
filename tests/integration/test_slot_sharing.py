"""One worker pool serving a 0.3 Store (``python -m bridge``) and a 1.0 gateway (``python -m bridge v1``) at once,
with real parts: the session's ``agl store``, 1.0's ``agl-server`` (``bridge_lab.agl_v1_env``), both dispatchers
and one ``celery`` worker of 4 slots, started once for the module. With both lines backlogged each holds slots in
proportion to its weight (``bridge.core.slot_share``); a SIGKILLed leader of either line is replaced by its hot
standby within 5 s (``bridge.dispatch.leader``). The tests run in this order: the standbys lead the second.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bridge.core import capacity, slot_share
from bridge.core.agl_v1 import GatewayClient, V1State
from bridge.core.coordination import coordination_client
from bridge.core.store import API
from bridge.dispatch import leader
from bridge_lab.agl_v1_env import start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge_lab.procs import ManagedProcess, StackError, free_port
from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished, enqueue, split_tasks, stack_for, wait_for
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(60)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-share-key"
SLOTS = 4
WINDOW_S = 15.0  # the longest both lines are measured (while both have rollouts waiting)


@dataclass
class Pool:
    stack: LocalStack
    gateway: GatewayClient
    client: redis.Redis

    def enqueue_v1(self, count: int, sleep_s: float = 1.0) -> None:
        """SlowReward rollouts on the gateway, as 1.0's trainer enqueues them."""
        local = {
            "agent_class": "tests.agl_v1_agents:SlowReward",
            "env_map": {"TASK_SLEEP": "input.sleep", "TASK_REWARD": "input.reward"},
        }
        item: dict[str, Any] = {"input": {"sleep": sleep_s, "reward": 0.5}, "is_train": True}
        item["config"] = {"timeout_seconds": 60, "local": local}
        self.gateway.create_rollouts([{**item, "rollout_id": secrets.token_hex(16)} for _ in range(count)])

    def lines_in_flight(self) -> list[str]:
        return [slot_share.line_of(key) for key in capacity.inflight_ids(self.client, self.stack.scope, "rollouts")]


@pytest.fixture(scope="module")
def pool(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    try:
        venv = v1_virtualenv()
    except StackError as exc:
        missing(str(exc))
    cancel_unfinished(services.store_url)  # as ``clean_store``: nothing of an earlier test's in the Store or Redis
    redis.Redis.from_url(services.broker_url).flushdb()
    port = free_port()
    env = {
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}",
        "AGL_V1_KEY": KEY,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_dir = tmp_path_factory.mktemp("slot-sharing")
    stack = stack_for(services, log_dir, workers=1, concurrency=SLOTS, pool="threads", extra_env=env)
    with stack:
        gateway_url = start_gateway(stack, venv, key=KEY, port=port)
        start_v1_dispatcher(stack, gateway_url, key=KEY)
        gateway = GatewayClient(gateway_url, key=KEY)
        client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
        try:
            yield Pool(stack, gateway, client)
        finally:
            gateway.close()
            client.close()
    while cancel_unfinished(services.store_url):  # a page at a time
        pass


def test_a_sigkilled_leader_of_either_line_is_replaced_within_5_s(pool: Pool, services: LocalStack) -> None:
    """From the SIGKILL to the standby's first publish, with work waiting and free slots. The standbys lead the
    module's next test."""
    stack = pool.stack
    standby = stack.spawn(
        "bridge-standby",
        [sys.executable, "-m", "bridge", "run"],
        lambda: "dispatching to queues" in (stack.log_dir / "bridge-standby.log").read_text(errors="replace"),
    )
    v1_standby = start_v1_dispatcher(stack, pool.gateway.base_url, key=KEY, name="v1-standby")
    time.sleep(2 * leader.LEADER_TTL_S)  # the leaders renew past a TTL; the standbys stand by
    assert _published(standby) == 0 and _published(v1_standby) == 0
    _kill(stack.process("bridge"))
    _kill(stack.process("v1-dispatcher"))
    killed = time.monotonic()
    enqueue(services.store_url, split_tasks(2))
    pool.enqueue_v1(1, sleep_s=0.1)
    took: dict[str, float] = {}
    while len(took) < 2 and time.monotonic() - killed < 20:
        for name, process in (("0.3 bridge", standby), ("1.0 dispatcher", v1_standby)):
            if name not in took and _published(process):
                took[name] = time.monotonic() - killed
        time.sleep(0.05)
    print(f"SIGKILL to the standby's first publish: {took}")
    assert set(took) == {"0.3 bridge", "1.0 dispatcher"}, took
    assert all(seconds < 5.0 for seconds in took.values()), took


def test_both_lines_backlogged_on_one_pool_share_its_slots_by_weight(pool: Pool, services: LocalStack) -> None:
    # The 0.3 backlog first, longer than the window, and the pool full of it when the 1.0 rollouts arrive: before
    # the share, the 0.3 bridge took every freed slot (it wakes on each, the 1.0 dispatcher polled every second)
    # and 1.0 waited until the Store's queue drained.
    enqueue(services.store_url, split_tasks(120))
    wait_for(lambda: pool.lines_in_flight().count(slot_share.V03) >= SLOTS, 60, "the pool full of 0.3 rollouts")
    pool.enqueue_v1(40)
    held = {slot_share.V03: 0, slot_share.V1: 0}
    first: dict[str, float] = {}
    samples, started, both_waiting = 0, time.monotonic(), True
    while both_waiting and time.monotonic() - started < WINDOW_S:  # only while both lines have rollouts waiting
        lines = pool.lines_in_flight()  # a claim race of the two dispatchers may exceed SLOTS for a moment
        for line in held:
            held[line] += lines.count(line)
            if line in lines:
                first.setdefault(line, time.monotonic() - started)
        samples += 1
        if samples % 10 == 0:
            both_waiting = _store_waiting(services.store_url) > 0 and bool(pool.gateway.list_rollouts(V1State.QUEUING))
        time.sleep(0.1)
    measured = time.monotonic() - started
    assert set(first) == set(held), f"a line never ran while both were backlogged: {first}"
    assert measured >= WINDOW_S / 3, f"a backlog drained after {measured:.1f}s: {held}"
    shares = {line: held[line] / sum(held.values()) for line in held}
    print(f"slot-seconds over {measured:.1f}s: {held} ({samples} samples), shares {shares}, first start {first}")
    assert all(abs(share - 0.5) <= 0.25 * 0.5 for share in shares.values()), shares  # equal weights by default


def _store_waiting(store_url: str) -> int:
    params: dict[str, Any] = {"status_in": ["queuing", "requeuing"], "limit": 1}
    return int(httpx.get(f"{store_url}{API}/rollouts", params=params, timeout=30).json()["total"])


def _published(process: ManagedProcess) -> int:
    return process.log_path.read_text(errors="replace").count("published to") if process.log_path.exists() else 0


def _kill(process: ManagedProcess) -> None:
    os.killpg(process.pid or 0, signal.SIGKILL)
    assert process.proc is not None
    process.proc.wait(10)
