"""Small Agent Lightning agents and hooks for the LitAgent tests (``AGENT=tests.agents_for_tests:...``).

Every agent asks the LLM it is given (the stand-in, ``python -m webshop_env.policy``, through the ``openai``
SDK) one question and computes its own reward from the rollout's input (``{"question": str, "reward":
float}``), so a test knows the reward each rollout must come back with. ``ReturnsAsToldAgent`` hands the result
back in whichever of the ways Agent Lightning's runner accepts (or a bad one) its input names, so one worker
serves every return kind; the others differ in how they run: async, looping, blocking, slow or stubborn.
Importing this module imports ``agentlightning``: only workers configured with one of these do.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import agentlightning as agl
import numpy
import openai
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def _llm(resources: agl.NamedResources) -> agl.LLM:
    llm = resources["main_llm"]
    assert isinstance(llm, agl.LLM)
    return llm


def _ask(resources: agl.NamedResources, task: dict[str, Any]) -> str:
    llm = _llm(resources)
    client = openai.OpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "EMPTY", max_retries=2)
    answer = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": str(task.get("question", "What is 2 + 2?"))}]
    )
    return answer.choices[0].message.content or ""


def _reward(task: dict[str, Any]) -> float:
    """The input's ``reward`` (a number, or "nan"/"inf" as text); a ``numpy.float64`` when ``numpy`` is set."""
    value = float(task.get("reward", 1.0))
    return numpy.float64(value) if task.get("numpy") else value


class FloatAgent(agl.LitAgent[dict[str, Any]]):
    """Returns its reward as a float: the worker emits the reward span after the LLM call's span."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        _ask(resources, task)
        return _reward(task)


class AsyncAgent(agl.LitAgent[dict[str, Any]]):
    """``rollout_async`` with the async SDK: run on an event loop in the executing thread."""

    async def rollout_async(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        llm = _llm(resources)
        client = openai.AsyncOpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "EMPTY", max_retries=2)
        await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        return _reward(task)


def _own_spans(task: dict[str, Any]) -> list[ReadableSpan]:
    """A trace made with the agent's own OpenTelemetry provider: an LLM call with token ids, then a reward."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agent-own"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests.agents_for_tests")
    with tracer.start_as_current_span("agent.own.root"):
        with tracer.start_as_current_span("openai.chat.completion") as llm:
            llm.set_attribute("gen_ai.request.model", "own")
            llm.set_attribute("prompt_token_ids", [11, 12, 13])
            llm.set_attribute("response_token_ids", [21, 22])
        time.sleep(0.001)
        with tracer.start_as_current_span("agentlightning.annotation") as reward:
            reward.set_attribute("agentlightning.reward.0.name", "primary")
            reward.set_attribute("agentlightning.reward.0.value", _reward(task))
    spans = list(exporter.get_finished_spans())
    provider.shutdown()
    return spans


class ReturnsAsToldAgent(agl.LitAgent[dict[str, Any]]):
    """Hands its result back the way its input's ``returns`` names, so that one worker serves every return kind:
    ``float`` (the default: the reward), ``int`` (1), ``emit`` (the reward emitted through Agent Lightning's
    emitter, None returned: the capture is the trace), ``readable-spans`` (OpenTelemetry spans it made itself) and
    ``agl-spans`` (the same as Agent Lightning ``Span``s: either list is the trace), ``raise`` (after its LLM
    call) and ``string`` (a value no runner can read as a result). The span kinds make no LLM call."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> Any:
        returns = task.get("returns", "float")
        if returns == "readable-spans":
            return _own_spans(task)
        if returns == "agl-spans":
            assert isinstance(rollout, agl.AttemptedRollout)
            return [
                agl.Span.from_opentelemetry(span, rollout.rollout_id, rollout.attempt.attempt_id, i)
                for i, span in enumerate(_own_spans(task))
            ]
        if returns == "string":
            return "not a reward"
        _ask(resources, task)
        if returns == "int":
            return 1
        if returns == "emit":
            agl.emit_reward(_reward(task))
            return None
        if returns == "raise":
            raise ValueError(f"deliberate failure for {task.get('question')!r}")
        assert returns == "float", returns
        return _reward(task)


class LoopingAgent(agl.LitAgent[dict[str, Any]]):
    """Asks the LLM forever: only the attempt's deadline (or a cancel) can end it, under any pool."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        while True:
            _ask(resources, task)
            time.sleep(0.2)


