"""What the 1.0 dispatcher's reconcile repairs, decided from facts alone: ``plan_v1_repairs(facts) -> V1Plan``.

``bridge.dispatch.v1`` reads the facts (the gateway's ``running`` rollouts, its ``v1-`` in-flight entries, the
attempts' lease/started/done markers and kept records, the rollouts' hand-overs), plans, and carries the
repairs out in order. Nothing here does I/O. For each running rollout's current attempt (its key
``attempt_key(rollout, last_attempt_id)``):

* kept outcome: the worker could not tell the gateway: the outcome is applied (a failed one names its
  failure class), the record dropped. An unreadable record fails the rollout with the reason.
* hand-over (a draining worker's record): re-run under the next attempt id, not counted against
  ``AGL_V1_MAX_RERUNS``; left alone while an executor still holds the attempt.
* leased or done: an executor runs or ran it: nothing to do.
* never started: no in-flight entry, or one older than ``max_queue_wait_s`` (on a drained queue, than
  ``LOST_ON_DRAINED_QUEUE_S``: ``bridge.dispatch.repairs.queue_wait_limit``): published again under the same id (the
  worker's lease and done marker drop a duplicate).
* lost worker: started, unleased, not done: re-run under the next attempt id while the re-runs used
  (attempts numbered so far, less the hand-overs) stay under ``max_reruns``, else failed with the reason.
  An attempt id that is not a number cannot be followed by another: failed with the reason.
* stale in-flight entry: a ``v1-`` entry no running rollout waits for, older than ``max_queue_wait_s`` and
  unleased: its slot is freed.

As in the 0.3 line's plan (``bridge.dispatch.v03.repairs``), what is repaired because nothing shows an executor
(never started, lost worker) is repaired only once it looked so on two scans ``confirm_s`` apart
(``bridge.dispatch.repairs.confirm_suspects``). Kept records and stale entries are acted on at
once (the record is the worker's own word; a stale entry frees only a slot).

The 0.3 reconcile's dead end has no counterpart here: the gateway never moves a rollout out of ``succeeded`` or
``failed``, retries nothing, takes no spans, and a late event changes no status (docs/agl-v1.md, "Guarantees").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bridge.core.coordination.markers import NO_TRACE, LeaseMarkers
from bridge.core.gateway import FIRST_ATTEMPT, V1Rollout, attempt_key
from bridge.core.task import Outcome
from bridge.dispatch.repairs import confirm_suspects, queue_wait_limit


@dataclass(frozen=True)
class Unreadable:
    """A kept record that is not one (``Outcome.parse`` refused it): ``why`` says how."""

    why: str


@dataclass(frozen=True)
class V1Facts:
    """One scan's reading and the settings its rules use. Clocks: ``now`` epoch seconds (in-flight entries),
    ``monotonic`` the dispatcher's scheduling clock (``suspects``), as in the 0.3 line's facts."""

    running: Mapping[str, V1Rollout]  # attempt key of its current attempt -> the running rollout
    inflight: Mapping[str, float]  # attempt key -> when it was recorded in flight (``v1-`` entries only)
    executions: Mapping[str, LeaseMarkers]  # attempt key -> its Redis markers; an absent key has none
    kept: Mapping[str, Outcome | Unreadable]  # attempt key -> the worker's kept record, where one is
    handovers: Mapping[str, int]  # rollout id -> attempts of it handed over by draining workers
    suspects: Mapping[str, float]  # attempt key -> when a scan first saw it in need of a re-publish or re-run
    now: float
    monotonic: float  # the dispatcher's scheduling clock, of ``suspects``
    max_queue_wait_s: float
    confirm_s: float
    max_reruns: int
    drained: bool = False  # the line's queue shows a lost message within seconds (``LineDispatcher.drained_queues``)


@dataclass(frozen=True)
class ApplyKept:
    """Set the kept outcome on the gateway (if the attempt is still current), then drop the record."""

    rollout_id: str
    attempt_id: str
    key: str
    outcome: Outcome


@dataclass(frozen=True)
class Republish:
    """Publish the attempt again under the same task id: its message never started."""

    rollout: V1Rollout
    attempt_id: str
    key: str


@dataclass(frozen=True)
class Rerun:
    """Make ``next_attempt_id`` the rollout's current attempt, free the old one's slot, publish the new one.
    ``handover``: a draining worker asked for it (counted as such, not as a re-run; its record is dropped)."""

    rollout: V1Rollout
    attempt_id: str
    key: str
    next_attempt_id: str
    handover: bool


@dataclass(frozen=True)
class Fail:
    """Fail the rollout's current attempt with ``reason``; free its slot and drop any record of it."""

    rollout_id: str
    attempt_id: str
    key: str
    reason: str


