"""Agent Lightning 1.0 on the Celery cluster (``python -m bridge v1``, ``workers.v1.attempt``), with real parts: 1.0's
own gateway (``agl-server``) and trainer client (``AglRolloutManager``) in a Python 3.12 virtualenv built by
``bridge_lab.agl_v1_env``, our dispatcher, real ``celery`` workers and the LLM stand-in (which returns token
ids). The agent programs are ``tests/agl_v1_agents.py``. The dispatcher and the workers run as a 1.0-only
deployment: no AGENT_LIGHTNING_STORE_URL, their Redis keys scoped by the gateway's URL (docs/agl-v1.md, "Without a
Store").
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from celery import Celery

from bridge.core.coordination import coordination_client, keys
from bridge.core.gateway import V1_TASK_NAME, GatewayClient, V1State, attempt_key
from bridge_lab.agl_v1_env import GATEWAY_MODEL, start_gateway, start_v1_dispatcher, train, v1_virtualenv
from bridge_lab.procs import ManagedProcess, StackError, free_port
from bridge_lab.stack import LocalStack
from tests.helpers import process_alive, program_alive, split_tasks, stack_for, wait_for
from tests.prerequisites import missing
from workers.agents import webshop_program
from workers.v1.environment import AGL_NAMES, BASE_NAMES, BASE_PREFIXES
from workers.v1.program_server import SERVER_MARKER

pytestmark = [pytest.mark.integration, pytest.mark.cost(110)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "agl-v1-test-key"
ASK = {"TASK_QUESTION": "input.question", "TASK_REWARD": "input.reward"}
SLOW = {"TASK_SLEEP": "input.sleep", "TASK_REWARD": "input.reward"}
WORKER_OPENAI_KEY = "sk-worker-only-openai-key"
WORKER_STORE_TOKEN = "worker-only-store-token"


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
        "AGL_V1_PASS_ENV": f"PYTHONPATH,{webshop_program.PASS_ENV}",
        # secrets the workers hold, which no agent program may see
        "OPENAI_API_KEY": WORKER_OPENAI_KEY,
        "AGENT_LIGHTNING_STORE_TOKEN": WORKER_STORE_TOKEN,
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
        # the box the program ran in, as the trainer reads it beside the rollout (docs/agl-v1.md, "Boxes")
        [box] = rollout["isolation"]
        assert box["kind"] == "box" and box["uid"] >= 2_000_000_000 and box["start"] == "warm", box
        assert box["pid_namespace"] is True and box["limits"]["processes"] == 512 and box["host"], box


def test_1_0_tasks_a_0_3_only_worker_receives_go_back_to_the_broker_and_run_once_on_the_1_0_worker(
    v1: V1Stack, services: LocalStack
) -> None:
    """A worker of the 0.3 line (a Store, no AGL_V1_SERVER_URL) on the same queue and key scope hands every 1.0 task
    back unstarted, naming the missing setting once in its log; each rollout runs once, on the 1.0 worker."""
    only_03 = ["env", "-u", "AGL_V1_SERVER_URL", "-u", "AGL_V1_KEY", f"AGENT_LIGHTNING_STORE_URL={services.store_url}"]
    wrong = v1.stack.add_worker(prefix=[*only_03, f"REDIS_KEY_SCOPE={v1.stack.scope}"])  # its slots count too
    try:
        started = time.monotonic()
        done = v1.train("AskAndReward", [{"question": f"{i}?", "reward": i / 8} for i in range(8)], ASK)
        took = time.monotonic() - started
    finally:
        wrong.stop()
        v1.stack.workers.remove(wrong)
        del v1.stack.processes[wrong.name]
    log = wrong.log_path.read_text(errors="replace")
    received = log.count(f"Task {V1_TASK_NAME}[")
    assert received >= 1, "the 0.3 worker was handed no 1.0 task: nothing was tried"
    assert log.count("hands each such task back to the broker") == 1, log[-3000:]
    assert "AGL_V1_SERVER_URL is not set" in log
    assert len(done) == 8
    for rollout in done:
        assert rollout["state"] == "succeeded" and rollout["reward"] == rollout["input"]["reward"], rollout
        assert rollout["attempts"] == ["0"] and v1.started_lines(rollout["rollout_id"]) == 1
    print(f"{received} deliveries to the 0.3 worker handed back; 8 rollouts in {took:.1f}s")


def test_the_webshop_agent_runs_as_a_1_0_program_and_the_trainer_gets_the_rewards_the_server_computed(
    v1: V1Stack,
) -> None:
    ledger = f"{v1.stack.webshop_url}/purchases"
    before = len(httpx.get(ledger, timeout=30).json()["items"])
    done = v1.train(webshop_program.AGENT_CLASS, split_tasks(6), webshop_program.ENV_MAP)
    assert {rollout["state"] for rollout in done} == {"succeeded"}, done
    assert all(len(rollout["triplets"]) >= 2 for rollout in done)  # one proxied LLM call per step, token ids kept
    assert all(r["model_versions"] and set(r["model_versions"]) == {0} for r in done)  # the version registered
    computed = [item["reward"] for item in httpx.get(ledger, timeout=30).json()["items"][before:]]
    earned = sorted(r["reward"] for r in done if r["reward"])
    assert earned == sorted(r for r in computed if r), (earned, computed)  # exactly the server's rewards


PAUSE_S = 16.0  # longer than the OpenAI SDK's two retries survive with 1.0's Retry-After of 5 s (about 10 s)
SDK_SURVIVES_S = 12.0


def test_the_webshop_agent_waits_out_a_weight_update_pause_and_each_call_keeps_its_model_version(
    v1: V1Stack,
) -> None:
    """As 1.0's trainer updates weights: the proxy paused (``/proxy/pause``) as the batch starts, so every program
    meets it; ``PAUSE_S`` after two rollouts run, the model registered again with the next version and the proxy
    resumed. Every rollout succeeds on its first attempt with the reward the WebShop server computed, programs that
    waited longer than the plain SDK survives among them, and every model call carries the version that served it
    (the new one: none was served before the update)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    gateway = GatewayClient(v1.gateway, key=KEY)
    moments: dict[str, float] = {}

    def post(path: str, body: Any = None) -> None:
        httpx.post(f"{v1.gateway}{path}", json=body, headers=headers, timeout=10).raise_for_status()

    def weight_update() -> None:
        wait_for(lambda: len(gateway.list_rollouts(V1State.RUNNING)) >= 2, 60, "programs running")
        time.sleep(PAUSE_S)
        post("/api/models", [{"model": GATEWAY_MODEL, "endpoint": v1.stack.llm_base_url, "version": 1}])
        post("/proxy/resume")
        moments["resumed"] = time.time()

    ledger = f"{v1.stack.webshop_url}/purchases"
    before = len(httpx.get(ledger, timeout=30).json()["items"])
    post("/proxy/pause", {"retry_after_seconds": 5, "reason": "weight update"})
    thread = threading.Thread(target=weight_update)
    thread.start()
    try:
        done = v1.train(webshop_program.AGENT_CLASS, split_tasks(6), webshop_program.ENV_MAP, timeout_s=120)
    finally:
        thread.join(90)
        post("/proxy/resume")  # whatever happened, the next tests find the proxy serving
        gateway.close()
    assert moments.get("resumed"), "the weight update did not happen"
    assert {rollout["state"] for rollout in done} == {"succeeded"}, done
    assert all(rollout["attempts"] == ["0"] for rollout in done), done  # nothing ran again
    computed = [item["reward"] for item in httpx.get(ledger, timeout=30).json()["items"][before:]]
    earned = sorted(r["reward"] for r in done if r["reward"])
    assert earned == sorted(r for r in computed if r), (earned, computed)
    versions = [rollout["model_versions"] for rollout in done]
    assert all(v and set(v) == {1} for v in versions), versions  # each call's own version, the one serving it
    waited = [r for r in done if r["running_at"] < moments["resumed"] - SDK_SURVIVES_S]
    assert len(waited) >= 2, f"fewer than 2 programs waited {SDK_SURVIVES_S:g}s or more: {done}"


