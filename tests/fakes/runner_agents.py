"""The LitAgent the CeleryRunner tests run on real workers (``AGENT=tests.fakes.runner_agents:ScoredAgent``).

Not WebShop: it asks the LLM (the stand-in, through the ``openai`` SDK, token ids requested as from vLLM)
one question and returns the reward the task names, so a test knows exactly which reward every rollout
must bring back; a task with ``fail`` makes it raise instead, and one with ``fail_first`` raises on its first
attempt after giving the rollout a retry (as a user's rollout config would). No tests live here.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import agentlightning as agl
import httpx
from openai import OpenAI

AGENT_PATH = "tests.fakes.runner_agents:ScoredAgent"


class ScoredAgent(agl.LitAgent[dict[str, Any]]):
    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        if task.get("fail"):
            raise ValueError(f"task {task.get('id')} asked to fail")
        if task.get("fail_first") and isinstance(rollout, agl.AttemptedRollout) and rollout.attempt.sequence_id == 1:
            allow_one_retry(rollout.rollout_id)
            raise ValueError(f"task {task.get('id')} asked to fail its first attempt")
        llm = resources["main_llm"]
        assert isinstance(llm, agl.LLM)
        attempt_id = rollout.attempt.attempt_id if isinstance(rollout, agl.AttemptedRollout) else None
        client = OpenAI(base_url=llm.get_base_url(rollout.rollout_id, attempt_id), api_key=llm.api_key or "EMPTY")
        client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"Observation: {task['question']}"}],
            extra_body={"return_token_ids": True},
        )
        return float(task["reward"])


def allow_one_retry(rollout_id: str) -> None:
    """Give the rollout a second attempt on failure, through the Store's own API (docs/store-protocol.md 3)."""
    store = os.environ["AGENT_LIGHTNING_STORE_URL"].rstrip("/")
    config = {"max_attempts": 2, "retry_condition": ["failed"]}
    httpx.post(f"{store}/v1/agl/rollouts/{rollout_id}", json={"config": config}, timeout=10).raise_for_status()


class OtherAgent(agl.LitAgent[dict[str, Any]]):
    """An agent no test worker runs."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        return 0.0


def expected_reward(task: Any) -> float:
    """SlowAgent's reward for a task: a fixed function of its input, so an audit can recompute it."""
    text = task.get("instruction", "") if isinstance(task, dict) else str(task)
    return (zlib.crc32(str(text).encode()) % 100) / 100


class SlowAgent(agl.LitAgent[Any]):
    """A generic agent for the chaos scenarios: about two seconds per rollout (so a kill lands mid-rollout),
    one LLM call, and a reward that is a fixed function of the input (``expected_reward``)."""

    def rollout(self, task: Any, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        time.sleep(1.0)
        client = OpenAI(base_url=os.environ["OPENAI_API_BASE"], api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY")
        client.chat.completions.create(
            model="stand-in",
            messages=[{"role": "user", "content": f"Observation: {str(task)[:200]}"}],
            extra_body={"return_token_ids": True},
        )
        time.sleep(1.0)
        return expected_reward(task)