@dataclass(frozen=True)
class FreeSlot:
    """Forget an in-flight entry no running rollout waits for and nobody holds."""

    key: str
    in_flight_s: float


Repair = ApplyKept | Republish | Rerun | Fail | FreeSlot


@dataclass(frozen=True)
class V1Plan:
    repairs: tuple[Repair, ...]  # in the order of the running rollouts' keys, then the freed slots
    suspects: Mapping[str, float]  # the next scan's ``V1Facts.suspects``
    rescan_by: float | None = None  # the 1.0 plan asks for no earlier scan

    @property
    def made(self) -> int:
        """What a scan reports: the repairs planned."""
        return len(self.repairs)


def current_key(rollout: V1Rollout) -> str:
    """The attempt key of a rollout's current attempt (``"0"`` before any was named)."""
    return attempt_key(rollout.rollout_id, rollout.status.last_attempt_id or FIRST_ATTEMPT)


def attempt_number(attempt_id: str) -> int | None:
    """The number of an attempt id this dispatcher names (``"0"``, ``"1"``, ...); None for any other id."""
    return int(attempt_id) if attempt_id.isascii() and attempt_id.isdigit() else None


def plan_v1_repairs(facts: V1Facts) -> V1Plan:
    """The repairs these facts call for (module docstring); pure: the same facts, the same plan."""
    repairs: list[Repair] = []
    unconfirmed: dict[str, V1Rollout] = {}  # key -> rollout, for attempts nobody shows running
    for key in sorted(facts.running):
        rollout = facts.running[key]
        attempt_id = rollout.status.last_attempt_id or FIRST_ATTEMPT
        marks = facts.executions.get(key, NO_TRACE)
        kept = facts.kept.get(key)
        if isinstance(kept, Unreadable):
            reason = f"the worker's kept outcome of attempt {attempt_id} could not be read: {kept.why}"
            repairs.append(Fail(rollout.rollout_id, attempt_id, key, reason))
        elif kept is not None and kept.handover:
            if not marks.leased:
                repairs.append(_next_or_fail(rollout, attempt_id, key, facts, handover=True))
        elif kept is not None and kept.state is not None:
            repairs.append(ApplyKept(rollout.rollout_id, attempt_id, key, kept))
        elif not (marks.leased or marks.done):
            published = facts.inflight.get(key)
            waiting = published is not None and facts.now - published <= queue_wait_limit(
                facts.drained, facts.max_queue_wait_s
            )
            if marks.started or not waiting:
                unconfirmed[key] = rollout
    confirmed, suspects = confirm_suspects(set(unconfirmed), facts.suspects, facts.monotonic, facts.confirm_s)
    for key in sorted(confirmed):
        rollout = unconfirmed[key]
        attempt_id = rollout.status.last_attempt_id or FIRST_ATTEMPT
        if facts.executions.get(key, NO_TRACE).started:
            repairs.append(_next_or_fail(rollout, attempt_id, key, facts, handover=False))
        else:
            repairs.append(Republish(rollout, attempt_id, key))
    for key in sorted(set(facts.inflight) - set(facts.running)):
        age = facts.now - facts.inflight[key]
        if age > facts.max_queue_wait_s and not facts.executions.get(key, NO_TRACE).leased:
            repairs.append(FreeSlot(key, age))
    return V1Plan(tuple(repairs), suspects)


def _next_or_fail(rollout: V1Rollout, attempt_id: str, key: str, facts: V1Facts, *, handover: bool) -> Rerun | Fail:
    """The next attempt of a rollout whose attempt was handed over or lost, or its failure with the reason."""
    number = attempt_number(attempt_id)
    why = "was handed over by a draining worker" if handover else "was lost"
    if number is None:
        reason = f"the worker running attempt {attempt_id!r} {why}; that id is not numbered, so no attempt follows it"
        return Fail(rollout.rollout_id, attempt_id, key, reason)
    reruns_used = number - facts.handovers.get(rollout.rollout_id, 0)
    if handover or reruns_used < facts.max_reruns:
        return Rerun(rollout, attempt_id, key, str(number + 1), handover)
    reason = f"the worker running attempt {attempt_id} was lost (AGL_V1_MAX_RERUNS={facts.max_reruns} re-runs used)"
    return Fail(rollout.rollout_id, attempt_id, key, reason)
