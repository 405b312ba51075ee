"""What the 0.3 line's reconcile repairs, decided from facts alone: ``plan_repairs(facts) -> Plan``.

The 0.3 line (``bridge.dispatch.v03``) reads the facts (the Store's active attempts, its in-flight entries, the
executions' Redis markers, its held rollouts, the clocks), plans, and applies the plan in order: first ``drops``,
then ``frees``, then ``restarts``, then ``settles``. Nothing here does I/O. The hazards are those of
docs/architecture.md, "Guarantees" (bridge crash or Redis data loss, dead worker host, a cancelled held rollout, a
rollout revived with no live attempt):

* stranded: an active attempt this dispatcher claimed (or an executor started) that no in-flight entry
  carries and no executor holds or finished: published again under the same task id, or handed back when
  it is ``preparing`` and older than ``max_queue_wait_s`` or an executor started it (and died). The Store times
  an attempt from its dequeue (docs/store-protocol.md 6.3), so a lost executor's attempt run again in place would
  inherit its first start's deadline; handed back, the rollout's next attempt has a budget of its own. A
  ``running`` one is published: the takeover reports it ``failed`` (infra) sooner than the Store's watchdog or
  the visibility timeout would, and the Store's retry policy starts a fresh attempt.
* orphaned: an in-flight entry whose executor started (or finished) it and holds no lease: its slot is
  freed, and its attempt, if still active and unreported, counts as stranded.
* lost in flight: an in-flight entry older than ``max_queue_wait_s`` that no executor started, holds or
  finished: its message never reached the broker or expired unstarted; on a drained queue (no message in the
  broker, a free slot for every attempt in flight) already after ``LOST_ON_DRAINED_QUEUE_S``: the broker lost it
  (``bridge.dispatch.repairs.queue_wait_limit``). Its slot is freed, and its attempt, if still active and
  ``preparing``, counts as stranded (re-published while younger than ``max_queue_wait_s``).
* moved on: a held rollout whose Store record is no longer a ``preparing`` rollout with our attempt
  ``preparing``: dropped from the hold, never published or handed back. Held rollouts the Store still
  shows as claimed are not stranded: they wait for room on purpose.
* dead end: a rollout the Store shows ``preparing`` or ``running`` whose latest attempt has finished
  (``failed``, ``timeout``, ``succeeded``; not ``unresponsive``, which a span revives) and that no executor
  holds a lease on. The Store leaves one so when a span batch for a ``failed`` attempt lands after the
  report requeued the rollout: the rollout turns ``running``, the attempt stays ``failed``, and the queued
  retry is skipped on dequeue. It is settled to the status the Store's retry policy derives from that
  attempt (``requeuing`` while ``retry_condition`` and ``max_attempts`` allow a retry, else ``failed``;
  ``succeeded`` for a succeeded one) if a re-read right before the write still shows it so
  (``why_not_settle``). Whoever claimed it: the repair is the Store's own decision, written again.

Only the drops are immediate. Everything else is repaired once it looked so on two scans at least ``confirm_s``
apart (``bridge.dispatch.repairs.confirm_suspects``); for a dead end the wait also lets writes still on their way to
the Store (a trainer's cancel, another writer's repair) land before the bridge writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from bridge.core.coordination.markers import NO_TRACE, LeaseMarkers
from bridge.core.store import (
    ACTIVE_ATTEMPT,
    ACTIVE_ROLLOUT,
    FINISHED_ATTEMPT,
    AttemptedRollout,
    AttemptStatus,
    Rollout,
    RolloutConfig,
    RolloutStatus,
)
from bridge.dispatch.repairs import confirm_suspects, queue_wait_limit

# Lost-in-flight entries: the next scan looks again when the youngest unstarted entry crosses the longest
# queue wait (plus this margin), but not sooner than ``RESCAN_FLOOR_S`` from now.
LOST_MARGIN_S = 1.0
RESCAN_FLOOR_S = 10.0
# Suspects: the confirming scan runs this long after the first of them is ``confirm_s`` old.
CONFIRM_MARGIN_S = 0.5


@dataclass(frozen=True)
class Facts:
    """One scan's reading and the settings its rules use. Clocks: ``now`` epoch seconds (Store and Redis
    times), ``monotonic`` the Dispatcher's scheduling clock (``suspects``, ``Plan.rescan_by``)."""

    active: Mapping[str, AttemptedRollout]  # attempt id -> its rollout, for latest attempts active in the Store
    inflight: Mapping[str, Mapping[str, float]]  # queue -> attempt id -> when it was recorded in flight (epoch)
    executions: Mapping[str, LeaseMarkers]  # attempt id -> its Redis markers; an absent id has none (NO_TRACE)
    held: frozenset[str]  # attempt ids of the rollouts the Dispatcher holds (claimed, not published)
    suspects: Mapping[str, float]  # attempt id -> when a scan first saw it in need of repair (monotonic)
    now: float
    monotonic: float
    dispatcher_id: str  # the worker id this bridge claims rollouts under
    max_queue_wait_s: float
    confirm_s: float
    # attempt id -> its rollout, for active rollouts whose latest attempt has finished (``dead_ends``)
    dead_ends: Mapping[str, AttemptedRollout] = field(default_factory=dict)
    # queues on which a lost message shows within seconds (``LineDispatcher.drained_queues``)
    drained: frozenset[str] = frozenset()


