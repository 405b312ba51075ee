"""Reconciliation's rules on plain data: ``bridge.dispatch.v03.repairs.plan_repairs`` (no Redis, no Store).

One test per reconcile hazard of docs/architecture.md, "Guarantees", and per branch of the rules: what is
suspected, when it is confirmed, what is freed, re-published, handed back or dropped, and when the next
scan is due. The last tests are the V03Dispatcher's side of the schedule (``reconcile_by``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
import redis

from bridge.core.coordination.markers import LeaseMarkers
from bridge.core.infra import StoreError, UnknownIdError
from bridge.core.settings import load_settings
from bridge.core.store import AttemptedRollout, Rollout, RolloutConfig
from bridge.dispatch.repairs import LOST_ON_DRAINED_QUEUE_S
from bridge.dispatch.v03.dispatcher import V03Dispatcher
from bridge.dispatch.v03.repairs import (
    DropHeld,
    Facts,
    FreeLost,
    FreeOrphan,
    HandBack,
    Plan,
    Republish,
    Settle,
    active_attempts,
    dead_ends,
    plan_repairs,
    settled_status,
    why_not_settle,
)

US = "celery-bridge"  # the dispatcher id this bridge claims under
NOW = 1_700_000_000.0  # epoch seconds
MONO = 5_000.0  # the V03Dispatcher's monotonic clock
WAIT = 300.0  # max_queue_wait_s
CONFIRM = 25.0  # confirm_s
QUEUE = "rollouts"

LEASED = LeaseMarkers(leased=True, started=True, reported=None)
STARTED = LeaseMarkers(leased=False, started=True, reported=None)  # its executor is gone
REPORTED = LeaseMarkers(leased=False, started=True, reported="succeeded")


def _rollout(
    n: int,
    *,
    status: str = "preparing",
    attempt_status: str = "preparing",
    age_s: float | None = 5.0,
    worker_id: str | None = US,
) -> AttemptedRollout:
    attempt: dict[str, Any] = {"rollout_id": f"ro-{n}", "attempt_id": f"at-{n}", "status": attempt_status}
    if age_s is not None:
        attempt["start_time"] = NOW - age_s
    if worker_id is not None:
        attempt["worker_id"] = worker_id
    return AttemptedRollout.model_validate({"rollout_id": f"ro-{n}", "status": status, "attempt": attempt})


def _facts(*rollouts: AttemptedRollout, **fields: Any) -> Facts:
    """A scan's facts: ``rollouts`` active in the Store, nothing in flight, no marker in Redis, nothing held."""
    defaults: dict[str, Any] = {
        "active": {r.attempt.attempt_id: r for r in rollouts},
        "inflight": {},
        "executions": {},
        "held": frozenset(),
        "suspects": {},
        "now": NOW,
        "monotonic": MONO,
        "dispatcher_id": US,
        "max_queue_wait_s": WAIT,
        "confirm_s": CONFIRM,
    }
    return Facts(**{**defaults, **fields})


def _nothing_done(plan: Plan) -> bool:
    return not (plan.drops or plan.frees or plan.restarts or plan.settles)


def _confirmed(facts: Facts) -> Plan:
    """The second of two scans ``confirm_s`` apart that read the same facts; the first repairs nothing."""
    first = plan_repairs(facts)
    assert not (first.frees or first.restarts or first.settles), first
    return plan_repairs(dataclasses.replace(facts, suspects=first.suspects, monotonic=MONO + CONFIRM))


# --- the hazards of docs/architecture.md, "Guarantees" -----------------------------------------------------


def test_a_claim_the_bridge_crashed_before_publishing_is_republished() -> None:
    """The bridge crashed between dequeue and publish: ours, in no message, no lease."""
    stranded = _rollout(1)
    plan = _confirmed(_facts(stranded))
    assert plan.restarts == (Republish(stranded, executor_died=False),)
    assert plan.frees == () and plan.suspects == {}


def test_a_stranded_claim_too_old_to_start_in_time_is_handed_back() -> None:
    old = _rollout(1, age_s=WAIT + 1)
    assert _confirmed(_facts(old)).restarts == (HandBack(old),)


