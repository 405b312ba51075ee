"""Any LitAgent on the workers, end to end: real ``celery -A workers worker`` processes started with
``AGENT=tests.agents_for_tests:...``, the real ``agl store``, Redis, the bridge and the LLM stand-in.

Each agent computes its reward from the rollout's input, so every test knows the reward each rollout must
come back with, and reads it back the way a trainer does: from the stored spans through Agent Lightning's
``TracerTraceToTriplet``, token ids included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from bridge.core.coordination import coordination_client, keys
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.core.task import TASK_NAME, soft_time_limit, task_kwargs
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, cancel_unfinished, enqueue, spans, stack_for, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(120)]

AGENTS = "tests.agents_for_tests"
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90


@dataclass(frozen=True)
class AgentNode:
    """What a test's worker node runs: ``AGENT`` (a name in tests.agents_for_tests), its pool and hooks, the tracer,
    and whether a bridge feeds it (without one, the test plays the bridge)."""

    agent: str
    pool: str = "prefork"
    hooks: str = ""
    tracer: str = "otel"
    bridge: bool = True


class AgentStacks:
    """The module's one running worker node (and bridge): kept while consecutive tests ask for the same
    ``AgentNode``, replaced when one asks for another.

    Every node shares the session's Store queue and broker database, so two at once would take each other's
    rollouts: starting one stops the last. A worker with ``AGENT=`` set pays Agent Lightning's import (about
    9 s of CPU), so tests are ordered to share nodes (one ``ReturnsAsToldAgent`` node serves every return kind).
    """

    def __init__(self, services: LocalStack, log_dir: Path) -> None:
        self.services, self.log_dir = services, log_dir
        self.node: AgentNode | None = None
        self.stack: LocalStack | None = None
        self.started = 0

    def get(self, node: AgentNode) -> LocalStack:
        if self.stack is not None and node == self.node:
            return self.stack
        self.stop()
        cancel_unfinished(self.services.store_url)
        redis.Redis.from_url(self.services.broker_url).flushdb()
        env = {"AGENT": f"{AGENTS}:{node.agent}", "AGENT_HOOKS": node.hooks, "AGENT_TRACER": node.tracer}
        env.update(LLM_RETURN_TOKEN_IDS="true", LOG_LEVEL="INFO")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # tests.*
        self.started += 1
        log_dir = self.log_dir / f"{self.started:02d}-{node.agent}-{node.pool}"
        stack = stack_for(
            self.services, log_dir, workers=1, concurrency=2, pool=node.pool, bridge=node.bridge, extra_env=env
        )
        stack.start()
        self.node, self.stack = node, stack
        return stack

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            cancel_unfinished(self.services.store_url)
        self.node = self.stack = None


@pytest.fixture(scope="module")
def agent_stacks(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentStacks]:
    stacks = AgentStacks(services, tmp_path_factory.mktemp("agents"))
    yield stacks
    stacks.stop()


@pytest.fixture
def agent_stack(agent_stacks: AgentStacks, request: pytest.FixtureRequest) -> LocalStack:
    """The worker node (and bridge) the test's ``AgentNode`` parameter names."""
    node = request.param
    assert isinstance(node, AgentNode)
    return agent_stacks.get(node)


TOLD = AgentNode("ReturnsAsToldAgent")  # every return kind, chosen by the rollout's input
ASYNC_PREFORK = AgentNode("AsyncAgent")
ASYNC_THREADS = AgentNode("AsyncAgent", pool="threads")


def _triplets(store_url: str, rollout_id: str) -> list[Any]:
    from agentlightning import Span
    from agentlightning.adapter import TracerTraceToTriplet

    stored = [Span.model_validate(item) for item in spans(store_url, rollout_id)]
    return TracerTraceToTriplet(llm_call_match=r"openai\.chat\.completion").adapt(stored)


def _run(
    stack: LocalStack, rewards: list[float], mode: str = "test", returns: str = "float"
) -> dict[str, dict[str, Any]]:
    """Enqueue one rollout per reward (its input tells ``ReturnsAsToldAgent`` how to return) and wait for them."""
    inputs = [{"question": f"What is {i} + {i}?", "reward": r, "returns": returns} for i, r in enumerate(rewards)]
    ids = enqueue(stack.store_url, inputs, mode=mode)
    final = wait_finished(stack.store_url, ids, timeout_s=WAIT_S)
    return {rid: {**view, "expected": r} for (rid, view), r in zip(final.items(), rewards, strict=True)}