class _OfAttempt:
    attempt_id: str

    @property
    def key(self) -> str:
        """The attempt a repair concerns (``bridge.dispatch.dispatcher.Repair``)."""
        return self.attempt_id


class _OfRollout:
    rollout: AttemptedRollout

    @property
    def key(self) -> str:
        """The attempt a repair concerns (``bridge.dispatch.dispatcher.Repair``)."""
        return self.rollout.attempt.attempt_id


@dataclass(frozen=True)
class DropHeld(_OfAttempt):
    """Drop a held rollout the Store moved on from: neither published nor handed back."""

    attempt_id: str
    store_says: str  # what the Store shows for it now, for the log


@dataclass(frozen=True)
class FreeLost(_OfAttempt):
    """Free the slot of an in-flight entry whose message never reached the broker or expired unstarted."""

    queue: str
    attempt_id: str
    in_flight_s: float


@dataclass(frozen=True)
class FreeOrphan(_OfAttempt):
    """Free the slot of an in-flight entry whose executor started it and is gone (no lease)."""

    queue: str
    attempt_id: str


@dataclass(frozen=True)
class Republish(_OfRollout):
    """Publish a stranded attempt again under the same task id (the worker's lease makes a duplicate harmless)."""

    rollout: AttemptedRollout
    executor_died: bool  # an executor started it; else it was lost before any executor saw it


@dataclass(frozen=True)
class HandBack(_OfRollout):
    """Hand a stranded ``preparing`` attempt back to the Store queue: too old to start in time, or started by an
    executor that died (run again in place, it would keep that start's deadline)."""

    rollout: AttemptedRollout


@dataclass(frozen=True)
class Settle(_OfRollout):
    """Write ``status`` (what the Store's retry policy derives from the finished latest attempt) on a rollout
    the Store left active with no live attempt, if a re-read still shows it so (``why_not_settle``)."""

    rollout: AttemptedRollout
    status: str


@dataclass(frozen=True)
class Plan:
    """The repairs of one scan, each group sorted by attempt id, and what the next scan needs."""

    drops: tuple[DropHeld, ...]
    frees: tuple[FreeLost | FreeOrphan, ...]  # the lost entries first, then the orphans
    restarts: tuple[Republish | HandBack, ...]
    suspects: Mapping[str, float]  # the next scan's ``Facts.suspects``: seen now, not confirmed yet
    rescan_by: float | None  # monotonic: the next scan is due no later than this (None: the usual interval)
    settles: tuple[Settle, ...] = ()  # dead ends, settled as the Store's retry policy would have

    @property
    def repairs(self) -> tuple[DropHeld | FreeLost | FreeOrphan | Republish | HandBack | Settle, ...]:
        """Every repair, in the order they are carried out: drops, frees, restarts, settles."""
        return (*self.drops, *self.frees, *self.restarts, *self.settles)

    @property
    def made(self) -> int:
        """What a scan reports: the attempts re-published or handed back, and the dead ends settled."""
        return len(self.restarts) + len(self.settles)


def active_attempts(rollouts: Iterable[Rollout]) -> dict[str, AttemptedRollout]:
    """Attempt id -> rollout, for the rollouts whose latest attempt is ``preparing`` or ``running``."""
    return {
        r.attempt.attempt_id: r
        for r in rollouts
        if isinstance(r, AttemptedRollout) and r.attempt.status in ACTIVE_ATTEMPT
    }


def dead_ends(rollouts: Iterable[Rollout]) -> dict[str, AttemptedRollout]:
    """Attempt id -> rollout, for the rollouts the Store shows ``preparing`` or ``running`` whose latest
    attempt is finished (``FINISHED_ATTEMPT``): no attempt of theirs can finish them. An ``unresponsive``
    latest attempt is not one: a span from it revives it."""
    return {
        r.attempt.attempt_id: r
        for r in rollouts
        if isinstance(r, AttemptedRollout) and r.status in ACTIVE_ROLLOUT and r.attempt.status in FINISHED_ATTEMPT
    }


def settled_status(attempt_status: str, sequence_id: int, config: RolloutConfig) -> str:
    """The rollout status the Store's retry policy gives a rollout whose latest attempt ended ``attempt_status``:
    ``succeeded`` for a succeeded one; ``requeuing`` when the status is in ``retry_condition`` and the attempt's
    ``sequence_id`` is below ``max_attempts``; ``failed`` otherwise (docs/store-protocol.md 6.2)."""
    if attempt_status == AttemptStatus.SUCCEEDED:
        return RolloutStatus.SUCCEEDED
    retry_allowed = attempt_status in config.retry_condition and sequence_id < config.max_attempts
    return RolloutStatus.REQUEUING if retry_allowed else RolloutStatus.FAILED