def test_a_crashing_agent_fails_with_its_error(v1: V1Stack) -> None:
    [rollout] = v1.train("Crashing", [{"question": "q", "reward": 1.0}], ASK)
    assert rollout["state"] == "failed" and rollout["reward"] is None
    assert "exited with code 1" in rollout["error"] and "the agent broke on purpose" in rollout["error"]
    assert "about to fail" in rollout["error"]  # the program's own last lines


def test_a_program_past_its_disk_quota_fails_as_agent_naming_it_and_the_rollouts_beside_it_succeed(
    v1: V1Stack,
) -> None:
    """docs/agl-v1.md, "Boxes": the worker's default AGL_V1_PROGRAM_DISK_MB (64) on each box's directory, its cwd and
    TMPDIR together. Two programs write past it, in one or the other, among four that write half of it at once:
    each of the two fails with class agent naming the quota, the others post their exact rewards, and every
    attempt records its quota."""
    hogs = [{"fill_mb": 1000, "where": where, "reward": 1.0} for where in ("cwd", "tmp")]
    tasks: list[dict[str, Any]] = [*hogs, *({"fill_mb": 32, "where": "tmp", "reward": i / 8} for i in range(4))]
    fill = {"FILL_MB": "input.fill_mb", "FILL_WHERE": "input.where", "TASK_REWARD": "input.reward"}
    done = v1.train("Filler", tasks, fill)
    assert len(done) == 6
    for rollout in sorted(done, key=lambda r: -r["input"]["fill_mb"]):  # the two past the quota first
        if rollout["input"]["fill_mb"] == 1000:
            assert rollout["state"] == "failed" and rollout["reward"] is None, rollout
            assert "ran into its disk quota (AGL_V1_PROGRAM_DISK_MB=64" in rollout["error"], rollout["error"]
            assert "No space left on device" in rollout["error"] and "[failure class: agent]" in rollout["error"]
        else:
            assert rollout["state"] == "succeeded" and rollout["reward"] == rollout["input"]["reward"], rollout
        [box] = rollout["isolation"]
        assert box["disk_quota"] is True and box["limits"]["disk_bytes"] == 64 * 2**20, box
    assert v1.stack.workers[0].alive()  # the worker goes on


