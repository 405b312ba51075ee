"""Run your own agent on Celery: an Agent Lightning agent that does sums with an OpenAI-compatible LLM.

Workers run it, from the repository root, with
``AGENT=examples.calc_agent:CalcAgent celery -A workers worker``.
"""

from __future__ import annotations

import re
from typing import Any

import agentlightning as agl
from openai import OpenAI


class CalcAgent(agl.LitAgent[dict[str, Any]]):
    """Task ``{"question": "What is 12 + 30?", "answer": 42}``: reward 1.0 for the right number, else 0.0."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        llm = resources["main_llm"]  # the model the trainer publishes (an agl.LLM or agl.ProxyLLM)
        assert isinstance(llm, agl.LLM)
        attempt_id = rollout.attempt.attempt_id if isinstance(rollout, agl.AttemptedRollout) else None
        client = OpenAI(base_url=llm.get_base_url(rollout.rollout_id, attempt_id), api_key=llm.api_key or "EMPTY")
        reply = client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"{task['question']} Answer with the number only."}],
            **llm.sampling_parameters,
        )
        numbers = re.findall(r"-?\d+(?:\.\d+)?", reply.choices[0].message.content or "")
        return 1.0 if numbers and float(numbers[-1]) == float(task["answer"]) else 0.0
