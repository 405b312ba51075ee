"""The built-in WebShop agent as an Agent Lightning 1.0 agent program (docs/agl-v1.md, "The WebShop agent").

A worker starts it like any 1.0 program: the task is the rollout's input, given as ``WEBSHOP_TASK`` by the
rollout's ``env_map`` (``WEBSHOP_TASK: input``); the LLM is the gateway's proxy (``AGL_OPENAI_BASE_URL``),
which records every call's token ids, through a client that waits out the gateway's pauses
(``workers.agents.gateway_llm``); the reward the WebShop server computed is posted to ``AGL_EVENT_URL``.
It plays with the 0.3 agent's prompts and action parsing (``workers.agents.prompts``) and the worker's settings
(``WEBSHOP_URL``, ``MAX_STEPS``, ``MAX_REPROMPTS``, ...), which it gets from the worker's environment when the
worker lists them in ``AGL_V1_PASS_ENV`` (``PASS_ENV``).
"""

from __future__ import annotations

import json
import os

import httpx
from openai import OpenAI

from bridge.core.settings import WebShopProgramSettings, load_settings
from workers.agents.gateway_llm import openai_client
from workers.agents.inputs import TaskInput, parse_task_input
from workers.agents.prompts import Conversation, choose_action, step_prompt
from workers.agents.webshop import WebShopClient

AGENT_CLASS = "workers.agents.webshop_program:WebShopProgram"
ENV_MAP = {"WEBSHOP_TASK": "input"}
PASS_ENV = "WEBSHOP_URL,WEBSHOP_TOKEN,WEBSHOP_TIMEOUT_S,MAX_STEPS,MAX_REPROMPTS,MAX_INSTRUCTION_CHARS"
"""The worker's settings this program reads: a worker running it lists them in AGL_V1_PASS_ENV."""


class WebShopProgram:
    def run(self) -> None:
        settings = load_settings(WebShopProgramSettings)
        task = parse_task_input(json.loads(os.environ["WEBSHOP_TASK"]), max_chars=settings.max_instruction_chars)
        llm = openai_client()  # waits out the gateway's pauses (weight updates) instead of failing
        env = WebShopClient(
            str(settings.webshop_url), token=settings.webshop_token, timeout_s=settings.webshop_timeout_s
        )
        try:
            reward = play(task, env, llm, settings)
        finally:
            env.close()
        response = httpx.post(
            os.environ["AGL_EVENT_URL"],
            json={"event_type": "reward", "data": {"value": reward, "source": "webshop"}},
            headers={"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"},
            timeout=30,
        )
        response.raise_for_status()


def play(task: TaskInput, env: WebShopClient, llm: OpenAI, settings: WebShopProgramSettings) -> float:
    """One episode: observe, ask for an action (re-prompting on an unparsable answer), step, until the
    environment says done or the step limit; the environment's reward, 0.0 when the episode did not finish."""
    obs = env.reset(task.reset_request())
    conversation = Conversation()
    try:
        for step in range(1, settings.max_steps + 1):
            conversation.observe(step_prompt(step, settings.max_steps, obs.observation, obs.clickables))
            action = choose_action(conversation, lambda: _ask(llm, conversation), settings.max_reprompts)
            if action is None:
                continue
            obs = env.step(obs.session_id, action)
            if obs.done:
                return obs.reward
        return 0.0
    finally:
        env.close_session(obs.session_id)


def _ask(llm: OpenAI, conversation: Conversation) -> str:
    reply = llm.chat.completions.create(model="policy", messages=conversation.messages)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""