# Tests run in this order, so each node starts once: the async ones, then the ReturnsAsToldAgent node for as many
# tests as it serves, then the nodes of one test each.
RETURN_KINDS = [
    pytest.param(ASYNC_PREFORK, "float", id="async-prefork"),
    pytest.param(ASYNC_THREADS, "float", id="async-threads"),
    pytest.param(TOLD, "float", id="float"),
    pytest.param(TOLD, "int", id="int"),
    pytest.param(TOLD, "emit", id="none-with-tracer"),
]


@pytest.mark.parametrize(("agent_stack", "returns"), RETURN_KINDS, indirect=["agent_stack"])
def test_agent_calls_are_spans_and_the_adapter_recovers_reward_and_token_ids(
    agent_stack: LocalStack, returns: str
) -> None:
    """The agent's own openai SDK call is an ``openai.chat.completion`` span with the stand-in's token ids,
    and its reward (returned, or emitted through ``agl.emit_reward``) is the reward span after it."""
    rewards = [0.25, 0.5, 1.0, 0.0]
    final = _run(agent_stack, rewards, mode="train", returns=returns)
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "succeeded", (rid, meta)
        expected = 1.0 if returns == "int" else view["expected"]  # an int result is converted to a float reward
        assert meta["reward"] == expected and meta["llm_calls"] == 1, meta
        stored = spans(agent_stack.store_url, rid)
        names = [s["name"] for s in stored]
        assert names.index("openai.chat.completion") < names.index("agentlightning.annotation"), names
        assert meta["spans_exported"] == len(stored)
        [triplet] = _triplets(agent_stack.store_url, rid)
        assert triplet.reward == expected
        assert triplet.prompt["token_ids"] and triplet.response["token_ids"]


@pytest.mark.parametrize(
    ("agent_stack", "returns"),
    [
        pytest.param(TOLD, "readable-spans", id="readable-spans"),
        pytest.param(TOLD, "agl-spans", id="agl-spans"),
    ],
    indirect=["agent_stack"],
)
def test_returned_spans_are_the_trace(agent_stack: LocalStack, returns: str) -> None:
    """A returned list of OpenTelemetry or Agent Lightning spans is filed under the attempt as the trace."""
    final = _run(agent_stack, [0.75, 0.5], returns=returns)
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "succeeded", (rid, meta)
        assert meta["result_kind"] == "spans" and meta["spans_returned"] == 3 and meta["reward"] == view["expected"]
        names = {s["name"] for s in spans(agent_stack.store_url, rid)}
        assert {"agent.own.root", "openai.chat.completion", "agentlightning.annotation", "agent.rollout"} <= names
        [triplet] = _triplets(agent_stack.store_url, rid)
        assert triplet.reward == view["expected"]
        assert triplet.prompt["token_ids"] == [11, 12, 13] and triplet.response["token_ids"] == [21, 22]


@pytest.mark.parametrize(
    ("agent_stack", "returns", "named"),
    [
        pytest.param(TOLD, "raise", "ValueError: deliberate failure", id="raises"),
        pytest.param(TOLD, "string", "the agent returned str", id="returns-a-string"),
    ],
    indirect=["agent_stack"],
)
def test_an_agent_failure_fails_the_attempt_with_class_agent(agent_stack: LocalStack, returns: str, named: str) -> None:
    final = _run(agent_stack, [0.5, 0.5], returns=returns)
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "failed", (rid, view)
        assert meta["failure_class"] == "agent" and named in meta["error"], meta
        if named.startswith("ValueError"):
            # Nothing lost: the LLM call the agent made before raising is in the attempt.
            assert "openai.chat.completion" in {s["name"] for s in spans(agent_stack.store_url, rid)}


@pytest.mark.parametrize(
    ("agent_stack", "value", "returns"),
    [
        pytest.param(TOLD, "nan", "float", id="returns-nan"),
        pytest.param(TOLD, "numpy-nan", "float", id="returns-numpy-nan"),
        pytest.param(TOLD, "-inf", "float", id="returns-minus-inf"),
        pytest.param(TOLD, "inf", "emit", id="emits-inf"),
        pytest.param(ASYNC_THREADS, "nan", "float", id="async-threads-returns-nan"),
    ],
    indirect=["agent_stack"],
)
def test_a_non_finite_reward_fails_the_attempt_at_once_with_class_agent(
    agent_stack: LocalStack, value: str, returns: str
) -> None:
    """NaN or infinity (``np.mean([])`` gives one) fails the attempt at its end, naming the value, in one
    attempt: never reported as a reward, never left to the Store's watchdog, never re-published. The worker
    goes on: a finite reward after it succeeds."""
    bad_reward = value.removeprefix("numpy-")
    task = {"question": "What is 1 + 1?", "reward": bad_reward, "numpy": value.startswith("numpy"), "returns": returns}
    ids = enqueue(agent_stack.store_url, [task, {"question": "What is 2 + 2?", "reward": 0.5, "returns": returns}])
    final = wait_finished(agent_stack.store_url, ids, timeout_s=WAIT_S)
    bad, good = (final[rid] for rid in ids)
    meta = bad["attempt"]["metadata"]
    assert bad["status"] == "failed" and meta["failure_class"] == "agent", (bad, meta)
    assert "non-finite reward" in meta["error"] and bad_reward in meta["error"], meta
    assert [a["status"] for a in attempts(agent_stack.store_url, ids[0])] == ["failed"]
    assert "reward" not in meta
    assert good["status"] == "succeeded" and good["attempt"]["metadata"]["reward"] == 0.5