def test_a_sleeping_agent_fails_at_its_timeout_with_its_processes_gone(v1: V1Stack, outbox: Path) -> None:
    pid_file = outbox / "pids"
    started = time.monotonic()
    [rollout] = v1.train("Sleeping", [{"pid_file": str(pid_file)}], {"PID_FILE": "input.pid_file"}, timeout_s=10)
    assert rollout["state"] == "failed" and "timed out after 10s" in rollout["error"], rollout
    assert time.monotonic() - started < 60
    assert len(pid_file.read_text().split()) == 3  # the program, a child of its own, its uid: the whole box goes
    wait_for(lambda: not program_alive(pid_file), 10, "the agent's processes gone")


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


def assert_clean_environment(seen: dict[str, str], worker_env: dict[str, str], mapped: set[str]) -> None:
    """A program's environment: the base names the worker had, unchanged, its attempt's AGL_* and its env_map
    (``mapped``), HOME and TMPDIR of its box, and nothing else."""
    passed = {"PYTHONPATH", *webshop_program.PASS_ENV.split(",")}
    allowed = {n for n in worker_env if n in BASE_NAMES or n.startswith(BASE_PREFIXES) or n in passed}
    # Python itself sets LC_CTYPE in a C locale (PEP 538): the only name the program may add beside its box's
    box = {"HOME", "TMPDIR"}  # its own directory (docs/agl-v1.md, "Boxes")
    assert set(seen) - {"LC_CTYPE"} == (allowed | AGL_NAMES | box | mapped) - {"LC_CTYPE"}
    same = allowed - box
    assert {n: seen[n] for n in same if n in seen} == {n: worker_env[n] for n in same if n in seen}
    assert seen["TMPDIR"] == seen["HOME"] + "/tmp" and seen["HOME"] != worker_env.get("HOME", os.environ["HOME"])


