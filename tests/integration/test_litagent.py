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
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from bridge.core import keys
from bridge.core.coordination import coordination_client
from bridge.core.message import TASK_NAME, task_kwargs
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.core.time_budget import soft_time_limit
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, cancel_unfinished, enqueue, spans, stack_for, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(300)]

AGENTS = "tests.agents_for_tests"
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90


def _stack(
    services: LocalStack,
    log_dir: Path,
    agent: str,
    *,
    hooks: str = "",
    pool: str = "prefork",
    bridge: bool = True,
    tracer: str = "otel",
) -> LocalStack:
    cancel_unfinished(services.store_url)
    redis.Redis.from_url(services.broker_url).flushdb()
    env = {"AGENT": agent, "AGENT_HOOKS": hooks, "LLM_RETURN_TOKEN_IDS": "true", "LOG_LEVEL": "INFO"}
    env["AGENT_TRACER"] = tracer
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # tests.*
    stack = stack_for(services, log_dir, workers=1, concurrency=2, pool=pool, bridge=bridge, extra_env=env)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def agent_stack(
    services: LocalStack, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalStack]:
    """A worker node running the agent the test's ``(agent, pool)`` parameter names, and a bridge.

    Module-scoped, so pytest runs the tests that share a parameter together and starts each stack once
    (a worker with ``AGENT=`` set pays Agent Lightning's import, about 9 s of CPU).
    """
    agent, pool = request.param
    stack = _stack(services, tmp_path_factory.mktemp(agent), f"{AGENTS}:{agent}", pool=pool)
    yield stack
    stack.stop()
    cancel_unfinished(services.store_url)


def _triplets(store_url: str, rollout_id: str) -> list[Any]:
    from agentlightning import Span
    from agentlightning.adapter import TracerTraceToTriplet

    stored = [Span.model_validate(item) for item in spans(store_url, rollout_id)]
    return TracerTraceToTriplet(llm_call_match=r"openai\.chat\.completion").adapt(stored)


def _run(stack: LocalStack, rewards: list[float], mode: str = "test") -> dict[str, dict[str, Any]]:
    inputs = [{"question": f"What is {i} + {i}?", "reward": r} for i, r in enumerate(rewards)]
    ids = enqueue(stack.store_url, inputs, mode=mode)
    final = wait_finished(stack.store_url, ids, timeout_s=WAIT_S)
    return {rid: {**view, "expected": r} for (rid, view), r in zip(final.items(), rewards, strict=True)}


RETURN_KINDS = [
    pytest.param(("FloatAgent", "prefork"), id="float"),
    pytest.param(("IntAgent", "prefork"), id="int"),
    pytest.param(("NoneAgent", "prefork"), id="none-with-tracer"),
    pytest.param(("AsyncAgent", "prefork"), id="async-prefork"),
    pytest.param(("AsyncAgent", "threads"), id="async-threads"),
]


@pytest.mark.parametrize("agent_stack", RETURN_KINDS, indirect=True)
def test_agent_calls_are_spans_and_the_adapter_recovers_reward_and_token_ids(agent_stack: LocalStack) -> None:
    """The agent's own openai SDK call is an ``openai.chat.completion`` span with the stand-in's token ids,
    and its reward (returned, or emitted through ``agl.emit_reward``) is the reward span after it."""
    rewards = [0.25, 0.5, 1.0, 0.0]
    final = _run(agent_stack, rewards, mode="train")
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "succeeded", (rid, meta)
        expected = 1.0 if "IntAgent" in meta["agent"] else view["expected"]
        assert meta["reward"] == expected and meta["llm_calls"] == 1, meta
        stored = spans(agent_stack.store_url, rid)
        names = [s["name"] for s in stored]
        assert names.index("openai.chat.completion") < names.index("agentlightning.annotation"), names
        assert meta["spans_exported"] == len(stored)
        [triplet] = _triplets(agent_stack.store_url, rid)
        assert triplet.reward == expected
        assert triplet.prompt["token_ids"] and triplet.response["token_ids"]