def test_a_raising_hook_is_logged_and_the_rollout_succeeds(agent_stacks: AgentStacks) -> None:
    """Hooks run in Agent Lightning's order; one that raises in every method loses nothing."""
    hooks = f"{AGENTS}:RaisingHook,{AGENTS}:AnnotatingHook"
    stack = agent_stacks.get(AgentNode("FloatAgent", hooks=hooks))
    final = _run(stack, [0.5, 1.0])
    log = stack.workers[0].log_path.read_text(errors="replace")
    for rid, view in final.items():
        assert view["status"] == "succeeded" and view["attempt"]["metadata"]["reward"] == view["expected"], view
        names = [s["name"] for s in spans(stack.store_url, rid)]
        assert (
            names.index("hook.on_trace_start")
            < names.index("openai.chat.completion")
            < names.index("hook.on_trace_end")
        )
    for method in ("on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end"):
        assert f"hook RaisingHook.{method} raised; the rollout goes on" in log


def test_agentops_tracer_records_the_attempt_under_prefork(agent_stacks: AgentStacks) -> None:
    """AGENT_TRACER=agentops: Agent Lightning's AgentOps tracer records each attempt (its own ``openai``
    instrumentation, one LLM span per call: the worker adds none), and the trainer's adapter finds the
    reward whether the agent emitted it (None returned) or returned it (float)."""
    stack = agent_stacks.get(AgentNode("ReturnsAsToldAgent", hooks=f"{AGENTS}:AnnotatingHook", tracer="agentops"))
    final = {**_run(stack, [0.25, 0.75], mode="train", returns="emit"), **_run(stack, [0.5], mode="train")}
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "succeeded" and meta["reward"] == view["expected"], (rid, meta)
        names = [s["name"] for s in spans(stack.store_url, rid)]
        assert names.count("openai.chat.completion") == 1, names
        assert names.index("hook.on_trace_start") < names.index("openai.chat.completion"), names
        [triplet] = _triplets(stack.store_url, rid)
        assert triplet.reward == view["expected"]
        assert triplet.prompt["token_ids"] and triplet.response["token_ids"], triplet


@pytest.mark.nightly(
    "the refusal: tests/unit/test_agent_config.py; a real worker exiting 2 at a start-up error: test_entry_points.py"
)
def test_agentops_tracer_with_a_multi_slot_threads_pool_stops_the_worker(services: LocalStack) -> None:
    """One AgentOps trace per process: a pool running several attempts in one process is refused at start."""
    done = _start_worker_expecting_failure(services, ["-P", "threads", "-c", "2"], AGENT_TRACER="agentops")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "AGENT_TRACER=agentops traces one attempt per process" in done.stderr


@pytest.mark.nightly("the start-up checks that name the agent (test_dispatch.py, test_runner.py) run every time")
def test_a_message_for_another_agent_fails_with_class_agent_naming_both(agent_stacks: AgentStacks) -> None:
    """The worker compares the message's agent with its own (configured path or class path), imports nothing."""
    stack = agent_stacks.get(AgentNode("make_float_agent", bridge=False))
    client = coordination_client(stack.broker_url)
    [node] = client.scan_iter(match=keys.worker_agent(stack.scope, "*"))
    assert client.get(node) == f"{AGENTS}:FloatAgent"
    expected = ["webshop", f"{AGENTS}:AsyncAgent", f"{AGENTS}:FloatAgent", f"{AGENTS}:make_float_agent"]
    enqueue(stack.store_url, [{"question": "q", "reward": 0.5}] * len(expected))
    with StoreClient(stack.store_url) as store:
        dequeued = store.dequeue(len(expected), "test-litagent")  # this test plays the bridge
    app = Celery("test-litagent", broker=stack.broker_url)
    for item, agent in zip(dequeued, expected, strict=True):
        kwargs = task_kwargs(item, "rollouts", agent)
        app.send_task(TASK_NAME, kwargs=kwargs, task_id=item.attempt.attempt_id, queue="rollouts")
    final = wait_finished(stack.store_url, [d.rollout_id for d in dequeued], timeout_s=WAIT_S)
    views = [final[d.rollout_id] for d in dequeued]
    for view, agent in zip(views[:2], expected[:2], strict=True):
        meta = view["attempt"]["metadata"]
        assert view["status"] == "failed" and meta["failure_class"] == "agent", view
        assert repr(agent) in meta["error"] and f"{AGENTS}:make_float_agent" in meta["error"], meta["error"]
    assert [v["status"] for v in views[2:]] == ["succeeded", "succeeded"]