def why_not_settle(current: object, settle: Settle) -> str | None:
    """Why the rollout re-read as ``current`` must not be settled; None while it is still the dead end planned:
    active, with the same latest attempt in the same finished status. A rollout cancelled (or finished, or
    requeued) since the scan is left as it is; so is one with a newer attempt."""
    status = getattr(current, "status", None)
    if status not in ACTIVE_ROLLOUT:
        return f"the rollout is {status}"
    if not isinstance(current, AttemptedRollout) or current.attempt.attempt_id != settle.rollout.attempt.attempt_id:
        return "a later attempt superseded it"
    if current.attempt.status != settle.rollout.attempt.status:
        return f"its attempt is {current.attempt.status}"
    return None


def plan_repairs(facts: Facts) -> Plan:
    """The repairs these facts call for (see the module docstring); pure: the same facts, the same plan."""
    queue_of: dict[str, str] = {}  # attempt id -> its in-flight queue (the last queue listing it)
    recorded: dict[str, float] = {}
    for queue, entries in facts.inflight.items():
        queue_of.update(dict.fromkeys(entries, queue))
        recorded.update(entries)

    def marks(aid: str) -> LeaseMarkers:
        return facts.executions.get(aid, NO_TRACE)

    orphans = {aid for aid in queue_of if not marks(aid).leased and (marks(aid).started or marks(aid).done)}
    stranded = {
        aid
        for aid, rollout in facts.active.items()
        if aid not in queue_of and _abandoned(rollout, marks(aid), facts.dispatcher_id)
    }
    drops = _moved_on(facts.held, facts.active)
    stranded -= facts.held - {drop.attempt_id for drop in drops}  # held on purpose, not stranded

    def wait_limit(aid: str) -> float:
        return queue_wait_limit(queue_of[aid] in facts.drained, facts.max_queue_wait_s)

    unstarted = {aid for aid in queue_of if not (marks(aid).leased or marks(aid).started or marks(aid).done)}
    lost = {aid for aid in unstarted if facts.now - recorded[aid] > wait_limit(aid)}
    dead = {aid for aid in facts.dead_ends if not marks(aid).leased}  # a leased one: its executor is still at it

    seen = orphans | stranded | lost | dead
    confirmed, suspects = confirm_suspects(seen, facts.suspects, facts.monotonic, facts.confirm_s)

    frees: list[FreeLost | FreeOrphan] = []
    for aid in sorted(confirmed & lost):
        frees.append(FreeLost(queue_of[aid], aid, facts.now - recorded[aid]))
        if aid in facts.active and facts.active[aid].attempt.status == AttemptStatus.PREPARING:
            stranded.add(aid)
    for aid in sorted(confirmed & orphans):
        frees.append(FreeOrphan(queue_of[aid], aid))
        if aid in facts.active and not marks(aid).done:
            stranded.add(aid)
    restarts = tuple(_restart(facts.active[aid], marks(aid), facts) for aid in sorted(confirmed & stranded))
    settles = tuple(_settle(facts.dead_ends[aid]) for aid in sorted(confirmed & dead))

    due = [first + facts.confirm_s + CONFIRM_MARGIN_S for first in suspects.values()]
    waits = [recorded[aid] + wait_limit(aid) + LOST_MARGIN_S - facts.now for aid in unstarted - lost]
    if waits:
        due.append(facts.monotonic + max(RESCAN_FLOOR_S, min(waits)))
    return Plan(tuple(drops), tuple(frees), restarts, suspects, min(due, default=None), settles)


def _abandoned(rollout: AttemptedRollout, marks: LeaseMarkers, dispatcher_id: str) -> bool:
    """Nobody runs it: neither leased nor reported, and claimed by us or started by an executor."""
    if marks.leased or marks.done:
        return False
    if rollout.attempt.status == AttemptStatus.PREPARING:
        return marks.started or rollout.attempt.worker_id == dispatcher_id
    return marks.started  # running: only attempts an executor of ours started


def _moved_on(held: frozenset[str], active: Mapping[str, AttemptedRollout]) -> list[DropHeld]:
    """The held attempts the Store moved on from (cancelled, finished, started, timed out, superseded)."""
    drops = []
    for aid in sorted(held):
        current = active.get(aid)
        if current is None:
            drops.append(DropHeld(aid, "no longer active"))
        elif current.status != RolloutStatus.PREPARING or current.attempt.status != AttemptStatus.PREPARING:
            drops.append(DropHeld(aid, f"rollout {current.status}, attempt {current.attempt.status}"))
    return drops


def _restart(rollout: AttemptedRollout, marks: LeaseMarkers, facts: Facts) -> Republish | HandBack:
    """A ``preparing`` attempt older than the longest queue wait, or one an executor started, goes back to the Store
    (its rollout's next attempt gets a clock of its own); any other is re-published."""
    age = facts.now - (rollout.attempt.start_time or facts.now)
    if rollout.attempt.status == AttemptStatus.PREPARING and (marks.started or age > facts.max_queue_wait_s):
        return HandBack(rollout)
    return Republish(rollout, executor_died=marks.started)


def _settle(rollout: AttemptedRollout) -> Settle:
    return Settle(rollout, settled_status(rollout.attempt.status, rollout.attempt.sequence_id, rollout.config))