@pytest.mark.parametrize(
    ("agent_stack", "value"),
    [
        pytest.param(("FloatAgent", "prefork"), "nan", id="returns-nan"),
        pytest.param(("FloatAgent", "prefork"), "numpy-nan", id="returns-numpy-nan"),
        pytest.param(("FloatAgent", "prefork"), "-inf", id="returns-minus-inf"),
        pytest.param(("NoneAgent", "prefork"), "inf", id="emits-inf"),
        pytest.param(("AsyncAgent", "threads"), "nan", id="async-threads-returns-nan"),
    ],
    indirect=["agent_stack"],
)
def test_a_non_finite_reward_fails_the_attempt_at_once_with_class_agent(agent_stack: LocalStack, value: str) -> None:
    """NaN or infinity (``np.mean([])`` gives one) fails the attempt at its end, naming the value, in one
    attempt: never reported as a reward, never left to the Store's watchdog, never re-published. The worker
    goes on: a finite reward after it succeeds."""
    task = {"question": "What is 1 + 1?", "reward": value.removeprefix("numpy-"), "numpy": value.startswith("numpy")}
    ids = enqueue(agent_stack.store_url, [task, {"question": "What is 2 + 2?", "reward": 0.5}])
    final = wait_finished(agent_stack.store_url, ids, timeout_s=WAIT_S)
    bad, good = (final[rid] for rid in ids)
    meta = bad["attempt"]["metadata"]
    assert bad["status"] == "failed" and meta["failure_class"] == "agent", (bad, meta)
    assert "non-finite reward" in meta["error"] and value.removeprefix("numpy-") in meta["error"], meta
    assert [a["status"] for a in attempts(agent_stack.store_url, ids[0])] == ["failed"]
    assert "reward" not in meta
    assert good["status"] == "succeeded" and good["attempt"]["metadata"]["reward"] == 0.5


@pytest.mark.parametrize(
    "agent_stack",
    [
        pytest.param(("ReadableSpanAgent", "prefork"), id="readable-spans"),
        pytest.param(("AglSpanAgent", "prefork"), id="agl-spans"),
    ],
    indirect=True,
)
def test_returned_spans_are_the_trace(agent_stack: LocalStack) -> None:
    """A returned list of OpenTelemetry or Agent Lightning spans is filed under the attempt as the trace."""
    final = _run(agent_stack, [0.75, 0.5])
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
    ("agent_stack", "named"),
    [
        pytest.param(("RaisingAgent", "prefork"), "ValueError: deliberate failure", id="raises"),
        pytest.param(("BadReturnAgent", "prefork"), "the agent returned str", id="returns-a-string"),
    ],
    indirect=["agent_stack"],
)
def test_an_agent_failure_fails_the_attempt_with_class_agent(agent_stack: LocalStack, named: str) -> None:
    final = _run(agent_stack, [0.5, 0.5])
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "failed", (rid, view)
        assert meta["failure_class"] == "agent" and named in meta["error"], meta
        if named.startswith("ValueError"):
            # Nothing lost: the LLM call the agent made before raising is in the attempt.
            assert "openai.chat.completion" in {s["name"] for s in spans(agent_stack.store_url, rid)}


def test_a_raising_hook_is_logged_and_the_rollout_succeeds(services: LocalStack, tmp_path: Path) -> None:
    """Hooks run in Agent Lightning's order; one that raises in every method loses nothing."""
    hooks = f"{AGENTS}:RaisingHook,{AGENTS}:AnnotatingHook"
    stack = _stack(services, tmp_path, f"{AGENTS}:FloatAgent", hooks=hooks)
    try:
        final = _run(stack, [0.5, 1.0])
        log = stack.workers[0].log_path.read_text(errors="replace")
    finally:
        stack.stop()
    for rid, view in final.items():
        assert view["status"] == "succeeded" and view["attempt"]["metadata"]["reward"] == view["expected"], view
        names = [s["name"] for s in spans(services.store_url, rid)]
        assert (
            names.index("hook.on_trace_start")
            < names.index("openai.chat.completion")
            < names.index("hook.on_trace_end")
        )
    for method in ("on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end"):
        assert f"hook RaisingHook.{method} raised; the rollout goes on" in log