@pytest.mark.parametrize("attempt_age_s", [WAIT + 60, 5.0], ids=["attempt old: handed back", "only entry old"])
def test_an_entry_the_broker_never_took_is_freed_and_its_attempt_restarted(attempt_age_s: float) -> None:
    """The bridge crashed while the broker took the message: an in-flight entry past the longest queue wait
    that nobody started or holds; its slot is freed and its attempt goes through the stranded rule."""
    killed = _rollout(1, age_s=attempt_age_s)
    plan = _confirmed(_facts(killed, inflight={QUEUE: {"at-1": NOW - WAIT - 5}}))
    assert plan.frees == (FreeLost(QUEUE, "at-1", in_flight_s=WAIT + 5),)
    expected = HandBack(killed) if attempt_age_s > WAIT else Republish(killed, executor_died=False)
    assert plan.restarts == (expected,)


def test_a_message_the_broker_lost_on_a_drained_queue_is_republished_within_seconds_not_after_the_queue_wait() -> None:
    """A Redis crash before its append-only file synced took a published message: its entry is in flight, nobody
    started it, and the queue is drained (no message in the broker, a free slot for every attempt in flight). Past
    ``LOST_ON_DRAINED_QUEUE_S`` it is lost: freed and re-published, two scans ``confirm_s`` apart, instead of after
    ``max_queue_wait_s`` (300 s by default: the straggler that held a whole batch for minutes)."""
    lost = _rollout(1, age_s=LOST_ON_DRAINED_QUEUE_S + 2)
    entries = {QUEUE: {"at-1": NOW - LOST_ON_DRAINED_QUEUE_S - 1}}
    plan = _confirmed(_facts(lost, inflight=entries, drained=frozenset({QUEUE})))
    assert plan.frees == (FreeLost(QUEUE, "at-1", in_flight_s=LOST_ON_DRAINED_QUEUE_S + 1),)
    assert plan.restarts == (Republish(lost, executor_died=False),)
    waiting = plan_repairs(_facts(lost, inflight=entries))  # messages still queued: it may be one of them
    assert _nothing_done(waiting) and waiting.suspects == {}
    young = plan_repairs(_facts(lost, inflight={QUEUE: {"at-1": NOW - 3}}, drained=frozenset({QUEUE})))
    assert _nothing_done(young) and young.suspects == {}  # on its way to a worker: looked at again when it'd be lost
    assert young.rescan_by == MONO + 10.0


def test_a_dead_worker_hosts_started_attempts_are_freed_and_restarted_with_a_clock_of_their_own() -> None:
    """A worker host died holding messages: in flight, started, no lease. A ``preparing`` one is handed back however
    young: run again in place it would keep its first start's deadline (the Store times an attempt from its
    dequeue), and the rollout's next attempt has a full budget. A ``running`` one is re-published however old: the
    takeover reports it ``failed`` (infra) and the Store's retry policy starts a fresh attempt."""
    preparing, running = _rollout(1), _rollout(2, status="running", attempt_status="running", age_s=WAIT * 10)
    inflight = {QUEUE: {"at-1": NOW - 30, "at-2": NOW - 30}}
    plan = _confirmed(_facts(preparing, running, inflight=inflight, executions={"at-1": STARTED, "at-2": STARTED}))
    assert plan.frees == (FreeOrphan(QUEUE, "at-1"), FreeOrphan(QUEUE, "at-2"))
    assert plan.restarts == (HandBack(preparing), Republish(running, executor_died=True))


def test_a_message_a_dead_worker_reserved_but_never_started_keeps_its_slot() -> None:
    """Nothing tells it from a message still waiting in the broker: nothing is suspected until it is lost."""
    waiting = _rollout(1)
    plan = plan_repairs(_facts(waiting, inflight={QUEUE: {"at-1": NOW - 30}}, suspects={"at-1": MONO - CONFIRM}))
    assert _nothing_done(plan) and plan.suspects == {}


def test_a_cancelled_held_rollout_is_dropped_at_once_and_never_restarted() -> None:
    """The trainer cancelled a rollout the bridge holds: the Store no longer lists it as active."""
    plan = plan_repairs(_facts(held=frozenset({"at-1"})))
    assert plan.drops == (DropHeld("at-1", "no longer active"),)
    assert plan.frees == () and plan.restarts == () and plan.suspects == {}


