"""The chaos scenarios that matter most for a generic agent (killed workers, redelivered messages) with
``AGENT`` set to a LitAgent of ours on the workers and the bridge, audited like the WebShop runs.

The WebShop ledger cannot vouch for a generic agent's reward, so on top of the chaos audit (lost, twice,
flipped) every succeeded rollout's reward must be the one ``SlowAgent`` computes from its input, and no
attempt may hold two LLM calls (the agent makes one per execution: two would be a second execution).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from bridge.core.store import AttemptedRollout, StoreClient
from bridge_lab.chaos import run as chaos
from bridge_lab.stack import LocalStack
from tests.fakes.runner_agents import expected_reward
from tests.helpers import cancel_unfinished, split_tasks

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.nightly(
        "the same faults with the WebShop agent (test_chaos.py) and LitAgents (test_litagent.py) run every time"
    ),
]

ROLLOUTS = 100
AGENT = "tests.fakes.runner_agents:SlowAgent"
LLM_SPAN = "openai.chat.completion"


def run_with_agent(
    name: str,
    services: LocalStack,
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
) -> chaos.ScenarioResult:
    """Run scenario ``name`` with ``AGENT`` on its stack, ``env`` over the scenario's own settings, and audit it."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # tests.* for the workers
    cancel_unfinished(services.store_url)
    scenario = chaos.SCENARIOS[name]
    scenario = dataclasses.replace(scenario, env={**scenario.env, **(env or {})})
    started = time.time()
    result = chaos.run_scenario(services, scenario, split_tasks(ROLLOUTS), tmp, agent=AGENT)
    print("\n" + chaos.format_table([result]))
    assert result.enqueued >= ROLLOUTS
    assert (result.lost, result.executed_twice, result.flipped) == (0, 0, 0), result
    assert not any("error" in note for note in result.notes), result.notes
    assert result.succeeded == result.enqueued, result  # the agent never fails; killed attempts are retried
    with StoreClient(services.store_url) as store:
        done, _ = store.list_rollouts(status_in=["succeeded"])
        ours = [r for r in done if isinstance(r, AttemptedRollout) and (r.start_time or 0) >= started - 1]
        assert len(ours) == result.enqueued
        for rollout in ours:
            meta = rollout.attempt.metadata or {}
            assert meta.get("reward") == expected_reward(rollout.input), (rollout.rollout_id, meta)
            names = [s["name"] for s in store.spans(rollout.rollout_id, rollout.attempt.attempt_id)]
            assert names.count(LLM_SPAN) == 1, (rollout.rollout_id, names)
    return result


@pytest.mark.cost(90)
def test_killed_workers_lose_nothing_with_a_generic_agent(
    services: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reconcile scan every 2 s instead of 20: the rollouts of the last killed main process run again once its
    # leases lapse and a confirming scan agrees (LEASE_TTL_S, 2 x HEARTBEAT_INTERVAL_S + 5 s), not 20 s after.
    # Every kill still has to be absorbed by the lease, the takeover and the audit; only the wait is shorter.
    result = run_with_agent("kill-workers", services, tmp_path, monkeypatch, env={"BRIDGE_RECONCILE_INTERVAL_S": "2"})
    assert sum("killed" in note for note in result.notes) >= 4, result.notes


@pytest.mark.cost(90)
def test_redelivered_messages_do_not_run_a_generic_agent_twice(
    services: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_with_agent("redeliver", services, tmp_path, monkeypatch)
    assert any("re-published" in note for note in result.notes), result.notes
