"""One worker pool serving a 0.3 Store (``python -m bridge``) and a 1.0 gateway (``python -m bridge v1``) at once,
with real parts: the session's ``agl store``, 1.0's ``agl-server`` (``bridge_lab.agl_v1_env``), both dispatchers
(each serving /metrics) and one ``celery`` worker of 4 slots, started once for the module. Both leaders export the
queue's desired slots as in flight + both lines' waiting + held, the same figure
(``bridge.core.coordination.line_demand``), and ``status`` reads the gateway; with both lines backlogged each holds
slots in proportion to its weight (``bridge.core.coordination.slot_share``); a SIGKILLed leader of either line is
replaced by its hot standby within 5 s (``bridge.dispatch.leader``). The tests run in this order: the standbys lead the
third.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, slot_share
from bridge.core.gateway import GatewayClient, V1State
from bridge.core.store import API
from bridge.dispatch import leader
from bridge_lab.agl_v1_env import start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge_lab.procs import ManagedProcess, StackError, free_port
from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished, enqueue, line_of, metric_samples, split_tasks, stack_for, wait_for
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(70)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-share-key"
SLOTS = 4
WINDOW_S = 15.0  # the longest both lines are measured (while both have rollouts waiting)


@dataclass
class Pool:
    stack: LocalStack
    gateway: GatewayClient
    client: redis.Redis
    v1_metrics_url: str

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
        return [line_of(key) for key in capacity.inflight_ids(self.client, self.stack.scope, "rollouts")]


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
    stack = stack_for(
        services, log_dir, workers=1, concurrency=SLOTS, pool="threads", bridge_metrics_port=0, extra_env=env
    )
    with stack:
        gateway_url = start_gateway(stack, venv, key=KEY, port=port)
        v1_metrics_port = free_port()
        start_v1_dispatcher(stack, gateway_url, key=KEY, metrics_port=v1_metrics_port)
        gateway = GatewayClient(gateway_url, key=KEY)
        client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
        try:
            yield Pool(stack, gateway, client, f"http://127.0.0.1:{v1_metrics_port}/metrics")
        finally:
            gateway.close()
            client.close()
    while cancel_unfinished(services.store_url):  # a page at a time
        pass


def test_both_leaders_export_in_flight_and_both_lines_waiting_once_and_status_reads_the_gateway(
    pool: Pool, services: LocalStack
) -> None:
    """The pool full of 1.0 rollouts (long sleeps), two more queuing on the gateway and five 0.3 rollouts waiting in
    the Store: desired = 4 in flight + 2 + 5 (+ 0 held) on both leaders. Without the other line's backlog the 0.3
    bridge would say 9 and the 1.0 dispatcher 6; counting in flight per line would say 15."""
    pool.enqueue_v1(SLOTS + 2, sleep_s=120)
    wait_for(lambda: pool.lines_in_flight().count(slot_share.V1) == SLOTS, 60, "the pool full of 1.0 rollouts")
    enqueue(services.store_url, split_tasks(5))
    want = SLOTS + 2 + 5
    bridge_url = pool.stack.bridge_metrics_url
    assert bridge_url is not None
    try:
        v03 = _settled(bridge_url, want)
        v1 = _settled(pool.v1_metrics_url, want)
        report = _status(pool.stack.component_env())
    finally:
        _drain(pool, services)
    print(f"desired slots: 0.3 bridge {v03[DESIRED]}, 1.0 dispatcher {v1[DESIRED]}")
    assert v03['agl_bridge_store_waiting_rollouts{queue="rollouts"}'] == 5
    assert v03['agl_bridge_held_rollouts{queue="rollouts"}'] == 0
    assert v1['agl_bridge_gateway_waiting_rollouts{queue="rollouts"}'] == 2
    assert v1['agl_bridge_gateway_oldest_waiting_seconds{queue="rollouts"}'] > 0
    assert v03['agl_bridge_in_flight{queue="rollouts"}'] == v1['agl_bridge_in_flight{queue="rollouts"}'] == SLOTS
    assert v1['agl_bridge_is_leader{line="v1"}'] == 1 and v03['agl_bridge_is_leader{line="v03"}'] == 1
    assert v1['agl_bridge_published_total{line="v1",queue="rollouts"}'] == SLOTS
    gateway = report["gateway"]
    assert gateway["ok"] and gateway["queuing"] == 2 and gateway["running"] == SLOTS, gateway
    assert gateway["oldest_queuing_s"] > 0 and not gateway["queuing_capped"], gateway
    boxes = [worker.get("program_isolation") or "" for worker in report["workers"]]
    assert boxes and all(b.startswith("box: uid 2000000000+pid, no capabilities") for b in boxes), boxes

    down = {**pool.stack.component_env(), "AGL_V1_SERVER_URL": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "status", "--no-inspect"], env=down, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "DOES NOT ANSWER" in done.stdout, done.stdout + done.stderr


DESIRED = 'agl_bridge_desired_slots{queue="rollouts"}'


def _settled(url: str, want: float) -> dict[str, float]:
    """The samples at ``url`` once its desired slots read ``want`` (within 30 s)."""
    deadline = time.monotonic() + 30.0
    samples: dict[str, float] = {}
    while samples.get(DESIRED) != want and time.monotonic() < deadline:
        time.sleep(0.5)
        samples = metric_samples(url)
    assert samples.get(DESIRED) == want, {k: v for k, v in samples.items() if "{queue=" in k}
    return samples


def _status(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "status", "--json", "--no-inspect"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


def _drain(pool: Pool, services: LocalStack) -> None:
    """Nothing left for the next test: the 0.3 rollouts cancelled, the 1.0 ones failed (their workers stop the
    programs within a heartbeat), every slot free."""
    cancel_unfinished(services.store_url)
    for rollout in pool.gateway.list_rollouts(V1State.QUEUING, V1State.RUNNING):
        pool.gateway.finish(rollout.rollout_id, rollout.status.last_attempt_id or "0", V1State.FAILED, "test over")
    wait_for(lambda: not pool.lines_in_flight(), 60, "every slot free")


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
    assert process.alive(), f"{process.name} is not running"  # never killpg(0), which is this test run's own group
    process.kill()
