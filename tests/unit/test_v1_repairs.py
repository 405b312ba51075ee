"""The 1.0 reconcile's rules on plain data: ``bridge.dispatch.v1.repairs.plan_v1_repairs`` (no Redis, no gateway).

One test per hazard of the module's docstring: a message that never started, a worker lost within and over
``AGL_V1_MAX_RERUNS``, a hand-over that counts against no limit, a kept outcome, an attempt id that is not a
number, a kept record that is not one, a stale in-flight entry; and what each is left alone for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bridge.core.coordination.markers import LeaseMarkers
from bridge.core.gateway import V1Rollout
from bridge.core.task import ERROR_CHARS, FailureClass, Outcome, OutcomeStatus
from bridge.dispatch.repairs import LOST_ON_DRAINED_QUEUE_S
from bridge.dispatch.v1.repairs import (
    ApplyKept,
    Fail,
    FreeSlot,
    Republish,
    Rerun,
    Unreadable,
    V1Facts,
    V1Plan,
    attempt_number,
    plan_v1_repairs,
)

NOW = 1_700_000_000.0
WAIT = 300.0  # max_queue_wait_s
CONFIRM = 25.0  # confirm_s

LEASED = LeaseMarkers(leased=True, started=True, reported=None)
LOST = LeaseMarkers(leased=False, started=True, reported=None)  # started; its executor is gone
DONE = LeaseMarkers(leased=False, started=True, reported="1")


def _rollout(n: int, attempt: str | None = "0") -> V1Rollout:
    return V1Rollout.model_validate(
        {
            "rollout_id": f"r{n}",
            "config": {"timeout_seconds": 60, "local": {"agent_class": "pkg:Agent"}},
            "status": {"state": "running", "last_attempt_id": attempt},
        }
    )


def _facts(*rollouts: V1Rollout, **fields: Any) -> V1Facts:
    """A scan: ``rollouts`` running on the gateway, nothing in flight, no marker or record in Redis."""
    defaults: dict[str, Any] = {
        "running": {f"v1-{r.rollout_id}-{r.status.last_attempt_id or '0'}": r for r in rollouts},
        "inflight": {},
        "executions": {},
        "kept": {},
        "handovers": {},
        "suspects": {},
        "now": NOW,
        "monotonic": NOW,
        "max_queue_wait_s": WAIT,
        "confirm_s": CONFIRM,
        "max_reruns": 1,
    }
    return V1Facts(**{**defaults, **fields})


def _confirmed(facts: V1Facts) -> V1Plan:
    """The second of two scans ``confirm_s`` apart that read the same facts; the first repairs nothing."""
    first = plan_v1_repairs(facts)
    assert first.repairs == (), first
    assert first.suspects, "the first scan must suspect something"
    return plan_v1_repairs(
        dataclasses.replace(facts, suspects=first.suspects, now=NOW + CONFIRM, monotonic=NOW + CONFIRM)
    )


# --- a message that never started -----------------------------------------------------------------------


@pytest.mark.parametrize("inflight", [{}, {"v1-r1-0": NOW - WAIT - 1}], ids=["no entry", "entry too old"])
def test_a_message_that_never_started_is_published_again_under_the_same_id(inflight: dict[str, float]) -> None:
    rollout = _rollout(1)
    plan = _confirmed(_facts(rollout, inflight=inflight))
    assert plan.repairs == (Republish(rollout, "0", "v1-r1-0"),) and plan.suspects == {}


def test_a_message_still_within_the_queue_wait_is_left_in_the_broker() -> None:
    plan = plan_v1_repairs(_facts(_rollout(1), inflight={"v1-r1-0": NOW - WAIT + 1}))
    assert plan == V1Plan((), {})


def test_a_message_the_broker_lost_on_a_drained_queue_is_published_again_within_seconds() -> None:
    """No message in the broker and a free slot for every attempt in flight: an entry nobody started for longer than
    ``LOST_ON_DRAINED_QUEUE_S`` was lost with the broker, not waiting in it."""
    rollout = _rollout(1)
    entry = {"v1-r1-0": NOW - LOST_ON_DRAINED_QUEUE_S - 1}
    plan = _confirmed(_facts(rollout, inflight=entry, drained=True))
    assert plan.repairs == (Republish(rollout, "0", "v1-r1-0"),)
    assert plan_v1_repairs(_facts(rollout, inflight=entry)) == V1Plan((), {})  # messages queued: it may wait there
    young = {"v1-r1-0": NOW - 2}
    assert plan_v1_repairs(_facts(rollout, inflight=young, drained=True)) == V1Plan((), {})  # on its way


@pytest.mark.parametrize("marks", [LEASED, DONE, LeaseMarkers(leased=True, started=False, reported=None)])
def test_an_attempt_an_executor_holds_or_finished_is_left_alone(marks: LeaseMarkers) -> None:
    assert plan_v1_repairs(_facts(_rollout(1), executions={"v1-r1-0": marks})) == V1Plan((), {})


def test_a_suspect_that_recovered_before_the_confirming_scan_is_forgotten() -> None:
    """Redis lost the lease; its holder renewed it before the second scan: nothing is re-run."""
    facts = _facts(_rollout(1), executions={"v1-r1-0": LOST})
    first = plan_v1_repairs(facts)
    again = dataclasses.replace(
        facts, executions={"v1-r1-0": LEASED}, suspects=first.suspects, now=NOW + CONFIRM, monotonic=NOW + CONFIRM
    )
    assert plan_v1_repairs(again) == V1Plan((), {})


# --- a lost worker --------------------------------------------------------------------------------------


def test_a_lost_worker_within_the_reruns_runs_the_rollout_again_as_the_next_attempt() -> None:
    rollout = _rollout(1)
    plan = _confirmed(_facts(rollout, executions={"v1-r1-0": LOST}))
    assert plan.repairs == (Rerun(rollout, "0", "v1-r1-0", "1", handover=False),)


def test_a_lost_worker_over_the_reruns_fails_the_rollout_with_the_reason() -> None:
    plan = _confirmed(_facts(_rollout(1, "1"), executions={"v1-r1-1": LOST}))
    assert plan.repairs == (
        Fail("r1", "1", "v1-r1-1", "the worker running attempt 1 was lost (AGL_V1_MAX_RERUNS=1 re-runs used)"),
    )


def test_hand_overs_count_against_no_rerun_limit() -> None:
    """Attempt 0 was handed over by a draining worker, attempt 1's worker is lost: one re-run is still owed."""
    rollout = _rollout(1, "1")
    plan = _confirmed(_facts(rollout, executions={"v1-r1-1": LOST}, handovers={"r1": 1}))
    assert plan.repairs == (Rerun(rollout, "1", "v1-r1-1", "2", handover=False),)


