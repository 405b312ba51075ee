"""The Agent Lightning 1.0 chaos scenarios (``python -m bridge chaos --agl v1``, ``bridge_lab.chaos.v1``) on a real
``agl-server`` 1.0, our dispatcher and real worker nodes: one stack for the module, one test per scenario of the
registry, each with the smallest counts that still land its fault while programs run.

Every scenario must end with no rollout lost, none executed twice in effect, no finished state flipped and no reward
other than the one its input names; every rollout succeeds but the refused ones (malformed, env_map attack), which
fail with their reason and never start.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bridge_lab.chaos import v1 as chaos
from bridge_lab.chaos.audit import format_table
from bridge_lab.chaos.state import ScenarioResult
from bridge_lab.procs import StackError
from bridge_lab.stack import LocalStack
from tests.prerequisites import missing

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.cost(320),
    pytest.mark.nightly(
        "a killed 1.0 worker, a restarted dispatcher, a drained worker: test_agl_v1.py and test_v1_worker_drain.py,"
        " on every run"
    ),
]

OPTIONS = chaos.V1Options(rollouts=8, sleep_s=3.0, gateway_pause_s=6.0, deadline_s=120.0, workers=2, concurrency=3)
RESULTS: list[ScenarioResult] = []


@pytest.fixture(scope="module")
def chaos_v1(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[chaos.V1ChaosStack]:
    shared = chaos.V1ChaosStack(services, tmp_path_factory.mktemp("chaos-v1"), OPTIONS)
    try:
        shared.start()
    except StackError as exc:
        missing(str(exc))
    try:
        yield shared
    finally:
        shared.stop()
        if RESULTS:
            print("\n" + format_table(RESULTS))


@pytest.mark.parametrize("name", list(chaos.V1_SCENARIOS))
def test_a_1_0_chaos_scenario_loses_nothing_runs_nothing_twice_and_pays_each_reward(
    chaos_v1: chaos.V1ChaosStack, name: str
) -> None:
    scenario = chaos.V1_SCENARIOS[name]
    result = chaos.run_v1_scenario(chaos_v1, scenario)
    RESULTS.append(result)
    print("\n" + format_table([result]))
    refused = len(scenario.refused(""))
    assert result.enqueued - result.forgotten >= 1
    assert result.enqueued >= max(OPTIONS.rollouts - refused, 1) + refused
    assert (result.lost, result.executed_twice, result.flipped, result.bad_reward) == (0, 0, 0, 0), result
    assert not any(note.startswith("error") for note in result.notes), result.notes
    assert result.succeeded == result.enqueued - result.forgotten - refused, result
    assert result.failed.get("input", 0) == refused, result
