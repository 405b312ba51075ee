"""The one dispatcher both Agent Lightning lines run on: ``python -m bridge`` is it with the 0.3 line
(``bridge.dispatch.v03``: a Store's rollouts), ``python -m bridge v1`` with the 1.0 line (``bridge.dispatch.v1``: a
gateway's rollouts).

``LineDispatcher`` owns what does not depend on where rollouts come from:

* the leader lock (``bridge.dispatch.leader``): a standby retries every ``STANDBY_RETRY_S``; a new leader wakes its
  backlog reader and reconciles at once;
* the loop and its survival: ``tick`` runs until ``stop`` is set; an error it lets out is logged and counted
  (``agl_bridge_gateway_errors_total{kind="dispatch"}``, the broker errors, the loop errors), the loop goes on after
  the line's ``error_wait_s`` and a reconcile is due by then (whatever the error left half done is repaired there);
* the reconcile schedule: at once on taking the lead, every ``BRIDGE_RECONCILE_INTERVAL_S`` after a scan, sooner
  where asked (``_reconcile_by``), 10 s after a scan whose facts could not be read; and the two-scan delay
  ``confirm_s`` its planners use (``bridge.dispatch.repairs``);
* the queue's slots shared with the other line (``bridge.core.slot_share``), the wait for a freed slot on the
  line's own wake-up list, and the in-flight accounting around every publish (marked before the message is sent,
  cleared when the broker refuses it);
* the backlog reader and the exchange of the lines' backlogs (``bridge.dispatch.backlog``,
  ``bridge.core.line_demand``), the gauges' once-a-second schedule, and the scope check.

A line is a subclass that supplies the rest, the abstract methods: its backlog reader, one tick's own work (list
what waits, publish within the room the share leaves it, give back what cannot go), its reconcile (read the facts,
plan with its planner, carry out each repair, run through ``_scan``), its gauges, and what it gives back and closes
on shutdown.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol

import redis

from bridge.core import capacity, line_demand, slot_share
from bridge.core.agl_v1 import GatewayError
from bridge.core.coordination import deployment_endpoint, deployment_scope
from bridge.core.logs import configure_logging
from bridge.core.redact import redact_text
from bridge.core.scope_check import ScopeMismatchError, ScopeWatch
from bridge.core.settings import Settings
from bridge.dispatch import broker, metrics, repairs
from bridge.dispatch.backlog import BacklogReader, LeaderExports
from bridge.dispatch.leader import STANDBY_RETRY_S, LeaderLock

GAUGES_EVERY_S = 1.0
FACTS_RETRY_S = 10.0  # a scan whose facts could not be read is tried again this much later


class StopSignal(Protocol):
    """What the loop needs of its stop signal: a ``threading.Event``, or the ``ExecutionEvent`` (thread or
    multiprocessing event) an Agent Lightning Trainer hands to ``bridge.runner.CeleryRunner.iter``."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


def start_process(settings: Settings, metrics_port: int | None, logger: logging.Logger) -> None:
    """What a dispatcher process does before its loop: logging as configured, and /metrics on ``metrics_port``
    (default ``BRIDGE_METRICS_PORT``; none when neither is set)."""
    configure_logging(settings.log_level, settings.log_json)
    port = metrics_port if metrics_port is not None else settings.metrics_port
    if port is not None:
        metrics.serve(settings.metrics_host, port)
        logger.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)


