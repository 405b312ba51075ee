"""The one dispatcher both Agent Lightning lines run on: ``python -m bridge`` is it with the 0.3 line
(``bridge.dispatch.v03``: a Store's rollouts), ``python -m bridge v1`` with the 1.0 line (``bridge.dispatch.v1``: a
gateway's rollouts).

``LineDispatcher`` owns the tick as a template (``tick``): lead or stand by (a standby retries every
``STANDBY_RETRY_S``; a new leader wakes its backlog reader and reconciles at once), reconcile when due, read the
slots, the gauges once a second, then the line's round (``_round``), which claims what waits within the room the
slot share leaves it (``_share``) and publishes each claim through ``_send``: the line's task built, the attempt
recorded in flight, the message sent by the one publisher (``bridge.dispatch.publisher``), and what the broker
refused cleared from the in-flight set and given back. It owns as well:

* one error policy (``tick_surviving``): a Redis error is counted (``agl_bridge_broker_errors_total``) and the loop
  backs off from 0.5 s doubling to 10 s; an error of the line's upstream (``upstream_errors``: the Store, the
  gateway) is counted in the line's series and backs off as the line says (``upstream_backoff``); anything else is a
  loop error, with the line's ``error_wait_s``; after each, a reconcile is due by the time the loop goes on (what the
  error left half done is repaired there);
* the reconcile schedule and the one repair runner: at once on taking the lead, every
  ``BRIDGE_RECONCILE_INTERVAL_S`` after a scan, sooner where asked (``reconcile_by``), ``FACTS_RETRY_S`` after a
  scan whose facts could not be read; each repair of the line's plan carried out on its own, so one failing
  repair stops no other; the two-scan delay ``confirm_s`` its planners use (``bridge.dispatch.repairs``), their
  suspects on one clock (monotonic);
* the queue's slots shared with the other line (``bridge.core.coordination.slot_share``), the wait for a freed slot on
  the line's own wake-up list, the backlog reader and the exchange of the lines' backlogs (``bridge.dispatch.backlog``,
  ``bridge.core.coordination.line_demand``), and the scope check.

A line is a subclass that supplies what differs, the abstract methods: its backlog reader, its round (claim within
the room), its task (``_task``: name, arguments, time limits through ``publisher.clamp_timeout``), what becomes of a
claim the broker took, refused or could not be sent, its reconcile facts and planner (``_plan``) and each repair
(``_carry_out``), its own gauges, and what it gives back and closes on shutdown.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import ClassVar, Generic, Protocol, TypeVar

import redis
from prometheus_client import Counter, Gauge

from bridge.core.coordination import capacity, deployment_endpoint, deployment_scope, line_demand, slot_share
from bridge.core.coordination.scope_check import ScopeMismatchError, ScopeWatch
from bridge.core.infra import PublishError, backoff_delay, configure_logging, redact_text
from bridge.core.settings import DispatcherSettings
from bridge.dispatch import broker, metrics, repairs
from bridge.dispatch.backlog import BacklogReader, LeaderExports
from bridge.dispatch.leader import STANDBY_RETRY_S, LeaderLock
from bridge.dispatch.publisher import Publisher, Task

GAUGES_EVERY_S = 1.0
FACTS_RETRY_S = 10.0  # a scan whose facts could not be read is tried again this much later
REDIS_BACKOFF = (0.5, 10.0)  # a Redis error: the loop waits from 0.5 s, doubling to 10 s
MAX_BACKOFF_STEPS = 5

Claim = TypeVar("Claim")  # what a line claims and publishes: a Store's rollout, a gateway's attempt


class StopSignal(Protocol):
    """What the loop needs of its stop signal: a ``threading.Event``, or the ``ExecutionEvent`` (thread or
    multiprocessing event) an Agent Lightning Trainer hands to ``bridge.runner.CeleryRunner.iter``."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class Repair(Protocol):
    """One repair of a line's plan: ``key`` names the attempt it concerns."""

    @property
    def key(self) -> str: ...


