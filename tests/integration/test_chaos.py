"""The chaos suite: every scenario of `python -m bridge chaos` against real processes, audited.

The tests are the registry ``chaos.SCENARIOS`` itself, so a scenario added there runs here with the audit's
checks: no rollout lost, no attempt executed twice in effect, no finished status flipped by a late report
and no reward the WebShop server did not compute. ``CASES`` adds what proves each scenario's fault happened,
its rollout count (100, fewer where the fault needs fewer), its cost (tests/schedule.py) and, for a scenario that
runs in the nightly-size run only (``pytest -m nightly``), why it can wait; tests/unit/test_chaos_suite.py fails
while a scenario has no case. The broker is a Redis of this module's own (append-only, so it can be restarted); the
Store, WebShop server and LLM stand-in are the session's. Each scenario runs on its own; ``slow`` marks those that wait
for outages, and ``python -m bridge chaos`` runs them all at once outside pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge_lab.chaos import run as chaos
from bridge_lab.stack import LocalStack, StackConfig
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


def run(name: str, services: LocalStack, chaos_services: LocalStack, rollouts: int, tmp: Path) -> chaos.ScenarioResult:
    result = chaos.run_scenario(
        chaos_services,
        chaos.SCENARIOS[name],
        split_tasks(rollouts),
        tmp,
        borrowed={"store": services.processes["store"]} if "store" in services.processes else None,
    )
    RESULTS.append(result)
    print("\n" + chaos.format_table([result]), f"\n  attempts failed by class: {dict(result.attempts_failed)}")
    assert result.enqueued >= rollouts
    assert (result.lost, result.executed_twice, result.flipped, result.bad_reward) == (0, 0, 0, 0), result
    assert not any("error" in note for note in result.notes), result.notes
    return result


def malformed(result: chaos.ScenarioResult) -> None:
    """Malformed inputs fail as input errors, never retried, and the rest succeed."""
    assert result.failed["input"] == len(chaos.MALFORMED)
    assert result.succeeded == result.enqueued - len(chaos.MALFORMED)


def redeliver(result: chaos.ScenarioResult) -> None:
    """Messages of running and finished attempts were published again, and none ran twice (the audit)."""
    assert any("re-published" in n and not n.startswith("re-published 0 ") for n in result.notes), result.notes


def kill_workers(result: chaos.ScenarioResult) -> None:
    """Three pool processes and three worker main processes were killed mid-episode, and nothing was lost."""
    assert sum("killed pool process" in n for n in result.notes) == 3, result.notes
    assert sum("killed worker main process" in n for n in result.notes) == 3, result.notes


def kill_bridge(result: chaos.ScenarioResult) -> None:
    """The bridge was killed twice after a dequeue, and what it had claimed ran anyway."""
    assert sum("killed the bridge" in n for n in result.notes) == 2, result.notes


def restart_redis(result: chaos.ScenarioResult) -> None:
    assert "restarted Redis" in result.notes


def store_outage(result: chaos.ScenarioResult) -> None:
    """The Store was paused for 15 s while rollouts ran."""
    assert any("paused the Store" in n for n in result.notes), result.notes


def flaky_env_llm(result: chaos.ScenarioResult) -> None:
    """Rollouts that used up their retries failed as env or llm, nothing else."""
    assert set(result.failed) <= {"env", "llm"}, result.failed


def non_finite_reward(result: chaos.ScenarioResult) -> None:
    """Attempts whose purchase the WebShop server answered with reward NaN failed (class env) and were retried;
    no NaN reached the trainer as a reward (the audit's bad-reward count compares every reward with the
    server's ledger). At most a rollout whose three purchases all drew NaN ends failed."""
    assert result.attempts_failed["env"] >= 1, result.attempts_failed
    assert set(result.failed) <= {"env"}, result.failed
    assert result.succeeded >= result.enqueued - result.failed["env"] > 0


def cancel_while_held(result: chaos.ScenarioResult) -> None:
    """Val rollouts cancelled while the bridge held them stayed cancelled (the fault notes an error for each
    that ran, which ``run`` refuses); the other held ones ran once a val worker started."""
    (note,) = [n for n in result.notes if n.startswith("cancelled ")]
    cancelled = int(note.split()[1])
    assert cancelled >= 2, note
    assert result.failed == {"cancelled": cancelled}, result.failed
    assert result.succeeded == result.enqueued - cancelled


def blocking_agent(result: chaos.ScenarioResult) -> None:
    """Agents blocked in a WebShop request with no client timeout were abandoned at their deadline (attempts
    failed, class timeout) and their rollouts ran again; none was lost or left running."""
    assert result.attempts_failed["timeout"] >= 1, result.attempts_failed
    assert set(result.failed) <= {"timeout"}, result.failed


@dataclass(frozen=True)
class Case:
    """What the suite adds to a registered scenario: the proof that its fault happened, and its size."""

    check: Callable[[chaos.ScenarioResult], None]
    cost: float  # rough serial seconds (tests/schedule.py)
    rollouts: int = ROLLOUTS
    slow: bool = False  # waits for an outage: left out by -m "not slow"
    nightly: str = ""  # why the scenario runs in the nightly-size run only (pytest -m nightly), or "" for every run


# The default run keeps the three faults behind "no rollout lost, none executed twice" at full size (killed workers,
# redelivered messages, a Store outage); the others run in the nightly-size run, each with a smaller test of the
# same path in every run (named in its reason).
CASES: dict[str, Case] = {
    "malformed": Case(malformed, 25, nightly="inputs failing as class input: test_execution.py, on every run"),
    "redeliver": Case(redeliver, 30),
    "kill-workers": Case(kill_workers, 75),
    "kill-bridge": Case(
        kill_bridge, 100, slow=True, nightly="a claim stranded by a dead bridge: test_dispatch.py, on every run"
    ),
    "restart-redis": Case(
        restart_redis, 40, slow=True, nightly="a message Redis lost: test_lost_message.py, on every run"
    ),
    "store-outage": Case(store_outage, 57, slow=True),
    "flaky-env-llm": Case(
        flaky_env_llm,
        70,
        slow=True,
        nightly="env and llm failure classes: test_execution.py and test_execution_bad_answers.py, on every run",
    ),
    # NaN purchases are drawn from the WebShop server's seeded fault stream, a fifth of them: 40 rollouts
    # make about 8, each retried.
    "non-finite-reward": Case(
        non_finite_reward,
        35,
        rollouts=40,
        nightly="a non-finite WebShop reward fails as env: test_execution_bad_answers.py, on every run",
    ),
    # A quarter are val rollouts held by the bridge: 40 gives 10, of which the fault needs 4.
    "cancel-while-held": Case(
        cancel_while_held,
        60,
        rollouts=40,
        nightly="a held rollout cancelled stays cancelled: test_held_rollouts.py, on every run",
    ),
    # 1% of WebShop requests stall, drawn from the server's seeded fault stream (the 14th is the first):
    # 40 rollouts make about 300 requests and so about 3 stalls, each abandoned at the 20 s deadline.
    "blocking-agent": Case(
        blocking_agent,
        50,
        rollouts=40,
        nightly="an agent blocked past its deadline: test_stuck_agents.py, on every run",
    ),
}
UNLISTED = Case(lambda result: None, 60)  # a scenario without a case yet still runs, with the audit's checks


def _params() -> list[object]:
    params: list[object] = []
    for name in chaos.SCENARIOS:
        case = CASES.get(name, UNLISTED)
        marks = [pytest.mark.cost(case.cost), *([pytest.mark.slow] if case.slow else [])]
        marks += [pytest.mark.nightly(case.nightly)] if case.nightly else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("name", _params())
def test_scenario_loses_nothing_and_its_fault_happened(
    name: str, services: LocalStack, chaos_services: LocalStack, tmp_path: Path
) -> None:
    case = CASES.get(name, UNLISTED)
    if name == "store-outage":
        assert "store" in services.processes, "the session's Store was not started by the tests: it cannot be paused"
    case.check(run(name, services, chaos_services, case.rollouts, tmp_path))
