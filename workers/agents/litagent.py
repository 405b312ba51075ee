"""One attempt of a configured LitAgent, in Agent Lightning's runner order, in place of the WebShop episode.

``workers.execution`` keeps everything around it (lease, fence, heartbeats, the span batch, the report); this
module runs, in order: ``on_rollout_start``; the attempt's capture opens; ``on_trace_start``; the agent's
``training_rollout``/``validation_rollout`` (or ``_async``) by the rollout's mode; ``on_trace_end`` and the
capture closes; the return value becomes spans (a number: the reward span; a list: the trace; ``None``: what
was captured; anything else fails the attempt, class ``agent``); ``on_rollout_end`` always. With
``AGENT_TRACER=agentops`` the middle steps run in Agent Lightning's AgentOps trace context instead. A hook
that raises is logged and the attempt goes on; coroutines run with ``asyncio.run`` in the executing thread,
with the context copied in. Contract: docs/agents.md section 1.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from agentlightning.types import LLM, AttemptedRollout, ProxyLLM, ResourceUnion
from celery.exceptions import SoftTimeLimitExceeded
from opentelemetry.sdk.trace import ReadableSpan
from pydantic import TypeAdapter, ValidationError

from bridge.core.infra import BridgeError, Superseded
from bridge.core.settings import WorkerSettings
from bridge.core.store import ResourcesUpdate
from workers.agents import capture
from workers.agents import llm as llm_mod
from workers.agents.loading import ConfiguredAgent
from workers.agents.spans import add_returned_spans
from workers.agents.tracer import WorkerTracer, activate
from workers.lifecycle import state
from workers.protocol.failures import AgentError, FailureClass

log = logging.getLogger("workers.agents")

_RESOURCE = TypeAdapter(ResourceUnion)


@dataclass
class AgentRunResult:
    """What a LitAgent attempt produced, for the report (``metadata``) and the task's outcome."""

    blame: ClassVar[FailureClass] = FailureClass.AGENT

    agent: str
    result_kind: str  # reward | spans | none
    reward: float | None
    llm_calls: int
    spans_returned: int = 0

    def metadata(self) -> dict[str, object]:
        data: dict[str, object] = {
            "agent": self.agent,
            "result_kind": self.result_kind,
            "llm_calls": self.llm_calls,
        }
        if self.reward is not None:
            data["reward"] = self.reward
        if self.spans_returned:
            data["spans_returned"] = self.spans_returned
        return data


