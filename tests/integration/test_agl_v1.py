"""Agent Lightning 1.0 on the Celery cluster (``python -m bridge v1``, ``workers.v1_attempt``), with real parts: 1.0's
own gateway (``agl-server``) and trainer client (``AglRolloutManager``) in a Python 3.12 virtualenv built by
``bridge.tools.agl_v1_env``, our dispatcher, real ``celery`` workers and the LLM stand-in (which returns token
ids). The agent programs are ``tests/agl_v1_agents.py``. The dispatcher and the workers run as a 1.0-only
deployment: no AGENT_LIGHTNING_STORE_URL, their Redis keys scoped by the gateway's URL (docs/agl-v1.md, "Without a
Store").
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bridge.tools.agl_v1_env import start_gateway, start_v1_dispatcher, train, v1_virtualenv
from bridge.tools.procs import ManagedProcess, StackError, free_port
from bridge.tools.stack import LocalStack
from tests.helpers import process_alive, split_tasks, stack_for, wait_for
from tests.prerequisites import missing
from workers.agents import webshop_program

pytestmark = [pytest.mark.integration, pytest.mark.cost(90)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-test-key"
ASK = {"TASK_QUESTION": "input.question", "TASK_REWARD": "input.reward"}
SLOW = {"TASK_SLEEP": "input.sleep", "TASK_REWARD": "input.reward"}


@dataclass
class V1Stack:
    stack: LocalStack
    venv: Path
    gateway: str

    def train(
        self, agent: str, tasks: list[dict[str, Any]], env_map: dict[str, str], timeout_s: float = 60
    ) -> list[dict[str, Any]]:
        """1.0's trainer client: enqueue ``tasks`` for ``agent`` and wait until each is finished."""
        spec = {
            "gateway": self.gateway,
            "key": KEY,
            "model_endpoint": self.stack.llm_base_url,
            "agent_class": agent if ":" in agent else f"tests.agl_v1_agents:{agent}",
            "env_map": env_map,
            "timeout_s": timeout_s,
            "tasks": tasks,
        }
        return train(self.venv, spec)

    def train_during(self, fault: Callable[[], None], agent: str, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``train`` SlowReward-style tasks while ``fault`` runs beside it."""
        thread = threading.Thread(target=fault)
        thread.start()
        try:
            return self.train(agent, tasks, SLOW)
        finally:
            thread.join(60)

    def started_lines(self, rollout_id: str) -> int:
        """How many times a worker of the stack started this rollout's agent program."""
        needle = f"[v1 rollout={rollout_id} attempt="
        return sum(
            needle in line and "started tests.agl_v1_agents" in line
            for log in self.stack.log_dir.glob("worker*.log")
            for line in log.read_text(errors="replace").splitlines()
        )


@pytest.fixture(scope="module")
def v1(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[V1Stack]:
    try:
        venv = v1_virtualenv()
    except StackError as exc:
        missing(str(exc))
    port = free_port()
    env = {
        "HEARTBEAT_INTERVAL_S": "1",
        "LEASE_TTL_S": "4",
        "BRIDGE_RECONCILE_INTERVAL_S": "2",
        "BRIDGE_MAX_QUEUE_WAIT_S": "30",  # a message lost before it started is published again within this
        "AGL_V1_SERVER_URL": f"http://127.0.0.1:{port}",
        "AGL_V1_KEY": KEY,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_dir = tmp_path_factory.mktemp("agl-v1")
    stack = stack_for(
        services, log_dir, workers=0, concurrency=4, pool="threads", bridge=False, store=False, extra_env=env
    )
    with stack:
        gateway = start_gateway(stack, venv, key=KEY, port=port)
        stack.add_worker()
        start_v1_dispatcher(stack, gateway, key=KEY)
        yield V1Stack(stack, venv, gateway)


def test_every_rollout_succeeds_with_the_agents_reward_and_token_triplets_and_no_store(v1: V1Stack) -> None:
    dispatcher, [worker] = v1.stack.process("v1-dispatcher"), v1.stack.workers
    assert not any("AGENT_LIGHTNING_STORE_URL" in (p.env or {}) for p in (dispatcher, worker))
    assert "runs Agent Lightning 1.0 rollouts only" in worker.log_path.read_text(errors="replace")
    tasks = [{"question": f"What is {i} + {i}?", "reward": i / 8} for i in range(8)]
    done = v1.train("AskAndReward", tasks, ASK)
    assert len(done) == 8
    for rollout in done:
        assert rollout["state"] == "succeeded", rollout
        assert rollout["reward"] == rollout["input"]["reward"]  # exactly what the agent posted
        assert rollout["triplets"] and all(n > 0 for n in rollout["triplets"])  # the stand-in's token ids
        assert rollout["prompt_tokens"] and all(n > 0 for n in rollout["prompt_tokens"])
        assert rollout["attempts"] == ["0"] and rollout["reward_events"] == 1
        assert v1.started_lines(rollout["rollout_id"]) == 1


def test_the_webshop_agent_runs_as_a_1_0_program_and_the_trainer_gets_the_rewards_the_server_computed(
    v1: V1Stack,
) -> None:
    ledger = f"{v1.stack.webshop_url}/purchases"
    before = len(httpx.get(ledger, timeout=30).json()["items"])
    done = v1.train(webshop_program.AGENT_CLASS, split_tasks(6), webshop_program.ENV_MAP)
    assert {rollout["state"] for rollout in done} == {"succeeded"}, done
    assert all(len(rollout["triplets"]) >= 2 for rollout in done)  # one proxied LLM call per step, token ids kept
    computed = [item["reward"] for item in httpx.get(ledger, timeout=30).json()["items"][before:]]
    earned = sorted(r["reward"] for r in done if r["reward"])
    assert earned == sorted(r for r in computed if r), (earned, computed)  # exactly the server's rewards


def test_a_crashing_agent_fails_with_its_error(v1: V1Stack) -> None:
    [rollout] = v1.train("Crashing", [{"question": "q", "reward": 1.0}], ASK)
    assert rollout["state"] == "failed" and rollout["reward"] is None
    assert "exited with code 1" in rollout["error"] and "the agent broke on purpose" in rollout["error"]
    assert "about to fail" in rollout["error"]  # the program's own last lines


def test_a_sleeping_agent_fails_at_its_timeout_with_its_processes_gone(v1: V1Stack, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    [rollout] = v1.train("Sleeping", [{"pid_file": str(pid_file)}], {"PID_FILE": "input.pid_file"}, timeout_s=10)
    assert rollout["state"] == "failed" and "timed out after 10s" in rollout["error"], rollout
    assert time.monotonic() - started < 60
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2  # the program and a child of its own: the whole group goes
    wait_for(lambda: not any(process_alive(pid) for pid in pids), 10, "the agent's processes gone")


def test_a_dispatcher_killed_and_restarted_mid_run_loses_nothing_and_runs_nothing_twice(v1: V1Stack) -> None:
    dispatcher = v1.stack.process("v1-dispatcher")

    def kill_and_restart() -> None:
        _wait_for_more(dispatcher.log_path, "published to", 1, "the first publish")
        _kill(dispatcher)
        start_v1_dispatcher(v1.stack, v1.gateway, key=KEY)

    done = v1.train_during(kill_and_restart, "SlowReward", [{"sleep": 1.0, "reward": i / 10} for i in range(10)])
    assert len(done) == 10
    for rollout in done:
        assert rollout["state"] == "succeeded" and rollout["reward"] == rollout["input"]["reward"], rollout
        assert rollout["reward_events"] == 1 and v1.started_lines(rollout["rollout_id"]) == 1


def test_a_worker_killed_mid_run_runs_its_rollouts_again_once_under_a_new_attempt(v1: V1Stack) -> None:
    [worker] = v1.stack.workers

    def kill_when_running() -> None:
        _wait_for_more(worker.log_path, "started tests.agl_v1_agents:SlowReward", 3, "3 programs running")
        _kill(worker)
        v1.stack.workers.remove(worker)
        v1.stack.add_worker()

    done = v1.train_during(kill_when_running, "SlowReward", [{"sleep": 6.0, "reward": 0.1 * (i + 1)} for i in range(3)])
    assert len(done) == 3
    for rollout in done:
        assert rollout["state"] == "succeeded", rollout
        assert rollout["attempts"] == ["1"], rollout  # the trainer reads the re-run's events only
        assert rollout["reward"] == rollout["input"]["reward"] and rollout["reward_events"] == 1


def _wait_for_more(log: Path, text: str, more: int, what: str) -> None:
    before = log.read_text(errors="replace").count(text)
    wait_for(lambda: log.read_text(errors="replace").count(text) >= before + more, 60, what)


def _kill(process: ManagedProcess) -> None:
    """SIGKILL the process group and reap it (a worker's agent programs, in sessions of their own, die through
    PR_SET_PDEATHSIG)."""
    os.killpg(process.pid or 0, signal.SIGKILL)
    assert process.proc is not None
    process.proc.wait(10)
