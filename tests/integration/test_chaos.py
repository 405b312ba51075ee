"""The chaos suite: each scenario of `python -m bridge chaos` on 100+ rollouts against real processes, audited.

Every scenario must end with no rollout lost, no attempt executed twice in effect, no finished status
flipped by a late report and no reward the WebShop server did not compute. The broker is a Redis of this
module's own (append-only, so it can be restarted); the Store, WebShop server and LLM stand-in are the
session's. Every scenario runs by default, each on its own (``cost``: tests/schedule.py); ``-m "not slow"``
leaves out those that wait for outages (bridge kill, Redis restart, Store outage, flaky environment), and
``python -m bridge chaos`` runs them all at once outside pytest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.tools.chaos import run as chaos
from bridge.tools.stack import LocalStack, StackConfig
from tests.helpers import cancel_unfinished, split_tasks

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

ROLLOUTS = 100
RESULTS: list[chaos.ScenarioResult] = []


@pytest.fixture(scope="module")
def chaos_services(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A dedicated, restartable Redis; the session's Store, WebShop and LLM stand-in."""
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            broker_persistent=True,
            workers=0,
            bridge=False,
            log_dir=tmp_path_factory.mktemp("chaos-redis"),
        )
    )
    stack.start_services(lambda message: None)
    yield stack
    stack.stop()
    cancel_unfinished(services.store_url)
    if RESULTS:
        print("\n" + chaos.format_table(RESULTS))


@pytest.fixture(scope="module")
def tasks() -> list[dict[str, object]]:
    return split_tasks(ROLLOUTS)


def run(
    name: str, services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp: Path
) -> chaos.ScenarioResult:
    result = chaos.run_scenario(
        chaos_services,
        chaos.SCENARIOS[name],
        tasks,
        tmp,
        borrowed={"store": services.processes["store"]} if "store" in services.processes else None,
    )
    RESULTS.append(result)
    print("\n" + chaos.format_table([result]))
    assert result.enqueued >= ROLLOUTS
    assert (result.lost, result.executed_twice, result.flipped, result.bad_reward) == (0, 0, 0, 0), result
    assert not any("error" in note for note in result.notes), result.notes
    return result


@pytest.mark.cost(25)
def test_malformed_inputs_fail_as_input_errors_and_the_rest_succeed(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("malformed", services, chaos_services, tasks, tmp_path)
    assert result.failed["input"] == len(chaos.MALFORMED)
    assert result.succeeded == result.enqueued - len(chaos.MALFORMED)


@pytest.mark.cost(30)
def test_redelivered_running_tasks_do_not_run_twice(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("redeliver", services, chaos_services, tasks, tmp_path)
    assert any("re-published" in n and not n.startswith("re-published 0 ") for n in result.notes), result.notes


@pytest.mark.cost(75)
def test_killed_pool_and_main_processes_lose_nothing(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("kill-workers", services, chaos_services, tasks, tmp_path)
    assert sum("killed pool process" in n for n in result.notes) == 3, result.notes
    assert sum("killed worker main process" in n for n in result.notes) == 3, result.notes


@pytest.mark.cost(100)
@pytest.mark.slow
def test_bridge_killed_after_a_dequeue_strands_nothing(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("kill-bridge", services, chaos_services, tasks, tmp_path)
    assert sum("killed the bridge" in n for n in result.notes) == 2, result.notes


@pytest.mark.cost(40)
@pytest.mark.slow
def test_redis_restart_loses_nothing(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("restart-redis", services, chaos_services, tasks, tmp_path)
    assert "restarted Redis" in result.notes


@pytest.mark.cost(57)
@pytest.mark.slow
def test_store_outage_of_15_seconds_loses_nothing(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    assert "store" in services.processes, "the session's Store was not started by the tests: it cannot be paused"
    result = run("store-outage", services, chaos_services, tasks, tmp_path)
    assert any("paused the Store" in n for n in result.notes), result.notes


@pytest.mark.cost(70)
@pytest.mark.slow
def test_flaky_environment_and_rate_limited_llm_lose_nothing(
    services: LocalStack, chaos_services: LocalStack, tasks: list[dict[str, object]], tmp_path: Path
) -> None:
    result = run("flaky-env-llm", services, chaos_services, tasks, tmp_path)
    assert set(result.failed) <= {"env", "llm"}, result.failed
