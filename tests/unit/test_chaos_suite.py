"""The chaos suite runs every registered scenario: its parameters are the registry, and each scenario has a case
saying what proves its fault happened (tests/integration/test_chaos.py)."""

from __future__ import annotations

from bridge_lab.chaos.scenarios import SCENARIOS
from tests.integration import test_chaos


def test_every_registered_scenario_is_a_test_of_the_chaos_suite() -> None:
    ids = [param.id for param in test_chaos._params()]  # type: ignore[attr-defined]
    assert ids == list(SCENARIOS)


def test_every_registered_scenario_has_a_case_with_its_own_check() -> None:
    missing = set(SCENARIOS) - set(test_chaos.CASES)
    assert not missing, f"add a Case to tests/integration/test_chaos.py for {sorted(missing)}"
    assert not set(test_chaos.CASES) - set(SCENARIOS), "a case for a scenario that is not registered"