class BlockingAgent(agl.LitAgent[dict[str, Any]]):
    """With ``block`` in its input it waits forever outside any LLM call (a tool call without a timeout);
    otherwise it answers like ``FloatAgent``. Only abandoning its thread can end such an attempt."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        if task.get("block"):
            threading.Event().wait()
        _ask(resources, task)
        return _reward(task)


class SleepingAgent(agl.LitAgent[dict[str, Any]]):
    """Sleeps the input's ``sleep`` seconds and returns its reward, with no LLM call: a rollout of a known length."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        time.sleep(float(task.get("sleep", 0)))
        return _reward(task)


class SlowFirstAgent(agl.LitAgent[dict[str, Any]]):
    """Sleeps ``sleep`` seconds on a rollout's first attempt only, then answers like ``FloatAgent``: a drained
    worker's episode outlasts its grace, and the attempt that runs it again is quick."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        if isinstance(rollout, agl.AttemptedRollout) and rollout.attempt.sequence_id == 1:
            time.sleep(float(task.get("sleep", 0)))
        _ask(resources, task)
        return _reward(task)


class StubbornFirstAgent(agl.LitAgent[dict[str, Any]]):
    """On a rollout's first attempt, a tool loop that catches every exception, ``BaseException`` included, for
    ``sleep`` seconds: the worker's stop (``Superseded`` from its LLM calls) and the prefork drain's interrupt
    (``SoftTimeLimitExceeded``) are swallowed and it goes on, so a drained worker's attempt is never returned. First it
    leaves behind what agent programs do: a process that outlives its parent (orphaned to the PID namespace's init, a
    zombie once it exits) and a non-daemon thread that never ends, so the worker's own exit never finishes either.
    Later attempts answer like ``FloatAgent``."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        if isinstance(rollout, agl.AttemptedRollout) and rollout.attempt.sequence_id == 1:
            subprocess.run(["sh", "-c", "sleep 0.2 &"], check=True)  # sh exits at once; its sleep is orphaned
            threading.Thread(target=threading.Event().wait, name="lingering", daemon=False).start()
            end = time.monotonic() + float(task.get("sleep", 0))
            while time.monotonic() < end:
                try:
                    _ask(resources, task)
                except BaseException:  # the point of this agent
                    pass
                try:
                    time.sleep(0.2)
                except BaseException:
                    pass
        _ask(resources, task)
        return _reward(task)


class RaisingHook(agl.Hook):
    """Every hook method raises: the rollout must succeed anyway."""

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Any) -> None:
        raise RuntimeError("hook on_rollout_start raised on purpose")

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        raise RuntimeError("hook on_trace_start raised on purpose")

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        raise RuntimeError("hook on_trace_end raised on purpose")

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None:
        raise RuntimeError("hook on_rollout_end raised on purpose")


class AnnotatingHook(agl.Hook):
    """Records each hook call as a span of the attempt (through the worker's active tracer), in order."""

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Any) -> None:
        return None  # outside the trace context: nothing to record into, as with Agent Lightning's runner

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        tracer.create_span("hook.on_trace_start", attributes={"rollout": rollout.rollout_id})

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        tracer.create_span("hook.on_trace_end", attributes={"rollout": rollout.rollout_id})


def make_float_agent() -> FloatAgent:
    """A zero-argument factory."""
    return FloatAgent()


float_agent_instance = FloatAgent()


@agl.rollout
def decorated_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """An ``@agl.rollout`` function: Agent Lightning wraps it in a LitAgent."""
    client = openai.OpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or "EMPTY", max_retries=2)
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hello"}])
    return _reward(task)