@pytest.mark.parametrize("max_reruns", [0, 1])
def test_a_hand_over_record_runs_the_rollout_again_at_once_whatever_the_limit(max_reruns: int) -> None:
    rollout = _rollout(1, "3")
    record = Outcome(OutcomeStatus.SKIPPED, "worker draining", FailureClass.SHUTDOWN, handover=True)
    plan = plan_v1_repairs(
        _facts(rollout, executions={"v1-r1-3": DONE}, kept={"v1-r1-3": record}, max_reruns=max_reruns)
    )
    assert plan.repairs == (Rerun(rollout, "3", "v1-r1-3", "4", handover=True),)


def test_a_hand_over_waits_while_an_executor_still_holds_the_attempt() -> None:
    record = Outcome(OutcomeStatus.SKIPPED, "worker draining", FailureClass.SHUTDOWN, handover=True)
    plan = plan_v1_repairs(_facts(_rollout(1), executions={"v1-r1-0": LEASED}, kept={"v1-r1-0": record}))
    assert plan == V1Plan((), {})


# --- kept records ---------------------------------------------------------------------------------------


def test_a_kept_outcome_is_applied_at_once_whatever_the_markers() -> None:
    kept = Outcome(OutcomeStatus.SUCCEEDED, "the agent exited with code 0")
    plan = plan_v1_repairs(_facts(_rollout(1), executions={"v1-r1-0": DONE}, kept={"v1-r1-0": kept}))
    assert plan.repairs == (ApplyKept("r1", "0", "v1-r1-0", kept),)


def test_a_kept_record_that_is_not_one_fails_the_rollout_with_the_reason() -> None:
    plan = plan_v1_repairs(_facts(_rollout(1), kept={"v1-r1-0": Unreadable("not JSON")}))
    assert plan.repairs == (
        Fail("r1", "0", "v1-r1-0", "the worker's kept outcome of attempt 0 could not be read: not JSON"),
    )


def test_records_old_and_new_are_read_and_a_failure_class_reaches_the_gateway_detail() -> None:
    old = Outcome.parse('{"state": "failed", "detail": "exit 1"}')
    assert old == Outcome(OutcomeStatus.FAILED, "exit 1", None) and old.message() == "exit 1"
    new = Outcome.parse(
        '{"state": "failed", "detail": "' + "x" * 5000 + '", "failure_class": "agent", "handover": false}'
    )
    detail = new.message()
    assert detail.startswith("[failure class: agent] x") and len(detail) == ERROR_CHARS
    handover = Outcome.parse('{"state": null, "detail": "draining", "failure_class": "shutdown", "handover": true}')
    assert handover.state is None and handover.handover
    for bad in ("{", "[]", '{"state": "cancelled"}', '{"state": "failed", "failure_class": 3}'):
        with pytest.raises(ValueError):
            Outcome.parse(bad)


# --- attempt ids ----------------------------------------------------------------------------------------


def test_an_attempt_id_that_is_not_a_number_fails_its_rollout_and_no_other() -> None:
    odd, lost = _rollout(1, "k8s-job-7"), _rollout(2)
    plan = _confirmed(_facts(odd, lost, executions={"v1-r1-k8s-job-7": LOST, "v1-r2-0": LOST}))
    assert plan.repairs == (
        Fail(
            "r1",
            "k8s-job-7",
            "v1-r1-k8s-job-7",
            "the worker running attempt 'k8s-job-7' was lost; that id is not numbered, so no attempt follows it",
        ),
        Rerun(lost, "0", "v1-r2-0", "1", handover=False),
    )


def test_only_ascii_digits_are_attempt_numbers() -> None:
    assert [attempt_number(a) for a in ("0", "12", "-1", "1.0", "²", "", "a")] == [0, 12] + [None] * 5


# --- slots ----------------------------------------------------------------------------------------------


def test_a_stale_in_flight_entry_no_running_rollout_waits_for_is_freed() -> None:
    inflight = {"v1-gone-0": NOW - WAIT - 5, "v1-young-0": NOW - 10, "v1-held-0": NOW - WAIT - 5}
    plan = plan_v1_repairs(_facts(inflight=inflight, executions={"v1-held-0": LEASED}))
    assert plan.repairs == (FreeSlot("v1-gone-0", WAIT + 5),)
