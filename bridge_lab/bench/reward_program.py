"""The 1.0 agent program of ``bench-v1 --long`` (``bridge_lab.bench.agl_v1_long``): posts the reward its rollout's
input names (``SOAK_REWARD``, given by ``env_map``) to ``AGL_EVENT_URL`` and exits. Milliseconds of work, so a long
run measures what the worker, its program server and the dispatcher keep per rollout, not an episode.

It imports only ``httpx`` (which the program server preloads), as a real program's client would."""

from __future__ import annotations

import os

import httpx

AGENT_CLASS = "bridge_lab.bench.reward_program:PostReward"
ENV_MAP = {"SOAK_REWARD": "input.reward"}


class PostReward:
    def run(self) -> None:
        value = float(os.environ["SOAK_REWARD"])
        response = httpx.post(
            os.environ["AGL_EVENT_URL"],
            json={"event_type": "reward", "data": {"value": value}},
            headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
            timeout=30,
        )
        response.raise_for_status()
        print(f"posted reward {value}", flush=True)