class RepairPlan(Protocol):
    """What a line's planner returns (``bridge.dispatch.v03.repairs``, ``bridge.dispatch.v1.repairs``)."""

    @property
    def repairs(self) -> Sequence[Repair]: ...  # in the order they are carried out
    @property
    def suspects(self) -> Mapping[str, float]: ...  # the next scan's suspects (monotonic: when first seen)
    @property
    def rescan_by(self) -> float | None: ...  # monotonic: the next scan is due no later than this
    @property
    def made(self) -> int: ...  # what the scan reports


def start_process(settings: DispatcherSettings, metrics_port: int | None, logger: logging.Logger) -> None:
    """What a dispatcher process does before its loop: logging as configured, and /metrics on ``metrics_port``
    (default ``BRIDGE_METRICS_PORT``; none when neither is set)."""
    configure_logging(settings.log_level, settings.log_json)
    port = metrics_port if metrics_port is not None else settings.metrics_port
    if port is not None:
        metrics.serve(settings.metrics_host, port)
        logger.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop``: the process finishes the publish in hand and stops (logged on ``bridge``)."""

    def handle(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger("bridge").info(
            "received %s: finishing the publish in hand and stopping", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


class LineDispatcher(ABC, Generic[Claim]):
    """The tick, leadership, error policy, reconcile schedule and repair runner, slot share, publishing and
    in-flight accounting, and gauges of one dispatch line (module docstring)."""

    line: ClassVar[str]  # ``slot_share.V03`` or ``slot_share.V1``
    loop_name: ClassVar[str]  # how the log names the loop
    error_wait_s: ClassVar[float]  # the pause after an unexpected error ``tick`` let out
    stopped_message: ClassVar[str]
    logger: ClassVar[logging.Logger]
    facts_errors: ClassVar[tuple[type[Exception], ...]] = (redis.RedisError,)  # a scan skipped, not a loop error
    upstream_errors: ClassVar[tuple[type[Exception], ...]] = ()  # the line's source failing: backed off, counted
    upstream_counter: ClassVar[tuple[Counter, str]]  # where an upstream error is counted: the series, its kind
    upstream_call: ClassVar[str]  # how the log names the call that failed
    # The backoff after an upstream error, from its first wait doubling to its cap: long where a call whose answer
    # is lost may have claimed work (a dequeue), short where it claims nothing (a listing).
    upstream_backoff: ClassVar[tuple[float, float]] = (1.0, 30.0)
    waiting_gauges: ClassVar[tuple[Gauge, Gauge]]  # the line's waiting rollouts per queue, and the oldest's age

    def __init__(
        self,
        settings: DispatcherSettings,
        client: redis.Redis,
        publisher: Publisher,
        stop: StopSignal | None,
        *,
        queues: Iterable[str],
        lock_owner: str,
        lock_scope: str | None = None,
        who: str,
        strict_scope: bool = False,
    ) -> None:
        """``publisher``: the one publisher every message of the line goes through. ``lock_scope``: where this
        line's leader lock lives (default: the deployment's scope). ``who``: how the scope check names this
        dispatcher; ``strict_scope``: raise ScopeMismatchError from ``run`` when this Store's workers appear only
        under another spelling of its URL (``bridge.core.coordination.scope_check``)."""
        self.settings = settings
        self.redis = client
        self.publisher = publisher
        self.stop: StopSignal = stop if stop is not None else threading.Event()
        self.queues = list(queues)
        self.scope = deployment_scope(
            settings
        )  # of every Redis key this deployment owns (bridge.core.coordination.keys)
        self._lock = LeaderLock(client, lock_owner, scope=lock_scope or self.scope, line=self.line)
        self.confirm_s = repairs.confirm_s(settings.heartbeat_interval_s)
        self._next_reconcile = 0.0  # monotonic: when reconcile is due (``reconcile_by``); at once on start
        self._next_gauges = 0.0
        self._suspects: dict[str, float] = {}  # the last plan's suspects (monotonic): the next scan's
        self._failures = {"redis": 0, "upstream": 0}  # consecutive errors of each kind: the backoff's step
        self._probe: broker.QueueProbe | None = None  # the broker's queues, opened on first use (``queue_probe``)
        self.scope_watch = ScopeWatch(
            client, self.scope, deployment_endpoint(settings), self.queues, who=who, strict=strict_scope
        )
        self._backlog = self._backlog_reader(leading=lambda: self._lock.held)
        self._demand = line_demand.BacklogExchange(client, self.scope, self.line)  # the other line's backlog
        self._exports = LeaderExports(self._backlog, self._demand)
        metrics.export_line(self.line)

    # --- what callers may read and steer ----------------------------------------------------------------

    @property
    def leader_lock(self) -> LeaderLock:
        """This line's leader lock (``bridge.dispatch.leader``): held while this dispatcher leads."""
        return self._lock

    @property
    def backlog(self) -> BacklogReader:
        """The reader of what waits at this line's source (``bridge.dispatch.backlog``), on a thread ``run`` starts."""
        return self._backlog

    @property
    def next_reconcile(self) -> float:
        """Monotonic: when the next reconcile scan is due. ``reconcile_by`` only brings it forward; setting it puts it
        where it is set (``math.inf``: no scan until one is asked for)."""
        return self._next_reconcile

    @next_reconcile.setter
    def next_reconcile(self, when: float) -> None:
        self._next_reconcile = when

    @property
    def next_gauges(self) -> float:
        """Monotonic: when a tick next updates the gauges (every ``GAUGES_EVERY_S``); set to 0.0, the next tick does."""
        return self._next_gauges

    @next_gauges.setter
    def next_gauges(self, when: float) -> None:
        self._next_gauges = when

    @property
    def suspects(self) -> dict[str, float]:
        """The last plan's suspects, by attempt key: when each was first seen (monotonic). The next scan confirms or
        forgets them; setting them gives that scan what an earlier one saw."""
        return self._suspects

    @suspects.setter
    def suspects(self, seen: dict[str, float]) -> None:
        self._suspects = dict(seen)

    # --- what a line supplies ----------------------------------------------------------------------

    @abstractmethod
    def _backlog_reader(self, leading: Callable[[], bool]) -> BacklogReader:
        """The reader of this line's waiting rollouts, run by the leader on a thread of its own."""

    @abstractmethod
    def _announce(self) -> None:
        """Log what this dispatcher serves, once as it starts."""

    @abstractmethod
    def _round(self, view: capacity.SlotView) -> float:
        """The line's part of a tick, as leader with the slots read: claim what waits within the room
        (``_share``), publish each claim (``_send``); returns how long to wait before the next tick."""

    @abstractmethod
    def _task(self, claim: Claim) -> Task:
        """The message of ``claim``: task name, arguments, task id (its in-flight key), queue, time limits."""

    def _sent(self, claim: Claim, task: Task) -> None:
        """``claim`` is in the broker, counted as published (default: nothing more)."""

    @abstractmethod
    def _refused(self, claim: Claim, error: Exception) -> None:
        """The broker did not take ``claim`` (PublishError) or Redis could not record it (RedisError): its
        in-flight entry is cleared; give it back, or try it again later."""

    @abstractmethod
    def _unsendable(self, claim: Claim, error: Exception) -> None:
        """Anything else went wrong sending ``claim`` (a bug, a message that cannot be encoded): its in-flight
        entry is cleared; a retry will not cure it."""

    @abstractmethod
    def _plan(self) -> RepairPlan:
        """One scan's facts read and planned by the line's planner; errors of ``facts_errors`` skip the scan."""

    @abstractmethod
    def _carry_out(self, repair: Repair) -> None:
        """Carry out one repair of the line's plan."""

    def _line_gauges(self, view: capacity.SlotView) -> None:
        """The gauges only this line exports, once a second with the shared ones (default: none)."""

    def _held(self) -> dict[str, int]:
        """Per queue, the claims the line holds unpublished: part of its backlog (default: none)."""
        return {}

    def _give_back_all(self) -> None:
        """On shutdown, before the lock is released: give back what was claimed and never published (default:
        nothing, as for a line that takes a rollout from its source only by publishing it)."""

    def _close(self) -> None:
        """On shutdown, last: close what the line opened (default: its publisher)."""
        self.publisher.close()

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        self._announce()
        self._backlog.start()
        try:
            while not self.stop.is_set():
                self.stop.wait(self.tick_surviving())
        finally:
            self._backlog.close()
            self._give_back_all()
            self._lock.release()
            self._exports.stop()
            self._close()
            if self._probe is not None:
                self._probe.close()
        self.logger.info("%s", self.stopped_message)

    def tick(self) -> float:
        """One round of the template: lead or stand by; reconcile when due (before the slots are read: what it
        re-publishes takes slots this round sees); read the slots; the gauges when due; the line's round. Returns
        how long to wait before the next."""
        if not self._lead():
            return STANDBY_RETRY_S
        self._reconcile_if_due()
        view = capacity.read_slots(self.redis, self.scope, self.settings.all_queues())
        if self._gauges_due():
            self._update_gauges(view)
        return self._round(view)

    def tick_surviving(self) -> float:
        """``tick`` under the one error policy (module docstring): an error it lets out is counted, the loop backs
        off (or waits ``error_wait_s`` after an unexpected one) and a reconcile is due by then. ScopeMismatchError
        is raised: ``CeleryRunner``'s trainer must hear of it."""
        try:
            wait = self.tick()
        except ScopeMismatchError:
            raise
        except redis.RedisError as exc:
            metrics.BROKER_ERRORS.inc()
            wait = self._backoff("redis", *REDIS_BACKOFF)
            self.logger.warning("broker unreachable (%s); not dequeuing, retry in %.1fs", redact_text(repr(exc)), wait)
        except self.upstream_errors as exc:
            series, kind = self.upstream_counter
            series.labels(kind).inc()
            wait = self._backoff("upstream", *self.upstream_backoff)
            self.logger.warning("%s failed (%s); retry in %.1fs", self.upstream_call, exc, wait)
        except Exception:
            metrics.LOOP_ERRORS.inc()
            wait = self.error_wait_s
            self.logger.exception("unexpected error in the %s loop; going on in %.0fs", self.loop_name, wait)
        else:
            self._failures = dict.fromkeys(self._failures, 0)
            return wait
        self.reconcile_by(time.monotonic() + wait)  # whatever the error left half done is repaired by then
        return wait

    def _backoff(self, kind: str, base_s: float, cap_s: float) -> float:
        self._failures[kind] = min(self._failures[kind] + 1, MAX_BACKOFF_STEPS)
        return backoff_delay(self._failures[kind], base_s=base_s, cap_s=cap_s)

    def _lead(self) -> bool:
        """Whether this dispatcher leads now; a new leader reconciles at once and wakes its backlog reader, one
        that does not lead stops exporting."""
        leading, newly = self._lock.ensure()
        if newly:
            self.reconcile_by(0.0)  # a new leader repairs what the last one left at once
            self._backlog.wake()
        if not leading:
            self._exports.stop()
        return leading

    def _reconcile_if_due(self) -> None:
        if time.monotonic() >= self._next_reconcile:
            self.reconcile()

    def _gauges_due(self) -> bool:
        """Observability only: once every ``GAUGES_EVERY_S``, not every tick."""
        if time.monotonic() < self._next_gauges:
            return False
        self._next_gauges = time.monotonic() + GAUGES_EVERY_S
        return True

    # --- publishing --------------------------------------------------------------------------------

    def _send(self, claim: Claim) -> bool:
        """Publish ``claim``: its task built (``_task``), recorded in flight before the message is sent, sent by
        the publisher; True when the broker took it. A refusal (PublishError, or a RedisError recording it) is
        counted as a broker error and goes to ``_refused``, any other error to ``_unsendable``, its in-flight
        entry cleared either way."""
        task: Task | None = None
        try:
            task = self._task(claim)
            self._mark_inflight(task.queue, task.task_id)
            self.publisher.send(task)
        except (PublishError, redis.RedisError) as exc:
            metrics.BROKER_ERRORS.inc()
            self._forget_inflight(task)
            self._refused(claim, exc)
            return False
        except Exception as exc:  # not the broker saying no: our bug or a library's
            self._forget_inflight(task)
            self._unsendable(claim, exc)
            return False
        metrics.PUBLISHED.labels(task.queue, self.line).inc()
        self._sent(claim, task)
        return True

    # --- repair ------------------------------------------------------------------------------------

    def reconcile(self) -> int:
        """One scan on the schedule (``scan``): the line's facts read and planned (``_plan``), each repair carried
        out on its own (``_carry_out``); returns what the plan reports (``RepairPlan.made``)."""
        return self.scan(self._repair_all)

    def _repair_all(self) -> int:
        plan = self._plan()
        self._suspects = dict(plan.suspects)
        if plan.suspects:
            self.logger.info(
                "%d attempts look stranded or orphaned; re-checking in %.0fs", len(plan.suspects), self.confirm_s
            )
        if plan.rescan_by is not None:
            self.reconcile_by(plan.rescan_by)
        for repair in plan.repairs:
            try:
                self._carry_out(repair)
            except (redis.RedisError, *self.upstream_errors) as exc:
                self.logger.warning(
                    "[%s] repair %s not done: %s; the next reconcile tries again",
                    repair.key,
                    type(repair).__name__,
                    redact_text(str(exc)),
                )
            except Exception:
                self.logger.exception(
                    "[%s] unexpected error in repair %s; the next reconcile tries again",
                    repair.key,
                    type(repair).__name__,
                )
        return plan.made

    def scan(self, carry_out: Callable[[], int]) -> int:
        """Run one reconcile scan (``carry_out``: read the facts, plan, repair; returns the repairs made) on the
        schedule: the scan answers every earlier request for one, the next is due after
        ``reconcile_interval_s`` or sooner where the plan asks (``reconcile_by``). Facts that could not be read
        (``facts_errors``) skip the scan, tried again ``FACTS_RETRY_S`` later; any other error is due at once."""
        started = time.monotonic()
        self._next_reconcile = math.inf
        try:
            done = carry_out()
        except self.facts_errors as exc:
            self.logger.warning("reconciliation skipped: %s", exc)
            self.reconcile_by(time.monotonic() + FACTS_RETRY_S)
            return 0
        except BaseException:
            self.reconcile_by(time.monotonic())
            raise
        self.reconcile_by(started + self.settings.reconcile_interval_s)
        return done

    def queue_probe(self) -> broker.QueueProbe:
        """The read-only view of the broker's queues (depths, oldest message), opened once."""
        if self._probe is None:
            self._probe = broker.queues_for(self.settings, self.redis)
        return self._probe

    def drained_queues(self) -> frozenset[str]:
        """This line's queues on which a lost message shows within seconds (``repairs.queue_wait_limit``): consumed,
        holding no message in the broker, with a free slot for every attempt in flight. Empty when the slots or the
        broker cannot be read: the scan then waits ``max_queue_wait_s``."""
        try:
            view = capacity.read_slots(self.redis, self.scope, self.queues)
            rooms, served = view.rooms(), view.served()
            probe = self.queue_probe()
            return frozenset(q for q in self.queues if q in served and rooms.get(q, 0) >= 0 and probe.depth(q) == 0)
        except (redis.RedisError, broker.BrokerReadError) as exc:
            self.logger.debug("could not tell which queues are drained: %r", exc)
            return frozenset()

    def reconcile_by(self, when: float) -> None:
        """The next reconcile is due no later than ``when`` (monotonic); the earliest request wins."""
        self._next_reconcile = min(self._next_reconcile, when)

    # --- slots, in-flight accounting and gauges ----------------------------------------------------

    def _share(self, view: capacity.SlotView, rooms: dict[str, int], waiting: int) -> None:
        """Cut the default queue's room in ``rooms`` to this line's share of its slots while the other line waits,
        ``waiting`` published as this line's demand (``bridge.core.coordination.slot_share.claimable``). A Redis error
        leaves the room as it is: the slots were just read, so it is a blip, and this round goes without sharing."""
        queue = self.settings.default_queue
        if queue not in view.served():
            return
        try:
            allowed = slot_share.claimable(
                self.redis,
                self.scope,
                queue,
                self.line,
                total=view.totals().get(queue, 0),
                room=rooms[queue],
                waiting=waiting,
                weights=self.settings.slot_share_weights,
            )
        except redis.RedisError as exc:
            self.logger.debug("slot sharing skipped this tick: %r", exc)
            return
        rooms[queue] = min(rooms[queue], allowed)

    def wait_for_freed(self, queues: Iterable[str], timeout_s: float) -> bool:
        """Block on this line's wake-up list until a worker frees a slot on ``queues`` or ``timeout_s`` passes;
        True if woken. Raises RedisError."""
        return capacity.wait_for_freed(self.redis, self.scope, queues, timeout_s, self.line)

    def _mark_inflight(self, queue: str, key: str) -> None:
        """Record ``key`` in flight on ``queue`` before its message is sent. Raises RedisError."""
        capacity.mark_inflight(self.redis, self.scope, queue, key)

    def _forget_inflight(self, task: Task | None) -> None:
        """Clear ``task``'s in-flight entry (its message did not go out); a Redis error leaves it to the reconcile."""
        if task is not None:
            self._clear_inflight(task.queue, task.task_id)

    def _clear_inflight(self, queue: str, key: str) -> None:
        try:
            capacity.clear_inflight(self.redis, self.scope, queue, key)
        except redis.RedisError:
            pass

    def _update_gauges(self, view: capacity.SlotView) -> None:
        """Per queue: its slots and attempts in flight (every line's), and from the last backlog reading this line's
        waiting rollouts, the oldest's age and the queue's desired slots: in flight + this line's backlog (waiting
        + held) + the other line's published backlog (``bridge.core.coordination.line_demand``; docs/operations.md,
        "Autoscaling signal"); then the line's own (``_line_gauges``)."""
        self.scope_watch.check(view.served())
        self._exports.active = True
        totals = view.totals()
        backlog = self._backlog.latest
        held = self._held()
        own: dict[str, int] = {}
        others: dict[str, dict[str, int]] = {}
        if backlog is not None:  # this line's backlog for the other line's leader, and the other's
            own = {queue: backlog.waiting.get(queue, 0) + held.get(queue, 0) for queue in self.queues}
            others = self._demand.others(own)
        waiting_gauge, oldest_gauge = self.waiting_gauges
        now = time.time()
        for queue in self.queues:
            inflight = view.inflight.get(queue, 0)
            metrics.SLOTS.labels(queue).set(totals.get(queue, 0))
            metrics.IN_FLIGHT.labels(queue).set(inflight)
            if backlog is None:  # none read yet in this leader term: export nothing rather than a false 0
                continue
            waiting_gauge.labels(queue).set(backlog.waiting.get(queue, 0))
            oldest_gauge.labels(queue).set(backlog.oldest_age(queue, now))
            metrics.DESIRED_SLOTS.labels(queue).set(
                line_demand.desired_slots(inflight, own[queue], others.get(queue, {}))
            )
        self._line_gauges(view)