class LineDispatcher(ABC):
    """The loop, leadership, reconcile schedule, slot share and in-flight accounting of one dispatch line."""

    line: ClassVar[str]  # ``slot_share.V03`` or ``slot_share.V1``
    loop_name: ClassVar[str]  # how the log names the loop
    error_wait_s: ClassVar[float]  # the pause after an error ``tick`` let out
    stopped_message: ClassVar[str]
    logger: ClassVar[logging.Logger]
    facts_errors: ClassVar[tuple[type[Exception], ...]] = (redis.RedisError,)  # a scan skipped, not a loop error

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        stop: StopSignal | None,
        *,
        queues: Iterable[str],
        lock_owner: str,
        lock_scope: str | None = None,
        who: str,
        strict_scope: bool = False,
    ) -> None:
        """``lock_scope``: where this line's leader lock lives (default: the deployment's scope). ``who``: how the
        scope check names this dispatcher; ``strict_scope``: raise ScopeMismatchError from ``run`` when this
        Store's workers appear only under another spelling of its URL (``bridge.core.scope_check``)."""
        self.settings = settings
        self.redis = client
        self.stop: StopSignal = stop if stop is not None else threading.Event()
        self.queues = list(queues)
        self.scope = deployment_scope(settings)  # of every Redis key this deployment owns (bridge.core.keys)
        self._lock = LeaderLock(client, lock_owner, scope=lock_scope or self.scope, line=self.line)
        self.confirm_s = repairs.confirm_s(settings.heartbeat_interval_s)
        self._next_reconcile = 0.0  # monotonic: when reconcile is due (``_reconcile_by``); at once on start
        self._next_gauges = 0.0
        self._suspects: dict[str, float] = {}  # the last plan's suspects: the next scan's
        self._probe: broker.QueueProbe | None = None  # the broker's queues, opened on first use (``queue_probe``)
        self.scope_watch = ScopeWatch(
            client, self.scope, deployment_endpoint(settings), self.queues, who=who, strict=strict_scope
        )
        self._backlog = self._backlog_reader(leading=lambda: self._lock.held)
        self._demand = line_demand.BacklogExchange(client, self.scope, self.line)  # the other line's backlog
        self._exports = LeaderExports(self._backlog, self._demand)
        metrics.export_line(self.line)

    # --- what a line supplies ----------------------------------------------------------------------

    @abstractmethod
    def _backlog_reader(self, leading: Callable[[], bool]) -> BacklogReader:
        """The reader of this line's waiting rollouts, run by the leader on a thread of its own."""

    @abstractmethod
    def _announce(self) -> None:
        """Log what this dispatcher serves, once as it starts."""

    @abstractmethod
    def tick(self) -> float:
        """One round; returns how long to wait before the next."""

    @abstractmethod
    def reconcile(self) -> int:
        """One scan (``_scan``); the repairs made."""

    @abstractmethod
    def _give_back_all(self) -> None:
        """On shutdown, before the lock is released: give back what was claimed and never published."""

    @abstractmethod
    def _close(self) -> None:
        """On shutdown, last: close what the line opened."""

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        self._announce()
        self._backlog.start()
        try:
            while not self.stop.is_set():
                self.stop.wait(self._tick_surviving())
        finally:
            self._backlog.close()
            self._give_back_all()
            self._lock.release()
            self._exports.stop()
            self._close()
            if self._probe is not None:
                self._probe.close()
        self.logger.info("%s", self.stopped_message)

    def _tick_surviving(self) -> float:
        """``tick``; an error it lets out is logged and counted, a reconcile is due within ``error_wait_s`` and the
        loop goes on after it. ScopeMismatchError is raised: ``CeleryRunner``'s trainer must hear of it."""
        wait = self.error_wait_s
        try:
            return self.tick()
        except ScopeMismatchError:
            raise
        except GatewayError as exc:
            metrics.GATEWAY_ERRORS.labels("dispatch").inc()
            self.logger.warning("%s; retrying in %.0fs", exc, wait)
        except redis.RedisError as exc:
            metrics.BROKER_ERRORS.inc()
            self.logger.warning("%s; retrying in %.0fs", redact_text(str(exc)), wait)
        except Exception:
            metrics.LOOP_ERRORS.inc()
            self.logger.exception("unexpected error in the %s loop; going on in %.0fs", self.loop_name, wait)
        self._reconcile_by(time.monotonic() + wait)
        return wait

    def _lead(self) -> bool:
        """Whether this dispatcher leads now; a new leader reconciles at once and wakes its backlog reader, one
        that does not lead stops exporting."""
        leading, newly = self._lock.ensure()
        if newly:
            self._reconcile_by(0.0)  # a new leader repairs what the last one left at once
            self._backlog.wake()
        if not leading:
            self._exports.stop()
        return leading

    def _standby(self) -> float:
        return STANDBY_RETRY_S

    def _reconcile_if_due(self) -> None:
        if time.monotonic() >= self._next_reconcile:
            self.reconcile()

    def _gauges_due(self) -> bool:
        """Observability only: once every ``GAUGES_EVERY_S``, not every tick."""
        if time.monotonic() < self._next_gauges:
            return False
        self._next_gauges = time.monotonic() + GAUGES_EVERY_S
        return True

    # --- repair ------------------------------------------------------------------------------------

    def _scan(self, carry_out: Callable[[], int]) -> int:
        """Run one reconcile scan (``carry_out``: read the facts, plan, repair; returns the repairs made) on the
        schedule: the scan answers every earlier request for one, the next is due after
        ``reconcile_interval_s`` or sooner where the plan asks (``_reconcile_by``). Facts that could not be read
        (``facts_errors``) skip the scan, tried again ``FACTS_RETRY_S`` later; any other error is due at once."""
        started = time.monotonic()
        self._next_reconcile = math.inf
        try:
            done = carry_out()
        except self.facts_errors as exc:
            self.logger.warning("reconciliation skipped: %s", exc)
            self._reconcile_by(time.monotonic() + FACTS_RETRY_S)
            return 0
        except BaseException:
            self._reconcile_by(time.monotonic())
            raise
        self._reconcile_by(started + self.settings.reconcile_interval_s)
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

    def _reconcile_by(self, when: float) -> None:
        """The next reconcile is due no later than ``when`` (monotonic); the earliest request wins."""
        self._next_reconcile = min(self._next_reconcile, when)

    # --- slots and in-flight accounting ------------------------------------------------------------

    def _claimable(self, queue: str, *, total: int, room: int, waiting: int) -> int:
        """How many of ``queue``'s ``room`` free slots this line may take now, its ``waiting`` published for the
        other line (``bridge.core.slot_share.claimable``). Raises RedisError."""
        return slot_share.claimable(
            self.redis,
            self.scope,
            queue,
            self.line,
            total=total,
            room=room,
            waiting=waiting,
            weights=self.settings.slot_share_weights,
        )

    def _wait_for_freed(self, queues: Iterable[str], timeout_s: float) -> bool:
        """Block on this line's wake-up list until a worker frees a slot on ``queues`` or ``timeout_s`` passes;
        True if woken. Raises RedisError."""
        return capacity.wait_for_freed(self.redis, self.scope, queues, timeout_s, self.line)

    def _mark_inflight(self, queue: str, key: str) -> None:
        """Record ``key`` in flight on ``queue`` before its message is sent. Raises RedisError."""
        capacity.mark_inflight(self.redis, self.scope, queue, key)

    def _forget_inflight(self, queue: str, key: str) -> None:
        """Clear ``key``'s in-flight entry (its message did not go out); a Redis error leaves it to the reconcile."""
        try:
            capacity.clear_inflight(self.redis, self.scope, queue, key)
        except redis.RedisError:
            pass
