"""examples/calc_agent.py, the README's agent, on real workers as the README deploys it, driven by CeleryRunner.step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import agentlightning as agl
import pytest

from bridge.runner import CeleryRunner
from bridge.tools.stack import LocalStack
from tests.helpers import cancel_unfinished, stack_for
from tests.integration.test_runner import ROOT, _spans, llm

pytestmark = [pytest.mark.integration, pytest.mark.cost(13)]


def test_the_readme_example_agent_runs_on_the_workers(services: LocalStack, tmp_path: Path) -> None:
    """examples/calc_agent.py as the README deploys it: the LLM stand-in is no calculator, so the reward is
    0.0 or 1.0, but the rollout must succeed with exactly the reward the agent returned, and its LLM call
    traced with token ids for the trainer's adapter."""
    from examples.calc_agent import CalcAgent

    cancel_unfinished(services.store_url)
    env = {"AGENT": "examples.calc_agent:CalcAgent", "PYTHONPATH": ROOT, "LLM_RETURN_TOKEN_IDS": "true"}
    stack = stack_for(services, tmp_path, workers=1, concurrency=1, bridge=False, extra_env=env)
    stack.start()
    try:
        runner = CeleryRunner(broker_url=services.broker_url)
        with runner.run_context(agent=CalcAgent(), store=agl.LightningStoreClient(services.store_url)):
            task = {"question": "What is 12 + 30?", "answer": 42}
            rollout = asyncio.run(runner.step(task, resources={"main_llm": llm(services)}))
    finally:
        stack.stop()
    assert rollout.status == "succeeded"
    spans = asyncio.run(_spans(services.store_url, rollout.rollout_id))
    assert agl.find_final_reward(spans) in (0.0, 1.0)
    triplets = agl.TracerTraceToTriplet().adapt(spans)
    assert len(triplets) == 1 and triplets[0].reward == agl.find_final_reward(spans)
    assert triplets[0].prompt.get("token_ids") and triplets[0].response.get("token_ids")