@pytest.mark.nightly("the wait a deadline abandons: tests/unit/test_abandonable_wait.py; prefork: test_stuck_agents.py")
def test_an_agent_that_never_returns_ends_at_its_deadline_under_threads(agent_stacks: AgentStacks) -> None:
    """Under ``-P threads`` Celery enforces no time limit: the agent's LLM calls carry the attempt's deadline."""
    timeout_s = 12
    soft_s = soft_time_limit(load_settings(store_url="http://127.0.0.1:1"), timeout_s)
    stack = agent_stacks.get(AgentNode("LoopingAgent", pool="threads"))
    [rid] = enqueue(stack.store_url, [{"question": "q"}], config={"max_attempts": 1, "timeout_seconds": timeout_s})
    wait_finished(stack.store_url, [rid], timeout_s=timeout_s + 30)
    attempt = attempts(stack.store_url, rid)[-1]
    meta = attempt.get("metadata") or {}
    assert attempt["status"] == "failed" and meta.get("failure_class") == "timeout", attempt
    assert float(attempt["end_time"]) - float(attempt["start_time"]) <= soft_s + 5.0
    assert "openai.chat.completion" in {s["name"] for s in spans(stack.store_url, rid)}
    agent_stacks.stop()  # the looping agent's thread is abandoned, not ended: the node goes with it


def _start_worker_expecting_failure(
    services: LocalStack, options: list[str], **settings: str
) -> subprocess.CompletedProcess[str]:
    """A worker started with ``settings`` (AGENT: FloatAgent unless given) that must stop by itself."""
    env = {**os.environ, "AGENT_LIGHTNING_STORE_URL": services.store_url, "CELERY_BROKER_URL": services.broker_url}
    env.update({"AGENT": f"{AGENTS}:FloatAgent", "PYTHONPATH": str(ROOT), **settings})
    celery = str(Path(sys.executable).with_name("celery"))
    argv = [celery, "-A", "workers", "worker", *options, "--without-gossip", "--without-mingle"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.nightly(
    "a path naming nothing: tests/unit/test_agent_config.py; a real worker exiting 2 at a start-up error: "
    "test_entry_points.py"
)
def test_an_agent_that_cannot_be_loaded_stops_the_worker_with_exit_code_2(services: LocalStack) -> None:
    done = _start_worker_expecting_failure(services, ["-c", "1"], AGENT=f"{AGENTS}:NoSuchAgent")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "has no attribute 'NoSuchAgent'" in done.stderr


def test_resources_reach_the_agent_as_agent_lightning_objects_with_the_proxy_routed_per_attempt() -> None:
    """In process (no worker): a ``proxy_llm`` becomes a plain ``LLM`` on this attempt's proxy URL, exactly as
    the WebShop loop addresses it; other resources pass as Agent Lightning objects."""
    from agentlightning import LLM, PromptTemplate

    from bridge.core.store import ResourcesUpdate
    from workers.agents.litagent import named_resources

    update = ResourcesUpdate.model_validate(
        {
            "resources_id": "rs-1",
            "resources": {
                "main_llm": {
                    "resource_type": "proxy_llm",
                    "endpoint": "http://proxy:4000/v1",
                    "model": "m",
                    "sampling_parameters": {"temperature": 0.5},
                },
                "prompt": {"resource_type": "prompt_template", "template": "Q: {q}", "engine": "f-string"},
            },
        }
    )
    named = named_resources(update, None, "ro-1", "at-2")
    llm = named["main_llm"]
    assert type(llm) is LLM and llm.model == "m" and llm.sampling_parameters == {"temperature": 0.5}
    assert llm.get_base_url() == "http://proxy:4000/rollout/ro-1/attempt/at-2/v1"
    assert isinstance(named["prompt"], PromptTemplate)