def test_a_redis_restart_that_lost_the_markers_repairs_nothing_before_two_scans_confirm_s_apart() -> None:
    lost_lease = _rollout(1)  # its executor runs it and renews on its next heartbeat
    first = plan_repairs(_facts(lost_lease))
    assert _nothing_done(first)
    assert first.suspects == {"at-1": MONO}
    assert first.rescan_by == MONO + CONFIRM + 0.5
    early = plan_repairs(_facts(lost_lease, suspects=first.suspects, monotonic=MONO + CONFIRM - 0.1))
    assert _nothing_done(early) and early.suspects == {"at-1": MONO}
    renewed = plan_repairs(
        _facts(lost_lease, suspects=first.suspects, monotonic=MONO + CONFIRM, executions={"at-1": LEASED})
    )
    assert _nothing_done(renewed) and renewed.suspects == {} and renewed.rescan_by is None


# --- the branches of the rules ------------------------------------------------------------------------------


def test_a_new_leaders_first_scan_only_suspects() -> None:
    """A new leader has seen nothing yet: every kind of repair waits for its confirming scan."""
    facts = _facts(
        _rollout(1),
        _rollout(2),
        _rollout(3),
        inflight={QUEUE: {"at-2": NOW - WAIT - 5, "at-3": NOW - 30}},
        executions={"at-3": STARTED},
    )
    plan = plan_repairs(facts)
    assert _nothing_done(plan)
    assert plan.suspects == {"at-1": MONO, "at-2": MONO, "at-3": MONO}
    assert plan.rescan_by == MONO + CONFIRM + 0.5
    assert facts.suspects == {}  # the facts are read, never written


def test_a_suspect_is_confirmed_by_the_scan_confirm_s_after_it_was_first_seen() -> None:
    facts = _facts(_rollout(1), _rollout(2), suspects={"at-1": MONO - CONFIRM, "at-2": MONO - CONFIRM + 3})
    plan = plan_repairs(facts)
    assert [restart.rollout.rollout_id for restart in plan.restarts] == ["ro-1"]
    assert plan.suspects == {"at-2": MONO - CONFIRM + 3}  # kept with the time it was first seen
    assert plan.rescan_by == MONO + 3 + 0.5


def test_a_suspect_no_longer_seen_is_forgotten_and_starts_over_if_seen_again() -> None:
    cleared = plan_repairs(_facts(suspects={"at-1": MONO - 2 * CONFIRM}))
    assert cleared.suspects == {} and cleared.rescan_by is None
    again = plan_repairs(_facts(_rollout(1), suspects=cleared.suspects))
    assert again.suspects == {"at-1": MONO} and _nothing_done(again)


@pytest.mark.parametrize(
    ("attempt_status", "worker_id", "marks", "stranded"),
    [
        ("preparing", US, LeaseMarkers(False, False, None), True),  # claimed by us, in no message
        ("preparing", "another-bridge", LeaseMarkers(False, False, None), False),  # another dispatcher's claim
        ("preparing", "another-bridge", STARTED, True),  # an executor started it and is gone
        ("preparing", US, LEASED, False),  # an executor runs it
        ("preparing", US, REPORTED, False),  # finished; the Store will hear of it
        ("running", US, LeaseMarkers(False, False, None), False),  # no executor of ours ever started it
        ("running", "another-bridge", STARTED, True),
        ("running", US, LEASED, False),
    ],
)
def test_which_active_attempts_in_no_message_count_as_stranded(
    attempt_status: str, worker_id: str, marks: LeaseMarkers, stranded: bool
) -> None:
    rollout = _rollout(1, status=attempt_status, attempt_status=attempt_status, worker_id=worker_id)
    plan = plan_repairs(_facts(rollout, executions={"at-1": marks}, suspects={"at-1": MONO - CONFIRM}))
    assert bool(plan.restarts) == stranded


def test_a_running_attempt_is_republished_however_old_and_one_without_a_start_time_counts_as_young() -> None:
    running = _rollout(1, status="running", attempt_status="running", age_s=WAIT * 10)
    timeless = _rollout(2, age_s=None)
    plan = _confirmed(_facts(running, timeless, executions={"at-1": STARTED}))
    assert plan.restarts == (Republish(running, executor_died=True), Republish(timeless, executor_died=False))


def test_an_orphan_already_reported_or_no_longer_active_is_only_freed() -> None:
    """Its report went through (a done marker) or the Store moved on: only the slot is left to repair."""
    reported, reported_unstarted = _rollout(1), _rollout(3)  # the second's started marker is gone, not its report
    inflight = {QUEUE: {"at-1": NOW - 30, "at-2": NOW - 30, "at-3": NOW - WAIT - 5}}
    executions = {
        "at-1": REPORTED,
        "at-2": STARTED,
        "at-3": LeaseMarkers(leased=False, started=False, reported="failed"),
    }
    plan = _confirmed(_facts(reported, reported_unstarted, inflight=inflight, executions=executions))
    assert plan.frees == (FreeOrphan(QUEUE, "at-1"), FreeOrphan(QUEUE, "at-2"), FreeOrphan(QUEUE, "at-3"))
    assert plan.restarts == ()