class WorkerRunner:
    """What ``agent.runner`` and the hooks' ``runner`` are on a worker: its tracer and worker id.

    The worker is not an Agent Lightning ``Runner`` (the Celery task drives it); agents that read
    ``self.runner.tracer`` or ``self.tracer`` get the worker's tracer.
    """

    def __init__(self, tracer: WorkerTracer, worker_id: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id


def named_resources(
    resources: ResourcesUpdate | None, target: llm_mod.LLMTarget | None, rollout_id: str, attempt_id: str
) -> dict[str, Any]:
    """The rollout's resources as Agent Lightning objects; every ``proxy_llm`` already routed to this attempt.

    A proxy's per-attempt URL is built as for the WebShop loop (``workers.agents.llm.proxy_attempt_url``), so the
    agent gets a plain ``LLM`` whatever it reads (``endpoint`` or ``get_base_url``). With no ``main_llm`` in
    the Store and ``OPENAI_API_BASE`` set, ``main_llm`` is that endpoint, as for the WebShop loop.
    """
    named: dict[str, Any] = {}
    for name, raw in (resources.resources if resources else {}).items():
        try:
            resource = _RESOURCE.validate_python(raw)
        except ValidationError as exc:
            log.warning("resource %r is not an Agent Lightning resource, not passed to the agent: %s", name, exc)
            continue
        if isinstance(resource, ProxyLLM):
            resource = LLM(
                endpoint=llm_mod.proxy_attempt_url(raw["endpoint"], rollout_id, attempt_id),
                model=resource.model,
                api_key=resource.api_key,
                sampling_parameters=dict(resource.sampling_parameters),
            )
        named[name] = resource
    if "main_llm" not in named and target is not None and target.source == "settings":
        named["main_llm"] = LLM(endpoint=target.base_url, model=target.model, api_key=target.api_key)
    return named


def keyed_resources(resources: dict[str, Any], settings: WorkerSettings) -> tuple[dict[str, Any], str]:
    """The agent's resources with the key of each ``LLM`` decided by ``workers.agents.llm.llm_api_key``, and why
    OPENAI_API_KEY was withheld from any ("" if from none).

    An LLM's own key stays. One without gets OPENAI_API_KEY where the key may go, else the placeholder
    "EMPTY", so that the ``openai`` SDK does not fall back to OPENAI_API_KEY from the environment.
    """
    keyed = dict(resources)
    reasons: list[str] = []
    for name, resource in resources.items():
        if not isinstance(resource, LLM) or resource.api_key:
            continue
        key, why = llm_mod.llm_api_key(resource.endpoint, None, settings)
        if why:
            reasons.append(f"{why} (resource {name!r})")
            key = "EMPTY"
        if key is not None:
            keyed[name] = resource.model_copy(update={"api_key": key})
    return keyed, "; ".join(reasons)


@contextmanager
def _withheld_note(why: str) -> Iterator[None]:
    """An agent's failure says which keys were withheld from its LLM resources (a likely cause)."""
    try:
        yield
    except AgentError as exc:
        if not why:
            raise
        raise AgentError(f"{exc} ({why})") from exc.__cause__


def run_agent(
    configured: ConfiguredAgent,
    payload: dict[str, Any],
    resources: dict[str, Any],
    attempt: capture.AttemptCapture,
    worker_id: str,
) -> AgentRunResult:
    """Run the agent once for this attempt; its spans end up in ``attempt.telemetry``'s buffer.

    Raises ``AgentError`` (class ``agent``) for anything the agent raised or an unsupported return value;
    the attempt's own stop and deadline errors (``Superseded``, ``TimeoutError``) and our errors pass as
    they are, so they keep their classes.
    """
    own = configured.own_tracer()  # AGENT_TRACER=agentops: Agent Lightning's AgentOps tracer
    tracer = own if own is not None else activate()
    agent = configured.agent
    runners = state.process.litagent_runners  # by id(agent): LitAgent keeps only a weak reference to its runner
    runner = runners.get(id(agent))
    if runner is None:
        runner = runners[id(agent)] = WorkerRunner(tracer, worker_id)
        agent.set_runner(runner)
    rollout = AttemptedRollout.model_validate(payload)
    resources, withheld = keyed_resources(resources, attempt.settings)
    hooks = _Hooks(configured, runner, rollout)
    spans: list[Any] = []
    try:
        hooks.fire("on_rollout_start")
        # With AGENT_TRACER=none the SDK is not wrapped (lifecycle.steps.startup): only the emitters record here.
        with capture.capturing(attempt), _withheld_note(withheld):
            if own is None:
                hooks.fire("on_trace_start", tracer=tracer)
                raw = _call_agent(agent, rollout, resources, attempt.deadline)
                hooks.fire("on_trace_end", tracer=tracer)
            else:
                raw = asyncio.run(_traced_call(own, hooks, agent, rollout, resources, attempt.deadline))
        if own is not None and not isinstance(raw, list):
            # What AgentOps recorded is the trace unless the agent returned its own, as in Agent Lightning.
            emitted = _last_reward(add_returned_spans(attempt.telemetry, own.get_last_trace()))
            attempt.last_reward = emitted if emitted is not None else attempt.last_reward
        result, spans = _interpret(raw, attempt, configured.path)
        if result.reward is not None and not math.isfinite(result.reward):
            how = "returned" if result.result_kind == "reward" else "emitted"
            raise AgentError(f"the agent {how} a non-finite reward ({float(result.reward)!r}); a reward must be finite")
        return result
    finally:
        hooks.fire("on_rollout_end", spans=spans)


async def _traced_call(
    tracer: Any, hooks: _Hooks, agent: Any, rollout: AttemptedRollout, resources: dict[str, Any], deadline: float | None
) -> Any:
    """The agent inside the AgentOps tracer's trace context, with the trace hooks, on one event loop.

    A sync agent is called on the loop's thread, as Agent Lightning's own runner calls it.
    """
    async with tracer.trace_context(name=rollout.rollout_id):
        await hooks.fire_async("on_trace_start", tracer=tracer)
        with _agent_errors(deadline):
            raw = _agent_method(agent, rollout)(rollout.input, resources=resources, rollout=rollout)
            if asyncio.iscoroutine(raw):
                raw = await raw
        await hooks.fire_async("on_trace_end", tracer=tracer)
        return raw


def _agent_method(agent: Any, rollout: AttemptedRollout) -> Callable[..., Any]:
    train = rollout.mode == "train"
    if agent.is_async():
        return agent.training_rollout_async if train else agent.validation_rollout_async
    return agent.training_rollout if train else agent.validation_rollout


def _call_agent(agent: Any, rollout: AttemptedRollout, resources: dict[str, Any], deadline: float | None) -> Any:
    with _agent_errors(deadline):
        raw = _agent_method(agent, rollout)(rollout.input, resources=resources, rollout=rollout)
        return asyncio.run(raw) if asyncio.iscoroutine(raw) else raw


@contextmanager
def _agent_errors(deadline: float | None) -> Iterator[None]:
    """What the agent raised as an ``AgentError`` (class ``agent``); the attempt's own stops keep theirs."""
    try:
        yield
    except (Superseded, SoftTimeLimitExceeded, BridgeError):
        raise  # the attempt's own stop, time limit and our errors keep their classes
    except TimeoutError as exc:
        if deadline is not None and time.time() >= deadline - capture.MIN_TRY_S:
            raise  # the attempt's budget ran out (class timeout), not the agent's own wait
        raise AgentError(f"the agent raised {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise AgentError(f"the agent raised {type(exc).__name__}: {exc}") from exc


def _interpret(raw: Any, attempt: capture.AttemptCapture, path: str) -> tuple[AgentRunResult, list[Any]]:
    """What Agent Lightning's runner makes of a return value, with the spans it delivers."""
    calls = attempt.llm_calls
    if raw is None:
        return AgentRunResult(path, "none", attempt.last_reward, calls), []
    if isinstance(raw, (bool, int, float)):
        if isinstance(raw, (bool, int)):
            log.warning("the agent returned %s as its reward; converted to float", type(raw).__name__)
        value = float(raw)
        if math.isfinite(value):  # a non-finite one fails the attempt (run_agent): no reward span for it
            attempt.telemetry.emit_reward(value)  # after every span the agent made: they have all ended
        return AgentRunResult(path, "reward", value, calls), []
    if isinstance(raw, list):
        if not raw:
            log.warning("the agent returned an empty list: no trace")
            return AgentRunResult(path, "spans", attempt.last_reward, calls), []
        try:
            added = add_returned_spans(attempt.telemetry, raw)
        except TypeError as exc:
            raise AgentError(f"the agent returned {exc}") from exc
        except ValueError as exc:  # a trace or span id that is not hex
            raise AgentError(f"the agent returned spans whose ids cannot be read: {exc}") from exc
        reward: float | None = _last_reward(added)
        if reward is None:
            reward = attempt.last_reward
        return AgentRunResult(path, "spans", reward, calls, len(raw)), added
    raise AgentError(
        f"the agent returned {type(raw).__name__}; expected None, a float reward, or a list of "
        "ReadableSpan / Span / SpanCoreFields"
    )


def _last_reward(spans: list[ReadableSpan]) -> float | None:
    reward = None
    for span in spans:
        value = (span.attributes or {}).get("agentlightning.reward.0.value")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            reward = float(value)
    return reward


class _Hooks:
    """The configured hooks of one attempt; one that raises is logged, never fails the attempt."""

    def __init__(self, configured: ConfiguredAgent, runner: WorkerRunner, rollout: Any) -> None:
        self._hooks = configured.hooks
        self._common = {"agent": configured.agent, "runner": runner, "rollout": rollout}

    def fire(self, name: str, **extra: Any) -> None:
        for hook in self._hooks:
            try:
                _run_coroutine(getattr(hook, name), **self._common, **extra)
            except Exception:
                log.exception("hook %s.%s raised; the rollout goes on", type(hook).__name__, name)

    async def fire_async(self, name: str, **extra: Any) -> None:
        """``fire`` from inside a running event loop (the AgentOps trace context)."""
        for hook in self._hooks:
            try:
                result = getattr(hook, name)(**self._common, **extra)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("hook %s.%s raised; the rollout goes on", type(hook).__name__, name)


def _run_coroutine(method: Callable[..., Coroutine[Any, Any, Any] | Any], **kwargs: Any) -> Any:
    result = method(**kwargs)
    if asyncio.iscoroutine(result):
        return asyncio.run(result)
    return result
