"""The WebShop agent loop: reset, ask the LLM for an action, step, until done or the step limit.

It knows nothing about Celery or the Store's state machine: it gets an environment, an LLM and a
telemetry object, and a ``check_stop`` callback that raises when the attempt must stop (superseded,
cancelled, out of time). The stop check and the episode's ``deadline`` also go into every LLM call, whose
retries would otherwise outlast the budget (nothing else interrupts a thread of a ``-P threads`` worker).
The reward it returns is exactly what the environment reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import openai

from bridge.core.settings import WorkerSettings
from workers.agents import llm as llm_mod
from workers.agents.inputs import TaskInput
from workers.agents.prompts import Conversation, choose_action, step_prompt
from workers.agents.webshop import Observation, WebShopClient
from workers.protocol.failures import FailureClass
from workers.telemetry.spans import LLM_SPAN, AttemptTelemetry

log = logging.getLogger("workers.agents.webshop_loop")


@dataclass
class EpisodeResult:
    blame: ClassVar[FailureClass] = FailureClass.ENV  # its values come from the environment's answers

    reward: float
    steps: int
    done: bool
    truncated: bool
    invalid_actions: int
    llm_calls: int
    llm_rate_limited: int
    env_session_id: str
    reward_info: dict[str, object] | None = None

    def metadata(self) -> dict[str, object]:
        data = asdict(self)
        if not data.get("reward_info"):
            data.pop("reward_info", None)
        return data


@dataclass
class Episode:
    """Everything one episode needs; built by the execution module from the current attempt."""

    task: TaskInput
    env: WebShopClient
    client: openai.OpenAI
    target: llm_mod.LLMTarget
    telemetry: AttemptTelemetry
    settings: WorkerSettings
    check_stop: Callable[[], None]
    before_llm_call: Callable[[], object] | None = None  # waits for the global rate limit (workers.agents.ratelimit)
    after_llm_call: Callable[[int | None], None] | None = None  # charges the tokens a call used
    # Epoch seconds at which the episode must stop (the attempt's soft limit). Passed into every LLM call
    # with ``check_stop``: under ``-P threads`` Celery enforces no time limit, so only this bounds the
    # LLM's retries and each request's timeout (workers.agents.llm.chat).
    deadline: float | None = None

    def run(self) -> EpisodeResult:
        with self.telemetry.span("webshop.env.reset", {"webshop.request": str(self.task.reset_request())}):
            obs = self.env.reset(self.task.reset_request())
        result = EpisodeResult(0.0, 0, False, False, 0, 0, 0, obs.session_id)
        conversation = Conversation()
        try:
            for step in range(1, self.settings.max_steps + 1):
                self.check_stop()
                obs = self._step(step, obs, conversation, result)
                if obs.done:
                    result.done = True
                    result.reward = obs.reward
                    info = obs.info.get("reward_info")
                    result.reward_info = info if isinstance(info, dict) else None
                    break
            else:
                result.truncated = True
        finally:
            self.env.close_session(result.env_session_id)
        self.telemetry.emit_reward(result.reward)
        return result

    def _step(self, step: int, obs: Observation, conversation: Conversation, result: EpisodeResult) -> Observation:
        conversation.observe(step_prompt(step, self.settings.max_steps, obs.observation, obs.clickables))
        with self.telemetry.span(
            "webshop.step", {"step.index": step, "observation.chars": len(obs.observation)}
        ) as span:
            action = self._choose_action(conversation, result)
            result.steps = step
            span.set_attribute("step.action", action or "")
            span.set_attribute("step.action_valid", action is not None)
            if action is None:
                result.invalid_actions += 1
                return obs
            with self.telemetry.span("webshop.env.step", {"webshop.action": action}):
                new_obs = self.env.step(obs.session_id, action)
            if not new_obs.valid:
                result.invalid_actions += 1
            span.set_attribute("step.env_valid", new_obs.valid)
            span.set_attribute("step.reward", new_obs.reward)
            span.set_attribute("step.done", new_obs.done)
            return new_obs

    def _choose_action(self, conversation: Conversation, result: EpisodeResult) -> str | None:
        """Ask the LLM; re-prompt with feedback on a placeholder or unparsable answer, a bounded number of times."""
        ask = lambda: self._call_llm(conversation, result)  # noqa: E731
        return choose_action(conversation, ask, self.settings.max_reprompts, before_each=self.check_stop)

    def _call_llm(self, conversation: Conversation, result: EpisodeResult) -> str:
        attributes: dict[str, object] = {
            "gen_ai.system": "openai",
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": self.target.model,
            "llm.source": self.target.source,
        }
        if self.settings.trace_content:
            for i, message in enumerate(conversation.messages):
                attributes[f"gen_ai.prompt.{i}.role"] = message["role"]
                attributes[f"gen_ai.prompt.{i}.content"] = message["content"]
        with self.telemetry.span(LLM_SPAN, attributes) as span:
            started = time.perf_counter()
            reply = llm_mod.chat(
                self.client,
                self.target,
                conversation.messages,
                retries=self.settings.llm_retries,
                max_backoff_s=self.settings.llm_max_backoff_s,
                before_call=self.before_llm_call,
                check_stop=self.check_stop,
                deadline=self.deadline,
                timeout_s=self.settings.llm_timeout_s,
            )
            result.llm_calls += 1
            result.llm_rate_limited += reply.rate_limited
            if self.after_llm_call is not None:
                self.after_llm_call((reply.prompt_tokens or 0) + (reply.completion_tokens or 0) or None)
            span.set_attribute("gen_ai.response.model", reply.model)
            if reply.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [reply.finish_reason])
            if reply.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", reply.prompt_tokens)
                span.set_attribute("gen_ai.usage.prompt_tokens", reply.prompt_tokens)
            if reply.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", reply.completion_tokens)
                span.set_attribute("gen_ai.usage.completion_tokens", reply.completion_tokens)
            if reply.prompt_token_ids is not None:
                self.telemetry.attach_ints(span, "prompt_token_ids", reply.prompt_token_ids)
            if reply.response_token_ids is not None:
                self.telemetry.attach_ints(span, "response_token_ids", reply.response_token_ids)
            span.set_attribute("llm.retries", reply.retries)
            span.set_attribute("llm.latency_ms", round((time.perf_counter() - started) * 1000, 2))
            if self.settings.trace_content:
                span.set_attribute("gen_ai.completion.0.content", reply.content)
            return reply.content