def test_a_leased_in_flight_attempt_is_never_touched() -> None:
    plan = plan_repairs(
        _facts(
            _rollout(1, age_s=WAIT * 2),
            inflight={QUEUE: {"at-1": NOW - WAIT * 2}},
            executions={"at-1": LEASED},
            suspects={"at-1": MONO - CONFIRM},
        )
    )
    assert _nothing_done(plan) and plan.suspects == {} and plan.rescan_by is None


def test_a_lost_entry_whose_attempt_is_requeued_or_running_is_only_freed() -> None:
    """Lost entries restart only attempts still active and ``preparing``: a requeued one (not active) and a
    running one (the Store saw progress) keep their course."""
    running = _rollout(2, status="running", attempt_status="running")
    inflight = {QUEUE: {"at-1": NOW - WAIT - 5, "at-2": NOW - WAIT - 5}}
    plan = _confirmed(_facts(running, inflight=inflight))
    assert [free.attempt_id for free in plan.frees] == ["at-1", "at-2"]
    assert all(isinstance(free, FreeLost) for free in plan.frees)
    assert plan.restarts == ()


def test_a_young_unstarted_entry_is_looked_at_again_when_it_would_be_lost() -> None:
    young = plan_repairs(_facts(inflight={QUEUE: {"at-1": NOW - WAIT + 100}}))
    assert _nothing_done(young) and young.suspects == {}
    assert young.rescan_by == pytest.approx(MONO + 100 + 1.0)
    almost = plan_repairs(_facts(inflight={QUEUE: {"at-1": NOW - WAIT + 2, "at-2": NOW - WAIT + 100}}))
    assert almost.rescan_by == MONO + 10.0  # no sooner than 10 s from now


def test_the_next_scan_is_due_at_the_earliest_of_a_young_entry_and_a_suspect() -> None:
    facts = _facts(_rollout(2), inflight={QUEUE: {"at-1": NOW - WAIT + 15}})
    assert plan_repairs(facts).rescan_by == pytest.approx(MONO + 15 + 1.0)
    assert plan_repairs(dataclasses.replace(facts, confirm_s=5.0)).rescan_by == MONO + 5.0 + 0.5


@pytest.mark.parametrize(
    ("status", "attempt_status", "store_says"),
    [
        ("running", "running", "rollout running, attempt running"),  # a worker started it
        ("running", "preparing", "rollout running, attempt preparing"),
        ("preparing", "running", "rollout preparing, attempt running"),
    ],
)
def test_a_held_rollout_the_store_moved_on_from_is_dropped_with_what_the_store_says(
    status: str, attempt_status: str, store_says: str
) -> None:
    moved_on = _rollout(1, status=status, attempt_status=attempt_status)
    plan = plan_repairs(_facts(moved_on, held=frozenset({"at-1"}), executions={"at-1": LEASED}))
    assert plan.drops == (DropHeld("at-1", store_says),)


def test_a_held_rollout_the_store_still_shows_claimed_is_kept_and_not_stranded() -> None:
    held, stranded = _rollout(1), _rollout(2)
    plan = _confirmed(_facts(held, stranded, held=frozenset({"at-1"})))
    assert plan.drops == ()
    assert plan.restarts == (Republish(stranded, executor_died=False),)


def test_each_entry_is_freed_from_the_queue_that_lists_it_lost_entries_first() -> None:
    inflight = {"rollouts-train": {"at-2": NOW - WAIT - 5}, "rollouts-val": {"at-1": NOW - 30}}
    plan = _confirmed(_facts(inflight=inflight, executions={"at-1": STARTED}))
    assert plan.frees == (FreeLost("rollouts-train", "at-2", WAIT + 5), FreeOrphan("rollouts-val", "at-1"))


def test_repairs_are_sorted_by_attempt_id() -> None:
    rollouts = [_rollout(n) for n in (3, 1, 2)]
    plan = _confirmed(_facts(*rollouts, held=frozenset({"at-9", "at-7"})))
    assert [restart.rollout.rollout_id for restart in plan.restarts] == ["ro-1", "ro-2", "ro-3"]
    assert [drop.attempt_id for drop in plan.drops] == ["at-7", "at-9"]


