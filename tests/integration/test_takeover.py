"""A SIGKILLed leader is replaced by its hot standby within 5 s, for both dispatchers (``bridge.dispatch.leader``):
real processes, a 0.3 bridge and a 1.0 dispatcher each with a standby, over one worker, an ``agl store`` and 1.0's
``agl-server``. The time runs from the SIGKILL to the standby's first publish, work waiting meanwhile."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest

from bridge.core.agl_v1 import GatewayClient
from bridge.tools.agl_v1_env import start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge.tools.procs import ManagedProcess, StackError, free_port
from bridge.tools.stack import LocalStack
from tests.helpers import enqueue, split_tasks, stack_for
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(40)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-takeover-key"


def _published(process: ManagedProcess) -> int:
    return process.log_path.read_text(errors="replace").count("published to") if process.log_path.exists() else 0


def _kill(process: ManagedProcess) -> None:
    os.killpg(process.pid or 0, signal.SIGKILL)
    assert process.proc is not None
    process.proc.wait(10)


def test_a_sigkilled_leader_of_either_line_is_replaced_within_5_s(clean_store: LocalStack, tmp_path: Path) -> None:
    try:
        venv = v1_virtualenv()
    except StackError as exc:
        missing(str(exc))
    port = free_port()
    env = {
        "AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}",
        "AGL_V1_KEY": KEY,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    stack = stack_for(clean_store, tmp_path, workers=1, concurrency=4, pool="threads", extra_env=env)
    with stack:
        bridge = stack.process("bridge")
        bridge_log = bridge.log_path
        standby = stack.spawn(
            "bridge-standby",
            [sys.executable, "-m", "bridge", "run"],
            lambda: "dispatching to queues" in bridge_log.with_name("bridge-standby.log").read_text(errors="replace"),
        )
        gateway_url = start_gateway(stack, venv, key=KEY, port=port)
        v1_leader = start_v1_dispatcher(stack, gateway_url, key=KEY)
        v1_standby = start_v1_dispatcher(stack, gateway_url, key=KEY, name="v1-standby")
        time.sleep(5)  # both standbys have been told the lock is taken; the leaders renewed past a TTL
        assert _published(standby) == 0 and _published(v1_standby) == 0
        gateway = GatewayClient(gateway_url, key=KEY)
        local = {
            "agent_class": "tests.agl_v1_agents:SlowReward",
            "env_map": {"TASK_SLEEP": "input.sleep", "TASK_REWARD": "input.reward"},
        }
        try:
            _kill(bridge)
            _kill(v1_leader)
            killed = time.monotonic()
            enqueue(clean_store.store_url, split_tasks(2))
            gateway.create_rollouts(
                [
                    {
                        "rollout_id": secrets.token_hex(16),
                        "input": {"sleep": 0.1, "reward": 0.5},
                        "is_train": True,
                        "config": {"timeout_seconds": 60, "local": local},
                    }
                ]
            )
            took: dict[str, float] = {}
            while len(took) < 2 and time.monotonic() - killed < 20:
                for name, process in (("0.3 bridge", standby), ("1.0 dispatcher", v1_standby)):
                    if name not in took and _published(process):
                        took[name] = time.monotonic() - killed
                time.sleep(0.05)
        finally:
            gateway.close()
    print(f"SIGKILL to the standby's first publish: {took}")
    assert set(took) == {"0.3 bridge", "1.0 dispatcher"}, took
    assert all(seconds < 5.0 for seconds in took.values()), took
