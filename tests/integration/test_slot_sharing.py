"""One worker pool serving a 0.3 Store (``python -m bridge``) and a 1.0 gateway (``python -m bridge v1``) at once,
with real parts: an ``agl store``, 1.0's ``agl-server`` and trainer client (``bridge.tools.agl_v1_env``), both
dispatchers and one ``celery`` worker of 4 slots. With both lines backlogged, each holds slots in proportion to
its weight (``bridge.core.slot_share``): neither starves, whichever line claimed the pool first.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import httpx
import pytest

from bridge.core import capacity, slot_share
from bridge.core.agl_v1 import GatewayClient, V1State
from bridge.core.coordination import coordination_client
from bridge.core.store import API
from bridge.tools.agl_v1_env import start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge.tools.procs import StackError, free_port
from bridge.tools.stack import LocalStack
from tests.helpers import enqueue, split_tasks, stack_for, wait_for
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(45)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-share-key"
SLOTS = 4
WINDOW_S = 15.0  # how long both lines are measured while both have rollouts waiting


def _store_waiting(store_url: str) -> int:
    response = httpx.get(
        f"{store_url}{API}/rollouts", params={"status_in": ["queuing", "requeuing"], "limit": 1}, timeout=30
    )
    return int(response.json()["total"])


def test_both_lines_backlogged_on_one_pool_share_its_slots_by_weight(clean_store: LocalStack, tmp_path: Path) -> None:
    try:
        venv = v1_virtualenv()
    except StackError as exc:
        missing(str(exc))
    port = free_port()
    env = {
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}",
        "AGL_V1_KEY": KEY,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=0, concurrency=SLOTS, pool="threads", extra_env=env)
    with stack:
        gateway_url = start_gateway(stack, venv, key=KEY, port=port)
        start_v1_dispatcher(stack, gateway_url, key=KEY)
        gateway = GatewayClient(gateway_url, key=KEY)
        client = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
        # The 0.3 backlog first and far longer than the window: before the share, the 0.3 bridge took every slot
        # (it wakes on each freed slot, the 1.0 dispatcher polls) and 1.0 waited until the Store's queue drained.
        enqueue(clean_store.store_url, split_tasks(80))
        env_map = {"TASK_SLEEP": "input.sleep", "TASK_REWARD": "input.reward"}
        config = {"timeout_seconds": 60, "local": {"agent_class": "tests.agl_v1_agents:SlowReward", "env_map": env_map}}
        task = {"sleep": 1.0, "reward": 0.5}
        # As 1.0's trainer enqueues them, more than the window can run.
        batch = [{"rollout_id": secrets.token_hex(16), "input": task, "is_train": True, "config": config}]
        gateway.create_rollouts([{**item, "rollout_id": secrets.token_hex(16)} for item in batch * 24])
        try:
            wait_for(lambda: bool(gateway.list_rollouts(V1State.QUEUING, limit=1)), 60, "1.0 rollouts queuing")
            stack.add_worker()
            held = {slot_share.V03: 0, slot_share.V1: 0}
            samples = 0
            first: dict[str, float] = {}
            started = time.monotonic()
            while time.monotonic() - started < WINDOW_S:
                lines = [slot_share.line_of(key) for key in capacity.inflight_ids(client, stack.scope, "rollouts")]
                assert len(lines) <= SLOTS, lines  # the slot accounting holds
                for line in held:
                    held[line] += lines.count(line)
                    if line in lines:
                        first.setdefault(line, time.monotonic() - started)
                samples += 1
                time.sleep(0.1)
            still_waiting = _store_waiting(clean_store.store_url), len(gateway.list_rollouts(V1State.QUEUING))
        finally:
            gateway.close()
            client.close()
    assert all(still_waiting), f"a backlog drained within the window: {still_waiting}"
    assert set(first) == set(held), f"a line never ran while both were backlogged: {first}"
    shares = {line: held[line] / sum(held.values()) for line in held}
    print(f"slot-seconds over {WINDOW_S:.0f}s: {held} ({samples} samples), shares {shares}, first start {first}")
    assert all(abs(share - 0.5) <= 0.25 * 0.5 for share in shares.values()), shares  # equal weights by default