@pytest.mark.parametrize("agent", ["NoneAgent", "FloatAgent"])
def test_agentops_tracer_records_the_attempt_under_prefork(services: LocalStack, tmp_path: Path, agent: str) -> None:
    """AGENT_TRACER=agentops: Agent Lightning's AgentOps tracer records each attempt (its own ``openai``
    instrumentation, one LLM span per call: the worker adds none), and the trainer's adapter finds the
    reward whether the agent emitted it (None) or returned it (float)."""
    hooks = f"{AGENTS}:AnnotatingHook"
    stack = _stack(services, tmp_path, f"{AGENTS}:{agent}", hooks=hooks, tracer="agentops")
    try:
        final = _run(stack, [0.25, 0.75], mode="train")
    finally:
        stack.stop()
    for rid, view in final.items():
        meta = view["attempt"]["metadata"]
        assert view["status"] == "succeeded" and meta["reward"] == view["expected"], (rid, meta)
        names = [s["name"] for s in spans(services.store_url, rid)]
        assert names.count("openai.chat.completion") == 1, names
        assert names.index("hook.on_trace_start") < names.index("openai.chat.completion"), names
        [triplet] = _triplets(services.store_url, rid)
        assert triplet.reward == view["expected"]
        assert triplet.prompt["token_ids"] and triplet.response["token_ids"], triplet


def test_agentops_tracer_with_a_multi_slot_threads_pool_stops_the_worker(services: LocalStack) -> None:
    """One AgentOps trace per process: a pool running several attempts in one process is refused at start."""
    done = _start_worker_expecting_failure(services, ["-P", "threads", "-c", "2"], AGENT_TRACER="agentops")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "AGENT_TRACER=agentops traces one attempt per process" in done.stderr


def test_a_message_for_another_agent_fails_with_class_agent_naming_both(services: LocalStack, tmp_path: Path) -> None:
    """The worker compares the message's agent with its own (configured path or class path), imports nothing."""
    stack = _stack(services, tmp_path, f"{AGENTS}:make_float_agent", bridge=False)
    try:
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
    finally:
        stack.stop()
    views = [final[d.rollout_id] for d in dequeued]
    for view, agent in zip(views[:2], expected[:2], strict=True):
        meta = view["attempt"]["metadata"]
        assert view["status"] == "failed" and meta["failure_class"] == "agent", view
        assert repr(agent) in meta["error"] and f"{AGENTS}:make_float_agent" in meta["error"], meta["error"]
    assert [v["status"] for v in views[2:]] == ["succeeded", "succeeded"]


def test_an_agent_that_never_returns_ends_at_its_deadline_under_threads(services: LocalStack, tmp_path: Path) -> None:
    """Under ``-P threads`` Celery enforces no time limit: the agent's LLM calls carry the attempt's deadline."""
    timeout_s = 12
    soft_s = soft_time_limit(load_settings(store_url="http://127.0.0.1:1"), timeout_s)
    stack = _stack(services, tmp_path, f"{AGENTS}:LoopingAgent", pool="threads")
    try:
        [rid] = enqueue(stack.store_url, [{"question": "q"}], config={"max_attempts": 1, "timeout_seconds": timeout_s})
        wait_finished(stack.store_url, [rid], timeout_s=timeout_s + 30)
        attempt = attempts(stack.store_url, rid)[-1]
    finally:
        stack.stop()
    meta = attempt.get("metadata") or {}
    assert attempt["status"] == "failed" and meta.get("failure_class") == "timeout", attempt
    assert float(attempt["end_time"]) - float(attempt["start_time"]) <= soft_s + 5.0
    assert "openai.chat.completion" in {s["name"] for s in spans(services.store_url, rid)}


def _start_worker_expecting_failure(
    services: LocalStack, options: list[str], **settings: str
) -> subprocess.CompletedProcess[str]:
    """A worker started with ``settings`` (AGENT: FloatAgent unless given) that must stop by itself."""
    env = {**os.environ, "AGENT_LIGHTNING_STORE_URL": services.store_url, "CELERY_BROKER_URL": services.broker_url}
    env.update({"AGENT": f"{AGENTS}:FloatAgent", "PYTHONPATH": str(ROOT), **settings})
    celery = str(Path(sys.executable).with_name("celery"))
    argv = [celery, "-A", "workers", "worker", *options, "--without-gossip", "--without-mingle"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_an_agent_that_cannot_be_loaded_stops_the_worker_with_exit_code_2(services: LocalStack) -> None:
    done = _start_worker_expecting_failure(services, ["-c", "1"], AGENT=f"{AGENTS}:NoSuchAgent")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "has no attribute 'NoSuchAgent'" in done.stderr


def test_resources_reach_the_agent_as_agent_lightning_objects_with_the_proxy_routed_per_attempt() -> None:
    """In process (no worker): a ``proxy_llm`` becomes a plain ``LLM`` on this attempt's proxy URL, exactly as
    the WebShop loop addresses it; other resources pass as Agent Lightning objects."""
    from agentlightning import LLM, PromptTemplate

    from bridge.core.models import ResourcesUpdate
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