def test_nothing_to_repair_plans_nothing() -> None:
    plan = plan_repairs(_facts(_rollout(1), executions={"at-1": LEASED}))
    assert plan == Plan(drops=(), frees=(), restarts=(), suspects={}, rescan_by=None)


def test_only_latest_attempts_preparing_or_running_are_active() -> None:
    queuing = Rollout.model_validate({"rollout_id": "ro-0", "status": "queuing"})
    finished = _rollout(3, status="succeeded", attempt_status="succeeded")
    preparing, running = _rollout(1), _rollout(2, status="running", attempt_status="running")
    assert active_attempts([queuing, preparing, running, finished]) == {"at-1": preparing, "at-2": running}


# --- dead ends: active rollouts whose latest attempt finished -------------------------------------------------


def _dead_end(
    n: int, *, status: str = "running", attempt_status: str = "failed", sequence_id: int = 1, **config: Any
) -> AttemptedRollout:
    """A rollout the Store shows ``status`` with its latest attempt ``attempt_status`` (a late span's doing)."""
    rollout = _rollout(n, status=status, attempt_status=attempt_status)
    attempt = rollout.attempt.model_copy(update={"sequence_id": sequence_id})
    retries = RolloutConfig.model_validate({"max_attempts": 3, "retry_condition": ["failed", "timeout"], **config})
    return rollout.model_copy(update={"attempt": attempt, "config": retries})


def _dead_facts(*rollouts: AttemptedRollout, **fields: Any) -> Facts:
    return _facts(active={}, dead_ends={r.attempt.attempt_id: r for r in rollouts}, **fields)


def test_a_rollout_a_late_span_revived_after_its_failed_report_requeued_it_is_requeued_again() -> None:
    """A span batch for a ``failed`` attempt that the Store took after the report had requeued the rollout made
    it ``running`` again with no live attempt: confirmed over two scans, put back to ``requeuing``."""
    revived = _dead_end(1)
    first = plan_repairs(_dead_facts(revived))
    assert _nothing_done(first) and first.suspects == {"at-1": MONO}
    assert first.rescan_by == MONO + CONFIRM + 0.5
    plan = _confirmed(_dead_facts(revived))
    assert plan.settles == (Settle(revived, "requeuing"),)
    assert not (plan.drops or plan.frees or plan.restarts) and plan.suspects == {}


def test_a_dead_end_whose_attempt_an_executor_still_leases_is_never_touched() -> None:
    plan = _confirmed(_dead_facts(_dead_end(1), executions={"at-1": LEASED}))
    assert _nothing_done(plan) and plan.suspects == {}


def test_a_dead_end_that_settles_before_the_confirming_scan_is_forgotten() -> None:
    first = plan_repairs(_dead_facts(_dead_end(1)))
    later = plan_repairs(_facts(suspects=first.suspects, monotonic=MONO + CONFIRM))
    assert _nothing_done(later) and later.suspects == {}


@pytest.mark.parametrize(
    ("attempt_status", "sequence_id", "config", "expected"),
    [
        ("failed", 1, {}, "requeuing"),
        ("timeout", 2, {}, "requeuing"),
        ("failed", 3, {}, "failed"),  # no attempt left
        ("failed", 1, {"retry_condition": ["timeout"]}, "failed"),  # not a status the trainer retries
        ("failed", 1, {"max_attempts": 1, "retry_condition": []}, "failed"),  # the Store's defaults
        ("succeeded", 1, {}, "succeeded"),
    ],
)
def test_a_dead_end_is_settled_as_the_stores_retry_policy_would(
    attempt_status: str, sequence_id: int, config: dict[str, Any], expected: str
) -> None:
    rollout = _dead_end(1, attempt_status=attempt_status, sequence_id=sequence_id, **config)
    assert settled_status(attempt_status, sequence_id, rollout.config) == expected
    assert _confirmed(_dead_facts(rollout)).settles == (Settle(rollout, expected),)