def test_a_program_sees_only_the_allowed_environment_and_none_of_the_workers_secrets(v1: V1Stack, outbox: Path) -> None:
    dump = outbox / "env.json"
    [rollout] = v1.train(
        "DumpEnv", [{"path": str(dump), "reward": 0.25}], {"DUMP_FILE": "input.path", "TASK_REWARD": "input.reward"}
    )
    assert rollout["state"] == "succeeded" and rollout["reward"] == 0.25, rollout
    seen = json.loads(dump.read_text())
    [worker] = v1.stack.workers
    worker_env = worker.env or {}
    assert_clean_environment(seen, worker_env, {"DUMP_FILE", "TASK_REWARD"})
    secrets = {worker_env[n] for n in ("CELERY_BROKER_URL", "REDIS_URL", "AGL_V1_KEY", "AGL_V1_SERVER_URL")}
    secrets |= {WORKER_OPENAI_KEY, WORKER_STORE_TOKEN}
    assert not secrets & set(seen.values())  # AGL_KEY is its attempt's token, never the gateway's key
    assert seen["AGL_KEY"] != KEY and not seen["AGL_EVENT_URL"].startswith(v1.gateway)
    for name in ("REDIS_URL", "CELERY_BROKER_URL", "OPENAI_API_KEY", "AGENT_LIGHTNING_STORE_TOKEN", "AGL_V1_KEY"):
        assert name not in seen


def test_a_hostile_program_is_refused_all_but_its_own_rollout_and_the_gateway_shows_no_effect(
    v1: V1Stack, outbox: Path, tmp_path: Path
) -> None:
    """docs/agl-v1.md, "The attempt relay": the program holds a token of its attempt, not the gateway's key; the
    relay forwards its own model calls and events only, and the gateway refuses the token. The victim runs beside
    it and ends with its own reward. "Boxes": another program (``Inmate``) reads nothing of the worker, its program
    server or the victim's program, signals none of them, and reads no file of the worker's."""
    gateway = GatewayClient(v1.gateway, key=KEY)
    victim_config = {"local": {"agent_class": "tests.agl_v1_agents:SlowReward", "env_map": SLOW}, "timeout_seconds": 60}
    [victim] = gateway.create_rollouts([{"input": {"sleep": 8, "reward": 0.5}, "config": victim_config}])
    try:

        def victim_is(state: V1State) -> bool:
            current = gateway.get_rollout(victim.rollout_id)
            return current is not None and current.status.state == state

        wait_for(lambda: victim_is(V1State.RUNNING), 30, "the victim running")
        dump = outbox / "tries.json"
        task = {"path": str(dump), "victim": victim.rollout_id, "gateway": v1.gateway}
        [hostile] = v1.train(
            "Trespasser", [task], {"DUMP_FILE": "input.path", "VICTIM": "input.victim", "GATEWAY": "input.gateway"}
        )
        assert hostile["state"] == "succeeded" and hostile["reward"] == 0.125, hostile  # its own event passes
        tried = json.loads(dump.read_text())
        assert len(tried) == 15
        for name, answers in tried.items():
            for label, status in answers.items():
                if label.startswith("relay"):
                    assert status == 403, f"{name} through the relay ({label}): {status}"
                else:  # the gateway refuses the token (401), or has no such route (404/405)
                    assert status in (401, 404, 405), f"{name} at the gateway ({label}): {status}"
        wait_for(lambda: victim_is(V1State.SUCCEEDED), 60, "the victim finished")
        rewards = [e["data"]["value"] for e in gateway.events(victim.rollout_id, event_type="reward")]
        assert rewards == [0.5], rewards  # no reward but its own, nothing patched or deleted
        every = gateway.list_rollouts(*V1State)
        assert victim.rollout_id in {r.rollout_id for r in every}  # not deleted
        assert not [r for r in every if (r.config.local and r.config.local.agent_class) == "a:B"]  # none created
        pause = gateway.proxy_pause()
        assert pause is None or not pause.paused
        _an_inmate_reaches_nothing_of_the_worker(v1, outbox, tmp_path)
    finally:
        gateway.close()
    [after] = v1.train("AskAndReward", [{"question": "What is 3 + 3?", "reward": 0.75}], ASK)
    assert after["state"] == "succeeded" and after["reward"] == 0.75  # the model server is still the trainer's
    logs = "".join(log.read_text(errors="replace") for log in v1.stack.log_dir.glob("worker*.log"))
    assert "1.0 programs run in boxes: each as uid 2000000000 plus its pid" in logs  # what it runs under
    assert "PID and mount namespaces of their own" in logs


