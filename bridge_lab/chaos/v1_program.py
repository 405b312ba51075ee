"""The Agent Lightning 1.0 program the 1.0 chaos scenarios run (``bridge_lab.chaos.v1``): its reward is known
from its input, so the audit can tell a wrong one.

``ChaosProgram.run()`` posts a ``chaos.start`` event naming this execution (a fresh id and its pid, by which the
scenarios find its worker node), asks the LLM through the gateway's proxy, sleeps ``CHAOS_SLEEP`` seconds, asks
again, then posts ``CHAOS_REWARD`` as its reward. Each post is one request with a long timeout and no retry: a
retried post whose first try landed would be a second event, which the audit counts as a second execution. The LLM
calls go through ``workers.agents.gateway_llm.openai_client``, which waits out a paused gateway as the built-in
WebShop program does; each is recorded by the gateway as a ``model_request`` event with the serving model's version.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import httpx
from openai import OpenAI

from workers.agents.gateway_llm import openai_client

POST_TIMEOUT_S = 120.0  # longer than any gateway pause a scenario injects
START_EVENT = "chaos.start"


def _post(event_type: str, data: dict[str, Any]) -> None:
    response = httpx.post(
        os.environ["AGL_EVENT_URL"],
        json={"event_type": event_type, "data": data},
        headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
        timeout=POST_TIMEOUT_S,
    )
    response.raise_for_status()


class ChaosProgram:
    """Start event, sleep, reward: long enough for a fault to land while it runs."""

    def run(self) -> None:
        _post(START_EVENT, {"execution": uuid.uuid4().hex, "pid": os.getpid()})
        llm = openai_client()
        _ask(llm, "first")
        time.sleep(float(os.environ["CHAOS_SLEEP"]))
        _ask(llm, "second")
        _post("reward", {"value": float(json.loads(os.environ["CHAOS_REWARD"]))})


def _ask(llm: OpenAI, which: str) -> None:
    llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"the {which} question"}])