def test_which_rollouts_are_dead_ends() -> None:
    revived = _dead_end(1)
    preparing_failed = _dead_end(2, status="preparing")
    timed_out = _dead_end(3, attempt_status="timeout")
    unresponsive = _dead_end(4, attempt_status="unresponsive")  # a span from it revives it: not ended
    live = _rollout(5, status="running", attempt_status="running")
    requeued = _dead_end(6, status="requeuing")
    cancelled = _dead_end(7, status="cancelled")
    finished = _rollout(8, status="succeeded", attempt_status="succeeded")
    queuing = Rollout.model_validate({"rollout_id": "ro-0", "status": "queuing"})
    listed = [revived, preparing_failed, timed_out, unresponsive, live, requeued, cancelled, finished, queuing]
    found = dead_ends(listed)
    assert found == {"at-1": revived, "at-2": preparing_failed, "at-3": timed_out}


def test_a_dead_end_is_settled_only_while_a_re_read_still_shows_it() -> None:
    """Right before the write the V03Dispatcher reads the rollout again: a cancel, a retry or a newer attempt
    since the scan leaves it alone."""
    settle = Settle(_dead_end(1), "requeuing")
    assert why_not_settle(_dead_end(1), settle) is None
    assert why_not_settle(_dead_end(1, status="cancelled"), settle) == "the rollout is cancelled"
    assert why_not_settle(_dead_end(1, status="requeuing"), settle) == "the rollout is requeuing"
    newer = _rollout(1, status="running", attempt_status="running")
    newer = newer.model_copy(update={"attempt": newer.attempt.model_copy(update={"attempt_id": "at-1b"})})
    assert why_not_settle(newer, settle) == "a later attempt superseded it"
    assert why_not_settle(_dead_end(1, attempt_status="timeout"), settle) == "its attempt is timeout"
    assert why_not_settle(Rollout.model_validate({"rollout_id": "ro-1", "status": "running"}), settle) is not None


# --- the V03Dispatcher's schedule --------------------------------------------------------------------------


class _UnreachableStore:
    def list_rollouts(self, **_: Any) -> tuple[list[Rollout], int]:
        raise StoreError("the Store is down")


def _dispatcher(store: object) -> V03Dispatcher:
    settings = load_settings(store_url="http://127.0.0.1:9", broker_url="redis://127.0.0.1:9/0")
    unreachable = redis.Redis(port=9, socket_connect_timeout=0.2)  # never connected to by these tests
    return V03Dispatcher(settings, store, unreachable, None)  # type: ignore[arg-type]


def test_reconcile_requests_keep_the_earliest() -> None:
    dispatcher = _dispatcher(None)
    dispatcher.next_reconcile = math.inf
    dispatcher.reconcile_by(30.0)
    dispatcher.reconcile_by(50.0)
    assert dispatcher.next_reconcile == 30.0
    dispatcher.reconcile_by(0.0)
    assert dispatcher.next_reconcile == 0.0


def test_a_scan_that_cannot_read_its_facts_answers_earlier_requests_and_tries_again_in_10_s() -> None:
    dispatcher = _dispatcher(_UnreachableStore())
    dispatcher.suspects = {"at-1": 1.0}
    dispatcher.next_reconcile = 0.0
    assert dispatcher.reconcile() == 0
    assert dispatcher.next_reconcile == pytest.approx(time.monotonic() + 10.0, abs=1.0)
    assert dispatcher.suspects == {"at-1": 1.0}  # nothing seen: nothing forgotten


class _SettleStore:
    """Answers the re-read with ``current`` (or raises it) and records the writes."""

    def __init__(self, current: object) -> None:
        self.current = current
        self.writes: list[tuple[str, dict[str, Any]]] = []

    def get_rollout(self, rollout_id: str) -> object:
        if isinstance(self.current, Exception):
            raise self.current
        return self.current

    def update_rollout(self, rollout_id: str, **fields: Any) -> None:
        self.writes.append((rollout_id, fields))


@pytest.mark.parametrize(
    ("current", "writes"),
    [
        (_dead_end(1), [("ro-1", {"status": "requeuing"})]),
        (_dead_end(1, status="cancelled"), []),  # cancelled since the scan: stays cancelled
        (StoreError("the Store is down"), []),  # the next scan sees it again
        (UnknownIdError("gone", path="/rollouts/ro-1"), []),
    ],
)
def test_the_dispatcher_settles_a_dead_end_only_after_a_re_read_and_never_raises(
    current: object, writes: list[tuple[str, dict[str, Any]]]
) -> None:
    store = _SettleStore(current)
    _dispatcher(store)._settle(Settle(_dead_end(1), "requeuing"))
    assert store.writes == writes