def test_an_env_map_that_redirects_agl_event_url_fails_as_input_and_the_trap_hears_nothing(v1: V1Stack) -> None:
    heard: list[str] = []

    class Trap(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            heard.append(f"{self.path} {self.headers.get('Authorization')}")
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    trap = ThreadingHTTPServer(("127.0.0.1", 0), Trap)
    threading.Thread(target=trap.serve_forever, daemon=True).start()
    try:
        steal = f"http://127.0.0.1:{trap.server_address[1]}/steal"
        [rollout] = v1.train("AskAndReward", [{"question": "q", "reward": 1.0}], {**ASK, "AGL_EVENT_URL": steal})
    finally:
        trap.shutdown()
        trap.server_close()
    assert rollout["state"] == "failed" and rollout["reward"] is None, rollout
    assert "env_map may not set AGL_EVENT_URL" in rollout["error"] and "(input)" in rollout["error"]
    assert heard == [] and v1.started_lines(rollout["rollout_id"]) == 0  # the program never started


def test_a_forged_message_runs_the_gateways_agent_class_never_the_messages(v1: V1Stack, outbox: Path) -> None:
    """A broker writer publishes a task for a real rollout naming another agent class: the worker runs what the
    gateway holds. The dispatcher is stopped meanwhile, so the forged delivery is the one that runs."""
    marker = outbox / "tattled"
    task = {"sleep": 0.0, "reward": 0.75, "marker": str(marker)}
    v1.stack.process("v1-dispatcher").stop()
    gateway = GatewayClient(v1.gateway, key=KEY)
    app = Celery(broker=v1.stack.broker_url)
    try:
        local = {"agent_class": "tests.agl_v1_agents:SlowReward", "env_map": SLOW}
        [created] = gateway.create_rollouts([{"input": task, "config": {"timeout_seconds": 60, "local": local}}])
        forged = created.model_dump(mode="json")
        forged["config"]["local"] = {
            "agent_class": "tests.agl_v1_agents:Tattletale",
            "env_map": {"MARKER_FILE": "input.marker"},
        }
        key = attempt_key(created.rollout_id, "0")
        app.send_task(
            V1_TASK_NAME,
            kwargs={"rollout": forged, "attempt_id": "0", "queue": "rollouts"},
            task_id=key,
            queue="rollouts",
        )

        def finished() -> bool:
            current = gateway.get_rollout(created.rollout_id)
            return current is not None and current.status.state in (V1State.SUCCEEDED, V1State.FAILED)

        wait_for(finished, 60, "the forged delivery to finish")
        current = gateway.get_rollout(created.rollout_id)
        assert current is not None and current.status.state == V1State.SUCCEEDED, current
        rewards = [e["data"]["value"] for e in gateway.events(created.rollout_id, event_type="reward")]
        assert rewards == [0.75] and not marker.exists()  # the gateway's SlowReward ran, Tattletale never did
    finally:
        app.close()
        gateway.close()
        start_v1_dispatcher(v1.stack, v1.gateway, key=KEY)


def _wait_for_more(log: Path, text: str, more: int, what: str) -> None:
    before = log.read_text(errors="replace").count(text)
    wait_for(lambda: log.read_text(errors="replace").count(text) >= before + more, 60, what)


def _kill(process: ManagedProcess) -> None:
    """SIGKILL the process group and reap it (a worker's agent programs, in sessions of their own, die through
    PR_SET_PDEATHSIG)."""
    assert process.alive(), f"{process.name} is not running"  # never killpg(0), which is this test run's own group
    process.kill()


def test_a_drained_worker_hands_over_and_the_rollout_succeeds_under_the_next_attempt_outside_the_rerun_budget(
    v1: V1Stack,
) -> None:
    """A worker drained (SIGTERM, ``WORKER_SHUTDOWN_GRACE_S``) mid-program: its hand-over record makes the dispatcher
    run each rollout again under attempt 1, which succeeds with its reward, although ``AGL_V1_MAX_RERUNS`` is 0:
    hand-overs are counted apart (``keys.v1_handovers``), never as re-runs of a lost worker."""
    config = v1.stack.config
    saved = dict(config.extra_env)
    config.extra_env.update(WORKER_SHUTDOWN_GRACE_S="8", AGL_V1_MAX_RERUNS="0")
    v1.stack.process("v1-dispatcher").stop()
    start_v1_dispatcher(v1.stack, v1.gateway, key=KEY)
    for old in list(v1.stack.workers):  # the next node started reads the grace: it is the one drained
        old.stop()
        v1.stack.workers.remove(old)
    drained = v1.stack.add_worker()
    try:

        def drain_when_running() -> None:
            _wait_for_more(drained.log_path, "started tests.agl_v1_agents:SlowReward", 2, "2 programs running")
            drained.signal(signal.SIGTERM)  # the main process only, as Kubernetes does
            assert drained.proc is not None
            drained.proc.wait(30)
            v1.stack.workers.remove(drained)
            v1.stack.add_worker()

        tasks = [{"sleep": 8.0, "reward": 0.3 + 0.1 * i} for i in range(2)]
        done = v1.train_during(drain_when_running, "SlowReward", tasks)
        assert "handed over" in drained.log_path.read_text(errors="replace")
        assert len(done) == 2
        client = coordination_client(v1.stack.redis_url or v1.stack.broker_url)
        for rollout in done:
            assert rollout["state"] == "succeeded", rollout
            assert rollout["attempts"] == ["1"], rollout  # the trainer reads the re-run's events only
            assert rollout["reward"] == rollout["input"]["reward"] and rollout["reward_events"] == 1, rollout
            assert client.smembers(keys.v1_handovers(v1.stack.scope, rollout["rollout_id"])) == {"0"}
            assert v1.started_lines(rollout["rollout_id"]) == 2  # attempt 0, handed over; attempt 1
    finally:
        config.extra_env.clear()
        config.extra_env.update(saved)
        v1.stack.process("v1-dispatcher").stop()
        start_v1_dispatcher(v1.stack, v1.gateway, key=KEY)


# --- warm starts (workers/v1/launch.py): the node's program server under both pools -------------------------


def _an_inmate_reaches_nothing_of_the_worker(v1: V1Stack, outbox: Path, tmp_path: Path) -> None:
    [worker] = v1.stack.workers
    server = _program_server(worker)
    secret = tmp_path / "worker.env"
    secret.write_text(f"OPENAI_API_KEY={WORKER_OPENAI_KEY}\n")
    secret.chmod(0o600)
    targets = {"worker": worker.pid, "server": server.pid if server else 0}
    task = {"facts": str(outbox / "inmate.json"), "targets": json.dumps(targets), "secret": str(secret)}
    env_map = {"FACTS_FILE": "input.facts", "TARGETS": "input.targets", "SECRET_FILE": "input.secret"}
    [inmate] = v1.train("Inmate", [{**task, "outside": str(tmp_path)}], {**env_map, "OUTSIDE_DIR": "input.outside"})
    assert inmate["state"] == "succeeded", inmate
    facts = json.loads((outbox / "inmate.json").read_text())
    assert facts["uid"] >= 2_000_000_000 and int(facts["status"]["CapEff"][0], 16) == 0
    # The worker runs as root here: the program has PID and mount namespaces of its own, and no other process
    # exists for it (the gateway's command line holds its key: agl-server takes it as an argument).
    assert facts["seen"] == 0 and facts["read"] == [] and facts["shown"] == []
    assert set(facts["signalled"].values()) == {"gone"} and set(facts["traced"].values()) == {"ESRCH"}
    assert facts["secret"] == "EACCES" and facts["outside"] == "EACCES" and facts["setuid_0"] == "EPERM"


def _program_server(worker: ManagedProcess) -> psutil.Process | None:
    """The worker node's program server (a child of its main process), or None while there is none."""
    servers = []
    for child in psutil.Process(worker.pid or 0).children():
        try:
            if SERVER_MARKER in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                servers.append(child)
        except psutil.Error:  # gone, or a zombie not reaped yet
            continue
    assert len(servers) <= 1, servers
    return servers[0] if servers else None


def test_a_program_server_killed_mid_run_fails_its_rollout_as_a_lost_program_and_a_new_server_runs_the_next(
    v1: V1Stack,
) -> None:
    [worker] = v1.stack.workers
    assert "1.0 program server ready" in worker.log_path.read_text(errors="replace")  # the threads pool starts warm
    old = _program_server(worker)
    assert old is not None

    def kill_server_when_running() -> None:
        _wait_for_more(worker.log_path, "started tests.agl_v1_agents:SlowReward", 1, "the program running")
        old.send_signal(signal.SIGKILL)

    [lost] = v1.train_during(kill_server_when_running, "SlowReward", [{"sleep": 8.0, "reward": 0.5}])
    assert lost["state"] == "failed" and lost["reward"] is None, lost
    assert "program server died" in lost["error"] and "[failure class: infra]" in lost["error"], lost
    assert v1.started_lines(lost["rollout_id"]) == 1  # a lost program is reported, never re-run as a lost worker
    assert process_alive(worker.pid or 0)
    wait_for(lambda: getattr(_program_server(worker), "pid", old.pid) != old.pid, 60, "a new program server")
    [ok] = v1.train("AskAndReward", [{"question": "q", "reward": 0.5}], ASK)
    assert ok["state"] == "succeeded" and ok["reward"] == 0.5, ok
    assert "started tests.agl_v1_agents:AskAndReward (pid" in worker.log_path.read_text(errors="replace")
    assert "cold start)" not in worker.log_path.read_text(errors="replace")


def test_under_prefork_warm_programs_crash_time_out_with_their_group_and_see_the_clean_environment(
    v1: V1Stack, outbox: Path
) -> None:
    """Pool processes connect to the one server their main process started: a crashing program's output, a
    sleeping program killed at its deadline with its child, and the environment a program sees."""
    for old in list(v1.stack.workers):
        old.stop()
        v1.stack.workers.remove(old)
    worker = v1.stack.add_worker(pool="prefork", concurrency=2)
    try:
        assert "1.0 program server ready" in worker.log_path.read_text(errors="replace")
        server = _program_server(worker)
        assert server is not None
        [crashed] = v1.train("Crashing", [{"question": "q", "reward": 1.0}], ASK)
        assert crashed["state"] == "failed" and "exited with code 1" in crashed["error"], crashed
        assert "about to fail" in crashed["error"] and "the agent broke on purpose" in crashed["error"]
        pid_file = outbox / "pids"
        [slept] = v1.train("Sleeping", [{"pid_file": str(pid_file)}], {"PID_FILE": "input.pid_file"}, timeout_s=8)
        assert slept["state"] == "failed" and "timed out after 8s" in slept["error"], slept
        wait_for(lambda: not program_alive(pid_file), 10, "the agent's processes gone")
        dump = outbox / "env.json"
        [dumped] = v1.train(
            "DumpEnv", [{"path": str(dump), "reward": 0.25}], {"DUMP_FILE": "input.path", "TASK_REWARD": "input.reward"}
        )
        assert dumped["state"] == "succeeded", dumped
        assert_clean_environment(json.loads(dump.read_text()), worker.env or {}, {"DUMP_FILE", "TASK_REWARD"})
        assert getattr(_program_server(worker), "pid", None) == server.pid  # one server served every pool process
        log = worker.log_path.read_text(errors="replace")
        assert log.count("warm start, boxed as uid") == 3 and "cold start" not in log
    finally:
        worker.stop()
        v1.stack.workers.remove(worker)
        v1.stack.add_worker()
