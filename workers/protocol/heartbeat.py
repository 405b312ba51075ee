"""Two background threads per worker process that keep every running attempt alive and fenced.

* The *lease* thread renews the leases of all the process's attempts in one pipelined Redis round trip,
  and makes no Store call, so a slow Store never lets a live lease lapse. A renewal that finds the attempt
  claimed again or already reported flags it, and the agent loop stops without writing anything more.
* The *Store* thread reads the rollouts of all the process's attempts in one request per interval (or takes
  the fence board's verdicts, ``workers.protocol.fence_board``), flags an attempt that was superseded, timed out,
  marked unresponsive, finished or cancelled, sends ``last_heartbeat_time`` where the watchdog needs it,
  and ships buffered spans mid-episode where that is wanted. Each call must end while the lease is still
  known to be ours, and makes a single try: the next tick is the retry.

Hop by hop: docs/architecture.md, "One rollout, hop by hop" (4); docs/store-protocol.md section 10.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import redis
from celery.exceptions import SoftTimeLimitExceeded

from bridge.core.infra import MAX_DOUBLINGS, StoreError, Superseded, TelemetryError, UnknownIdError, backoff_delay
from bridge.core.store import ACTIVE_ATTEMPT, ROLLOUTS_PER_READ, RolloutConfig, StoreClient
from workers.lifecycle import drain, state
from workers.protocol.fence_board import GRACE_S, LISTING_LAPSES_INTERVALS, FenceBoard
from workers.protocol.fencing import fence
from workers.protocol.lease import Lease, Renewal, renew_all
from workers.telemetry.spans import AttemptTelemetry

log = logging.getLogger("workers.protocol.heartbeat")

T = TypeVar("T")
_NOT_YET = object()  # AttemptWatch.hand_over_once: no hand-over has completed

TICK_S = 0.25
HEARTBEAT_TIMEOUT_S = 5.0
RENEW_MAX_EVERY_S = 10.0  # at most this long between renewals (the bridge waits two of them after Redis data loss)
LEASE_MARGIN_S = 1.0  # a Store call must end this long before the lease could lapse
MIN_STORE_CALL_S = 0.5  # less lease left than this: wait for the next renewal instead of calling the Store
# After a failed Store call the heartbeat thread waits before its next one: 0.5 s doubling (full jitter) to this cap.
STORE_BACKOFF_BASE_S = 0.5
STORE_BACKOFF_CAP_S = 4.0


@dataclass(eq=False)
class AttemptWatch:
    rollout_id: str
    attempt_id: str
    lease: Lease
    telemetry: AttemptTelemetry | None
    interval_s: float
    flush_interval_s: float  # inf: only the final batch, or when flush_max_pending spans are buffered
    flush_max_pending: int = 1000
    deadline: float | None = None  # epoch seconds after which the episode must stop
    executor: str | None = None  # host:pid:thread, sent as the attempt's worker_id with heartbeats
    unresponsive_s: float | None = None  # the rollout's unresponsive_seconds: heartbeats are sent only with one
    first_beat_in_s: float | None = None  # default interval_s; sooner when the attempt waited in the broker
    viewed_at: float = 0.0  # epoch s of the latest read of the rollout that passed the fence
    alive_at: float = 0.0  # epoch s of the latest heartbeat the Store accepted
    stop_reason: str | None = None
    next_beat: float = field(default_factory=lambda: time.monotonic())
    beats: int = 0
    spans_at_last_beat: int = 0  # spans exported when the previous beat ran
    reporting: bool = False  # the final report is under way: keep the lease, stop fencing (it is our own report)
    lease_unknown: bool = False  # the latest renewal could not reach Redis: nobody can claim through it either
    sending: threading.Lock = field(default_factory=threading.Lock)  # held by a heartbeat while it is in flight
    shutdown: bool = False  # the worker drains (workers.lifecycle.drain): handed over, not left unreported
    interruptible: bool = False  # prefork: the agent runs on the process's main thread, SIGUSR1 interrupts it
    interrupt_at: float | None = None  # monotonic s at which a drain-stopped agent that did not return is interrupted
    store_fenced: bool = True  # False: not a Store attempt (Agent Lightning 1.0): the lease thread and the drain only
    interrupted: bool = False  # the drain interrupted the agent (SIGUSR1): no report of its run begins after that
    interrupt_pending: bool = False  # that interrupt has not been seen in this attempt's (main) thread yet
    state: threading.Lock = field(default_factory=threading.Lock)  # the interrupt and the report's start: one step
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # called once, when the watch is first stopped
    hand_over_at: float | None = None  # monotonic s from which the drain hands the attempt over in its thread's place
    in_place: Callable[[], None] | None = None  # that hand-over (HeldAttempt.hand_over_at_drain); None: none
    taken: bool = False  # the protocol began the hand-over in the attempt's thread's place: that thread reports nothing
    _hand_over_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _handed_over: object = field(default=_NOT_YET, init=False, repr=False)  # what it returned, for the second caller

    def __post_init__(self) -> None:
        first = self.interval_s if self.first_beat_in_s is None else self.first_beat_in_s
        self.next_beat = time.monotonic() + max(0.0, first)

    def begin_reporting(self) -> bool:
        """The final report goes next: no heartbeat or drain interrupt from now on, none in flight when this returns.

        The report is then the last write this executor sends for the attempt (docs/architecture.md, "Heartbeats
        and the report"; the Store itself serializes updates, and a late heartbeat changes no finished status).
        Returns False when the drain interrupted the agent first (``interrupt``): its interrupt is taken here, if it
        has not been yet, and the caller must not report the run's result but hand the attempt over; so it does once
        the drain took the hand-over from the attempt's thread (``take_hand_over``)."""
        with self.state:
            began = not (self.interrupted or self.taken)
            self.reporting = True
        if not began and self.interrupt_pending and threading.current_thread() is threading.main_thread():
            self.take_interrupt()  # a signal's handler runs on the main thread: on any other there is nothing to take
        with self.sending:
            pass
        return began

    def interrupt(self, send: Callable[[], None]) -> bool:
        """Interrupt the agent with ``send`` unless the report has begun; one step with ``begin_reporting``.

        Called off the attempt's thread (the heartbeat); ``send`` makes the attempt's thread raise
        ``SoftTimeLimitExceeded`` (billiard's SIGUSR1 handler). Returns whether it was sent."""
        with self.state:
            if self.reporting or self.interrupted:
                return False
            self.interrupted = self.interrupt_pending = True
            send()
            return True

    def take_hand_over(self) -> bool:
        """Claim the hand-over for the protocol, in place of an attempt's thread that has begun neither its report nor
        its hand-over (its agent never returned); one step with ``begin_reporting``. True: claimed, and the thread,
        should its agent return after all, reports nothing (``begin_reporting`` returns False)."""
        with self.state:
            if self.reporting:
                return False
            self.reporting = self.taken = True
        return True

    def hand_over_once(self, hand_over: Callable[[], T]) -> T:
        """Run ``hand_over`` unless it completed already, and return what it returned: the drain's thread and the
        attempt's own may both get there, and the attempt goes back to the Store once. A caller that comes while the
        other is at it waits for it; one that raised leaves it to the next."""
        with self._hand_over_lock:
            if self._handed_over is _NOT_YET:
                self._handed_over = hand_over()
            return cast(T, self._handed_over)

    def interrupt_seen(self) -> None:
        """The attempt's thread caught the interrupt (a ``SoftTimeLimitExceeded``): nothing more will land."""
        self.interrupt_pending = False

    def take_interrupt(self) -> None:
        """Wait, at most ``drain.INTERRUPT_LANDS_S``, for an interrupt that was sent and has not landed, and swallow it:
        an exception raised later, in the hand-over, would turn it into a failure."""
        try:
            threading.Event().wait(drain.INTERRUPT_LANDS_S)  # a signal's handler raises in this wait
        except SoftTimeLimitExceeded:
            pass
        self.interrupt_pending = False

    def stop(self, reason: str) -> None:
        """Flag the attempt to stop; the first call records ``reason`` and runs the ``on_stop`` callbacks."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("stopping rollout=%s attempt=%s: %s", self.rollout_id, self.attempt_id, reason)
            for callback in list(self.on_stop):
                callback()

    def shut_down(self, reason: str) -> None:
        """Stop the attempt because the worker drains, unless it was stopped for a reason of its own already."""
        with self.state:
            if self.stop_reason is not None or self.reporting:
                return
            self.shutdown = True
            self.interrupt_at = time.monotonic() + drain.INTERRUPT_AFTER_S
            self.hand_over_at = time.monotonic() + drain.HAND_OVER_AFTER_S
        self.stop(reason)

    def check(self) -> None:
        """Called by the agent loop between steps: raise if the attempt must not go on."""
        if self.stop_reason is None and self.deadline is not None and time.time() > self.deadline:
            raise TimeoutError("the rollout's time budget ran out before the episode finished")
        if self.stop_reason is not None:
            raise Superseded(self.stop_reason)


def watchdog_may_act(config: RolloutConfig, started_at: float, alive_at: float, now: float) -> bool:
    """Whether the Store's watchdog could have marked the attempt ``timeout``/``unresponsive`` by ``now``.

    Its scan compares the attempt's start (the dequeue) with ``timeout_seconds`` and its last heartbeat
    with ``unresponsive_seconds`` (docs/store-protocol.md 6.3); nothing else changes an attempt behind its
    executor's back except people. The margin covers clock skew between this host and the Store.
    """

    def near(elapsed: float, limit: float | None) -> bool:
        return limit is not None and limit > 0 and elapsed > limit - max(2.0, 0.2 * limit)

    return near(now - started_at, config.timeout_seconds) or near(now - alive_at, config.unresponsive_seconds)


def span_flush_interval(streaming_s: float | None, unresponsive_s: float | None, heartbeat_s: float) -> float:
    """Seconds between an attempt's mid-episode span shipments; ``inf``: only the batch before its report.

    Spans go out early only to stream them (``SPAN_FLUSH_INTERVAL_S``) or to keep the attempt alive where
    the Store's watchdog looks (the rollout has ``unresponsive_seconds``). Flushing every 10 s regardless
    cost the Store 0.8 more requests per rollout at 128 slots of 12 s episodes (docs/performance.md), for
    nothing the trainer reads.
    """
    if streaming_s is not None:
        return streaming_s
    return heartbeat_s if unresponsive_s else math.inf


class StoreBackoff:
    """When the heartbeat thread may call the Store again after a failure: it waits 0.5 s doubling (full jitter) up
    to ``STORE_BACKOFF_CAP_S``, and again at once after a success.

    A Store that was stopped or starved comes back with every request it queued meanwhile still to answer, the
    ones whose clients gave up included. Clients that re-send at once, each tick, keep it behind for good (a 15 s
    stop on a loaded machine kept every fence read failing 40 s after it, until the watchdog marked 31 attempts
    unresponsive); a process that waits between failures lets it catch up, and still tries often enough to beat
    within any ``unresponsive_seconds`` the Store allows.
    """

    def __init__(self) -> None:
        self.failures = 0  # in a row, since the last success
        self.until = 0.0  # monotonic: no Store call before it

    def waiting(self) -> bool:
        return time.monotonic() < self.until

    def failed(self) -> None:
        self.until = time.monotonic() + backoff_delay(self.failures, STORE_BACKOFF_BASE_S, STORE_BACKOFF_CAP_S)
        self.failures = min(self.failures + 1, MAX_DOUBLINGS)  # the cap is reached long before

    def succeeded(self) -> None:
        self.failures, self.until = 0, 0.0


class HeartbeatMonitor:
    def __init__(
        self,
        store: StoreClient | None,
        redis_client: redis.Redis,
        board: FenceBoard | None = None,
        drain_scope: str | None = None,
    ) -> None:
        """``drain_scope``: the deployment's key scope when ``WORKER_SHUTDOWN_GRACE_S`` bounds a drain (else None).
        ``store`` None (a 1.0-only worker): only watches that are not ``store_fenced`` may be registered."""
        self._store = store
        self._redis = redis_client
        self._board = board
        self._drain_scope = drain_scope
        self._watches: set[AttemptWatch] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._renewals_failed = 0
        self.store_backoff = StoreBackoff()

    def watch(self, watch: AttemptWatch) -> None:
        with self._lock:
            if not self._threads or not all(t.is_alive() for t in self._threads):
                # Started lazily so that under prefork they live in the child, not the parent.
                self._threads = [
                    threading.Thread(target=self._renew_loop, name="attempt-leases", daemon=True),
                    threading.Thread(target=self._store_loop, name="attempt-heartbeat", daemon=True),
                ]
                for thread in self._threads:
                    thread.start()
            self._watches.add(watch)  # only once the threads run: a watch nobody serves must not hold a lease

    def unwatch(self, watch: AttemptWatch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def close(self) -> None:
        """Stop both threads (tests; a worker process simply exits, they are daemons)."""
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=15)

    @property
    def store(self) -> StoreClient | None:
        """The Store client it was built with (None on a 1.0-only worker)."""
        return self._store

    @property
    def redis(self) -> redis.Redis:
        """The coordination Redis its leases and markers live in."""
        return self._redis

    @property
    def board(self) -> FenceBoard | None:
        """The fence board its 0.3 watches read their verdicts from, where the worker runs one."""
        return self._board

    def watches(self) -> list[AttemptWatch]:
        """The attempts it watches now (a copy); each tick of its threads starts from one."""
        with self._lock:
            return list(self._watches)

    # --- the lease thread --------------------------------------------------------------------

    def _renew_every(self, watches: list[AttemptWatch]) -> float:
        """Often enough that a lease never lapses and that Redis data loss is repaired within one interval."""
        every = min((min(w.interval_s, w.lease.ttl_s / 4) for w in watches), default=1.0)
        return max(TICK_S, min(every, RENEW_MAX_EVERY_S))

    def _renew_loop(self) -> None:
        while True:
            try:
                watches = self.watches()
                self.renew(watches)
            except Exception:  # the thread must survive anything
                log.exception("lease renewal failed")
                watches = []
            if self._closed.wait(self._renew_every(watches)):
                return

    def renew(self, watches: list[AttemptWatch]) -> None:
        """Renew every watched attempt's lease in one round trip; flag the ones that are no longer ours."""
        if not watches:
            return
        try:
            results = renew_all(self._redis, [w.lease for w in watches])
        except redis.RedisError as exc:
            self._renewals_failed += 1
            if self._renewals_failed == 1 or self._renewals_failed % 20 == 0:
                log.warning("could not renew %d leases (will retry): %r", len(watches), exc)
            for watch in watches:
                watch.lease_unknown = True  # a Redis outage is not a reason to stop a live episode
            return
        self._renewals_failed = 0
        for watch, result in zip(watches, results, strict=True):
            watch.lease_unknown = False
            if watch.reporting or result is Renewal.HELD:
                continue  # while reporting, a lapse is our own report's done marker
            if result is Renewal.DONE:
                watch.stop("the attempt was already reported (another executor finished it)")
            else:
                watch.stop("lost the execution lease (another executor took over)")

    # --- the Store thread --------------------------------------------------------------------

    def _store_loop(self) -> None:
        while not self._closed.wait(TICK_S):
            watches = self.watches()
            try:
                self.stop_for_drain(watches)
            except Exception:
                log.exception("drain check failed")
            if self.store_backoff.waiting():
                continue  # the Store failed the last call: give it room before the next one
            for watch in watches:
                try:
                    self.flush_if_due(watch)
                except Exception:  # the thread must survive anything one attempt throws
                    log.exception("span flush failed for attempt %s", watch.attempt_id)
            try:
                self.beat_due(watches)
            except Exception:
                log.exception("heartbeat round over %d attempts failed", len(watches))

    def stop_for_drain(self, watches: Sequence[AttemptWatch]) -> None:
        """Once the node's drain reaches its stop time (``workers.lifecycle.drain``), stop every running attempt; under
        prefork, interrupt an agent that has not returned ``drain.INTERRUPT_AFTER_S`` later; and
        ``drain.HAND_OVER_AFTER_S`` after the stop, hand over (on a thread of its own) each attempt whose thread has
        begun neither its report nor its hand-over: an agent that swallows the stop and the interrupt never returns,
        and the process's forced exit must find its attempt handed over, not leased."""
        clock = state.process.drain_clock
        if self._drain_scope is None or not watches or not clock.due(self._redis, self._drain_scope, time.time()):
            return
        reason = drain.shutdown_reason(clock.grace_s)
        for watch in watches:
            watch.shut_down(reason)
            due = watch.interrupt_at is not None and time.monotonic() >= watch.interrupt_at
            if watch.shutdown and watch.interruptible and due:
                watch.interrupt_at = None  # once
                # The check that no report began and the signal are one step (AttemptWatch.interrupt): a signal that
                # lands in the success report would turn it into a failure.
                if watch.interrupt(lambda: drain.interrupt_main_thread()):
                    log.warning(
                        "attempt %s: the agent did not return after the drain stopped it; interrupted it",
                        watch.attempt_id,
                    )
            late = watch.hand_over_at is not None and time.monotonic() >= watch.hand_over_at
            if watch.shutdown and late and watch.in_place is not None and not watch.reporting:
                watch.hand_over_at = None  # once
                log.warning("attempt %s: the agent did not return after its stop; handing it over", watch.attempt_id)
                name = f"hand-over-{watch.attempt_id}"
                threading.Thread(target=watch.in_place, name=name, daemon=True).start()  # Store calls: off this loop

    def store_budget(self, watch: AttemptWatch) -> float | None:
        """Seconds one Store call for ``watch`` may take, or None when it must not be made now.

        The call must end while the latest renewal still guarantees that the attempt is ours; with Redis
        unreachable nobody can take the attempt over either, so the usual bound applies.
        """
        if watch.lease_unknown:
            return HEARTBEAT_TIMEOUT_S
        left = watch.lease.valid_until - time.monotonic() - LEASE_MARGIN_S
        if left < MIN_STORE_CALL_S:
            return None
        return min(HEARTBEAT_TIMEOUT_S, left)

    def flush_budget(self, watch: AttemptWatch) -> float | None:
        """Like ``store_budget``, but only while the latest renewal guarantees the lease, even with Redis unreachable.

        A host cut off from the network by a partition cannot reach Redis while the other hosts can, and one of
        them may have taken the attempt over; spans sent when the link returns would put a second execution
        into the attempt (measured by ``python -m bridge cluster --scenario partition``, docs/cluster.md). The
        spans stay buffered until a renewal says the attempt is still ours; heartbeats read the rollout first.
        """
        left = watch.lease.valid_until - time.monotonic() - LEASE_MARGIN_S
        if left < MIN_STORE_CALL_S:
            return None
        return min(HEARTBEAT_TIMEOUT_S, left)

    def flush_if_due(self, watch: AttemptWatch) -> None:
        """Ship the attempt's buffered spans every ``flush_interval_s`` or once ``flush_max_pending`` are buffered,
        bounded by what the lease guarantees."""
        telemetry = watch.telemetry
        if telemetry is None:
            return
        pending = telemetry.pending
        if not pending or (
            pending < watch.flush_max_pending and time.monotonic() - telemetry.last_flush < watch.flush_interval_s
        ):
            return
        budget = self.flush_budget(watch)
        if budget is None:
            return  # lost, or not renewed lately: write nothing until a renewal says it is ours
        if self.store_backoff.waiting():
            return
        try:
            # Bounded: a failed flush keeps the spans for the next tick instead of stalling this thread.
            telemetry.flush(deadline=time.time() + budget, timeout=budget)
        except TelemetryError as exc:
            self.store_backoff.failed()
            log.warning("span flush for attempt %s failed, will retry: %s", watch.attempt_id, exc)
        else:
            self.store_backoff.succeeded()

    def beat_due(self, watches: Sequence[AttemptWatch]) -> None:
        """When any attempt's beat is due, beat every attempt that may call the Store now, with one read.

        Reading the ones not yet due costs nothing more (the same request) and puts every attempt of the process
        on one schedule, so the process makes one read per interval however many attempts it runs. An attempt
        whose lease is not known to be live is left out, and does not trigger a round either, until a renewal.
        With the fence board, verdicts another process posted count as this process's reads; a due beat then
        takes the board's round (reading every listed attempt of the cluster) or, while another process holds
        it, waits up to ``GRACE_S`` for its verdicts before reading on its own.
        """
        now = time.monotonic()
        budgets = {
            w: self.store_budget(w) for w in watches if w.stop_reason is None and not w.reporting and w.store_fenced
        }
        batch = [w for w, budget in budgets.items() if budget is not None]
        if self._board is not None and batch:
            self._take_verdicts(batch, budgets)
            batch = [w for w in batch if w.stop_reason is None]
        if not any(now >= w.next_beat for w in batch):
            return
        interval = min(w.interval_s for w in batch)
        reader = self._board is not None and self._board.take_round(interval)
        if self._board is not None and not reader and not any(now >= w.next_beat + GRACE_S for w in batch):
            return  # another process is reading this round: its verdicts come at the next exchange
        for watch in batch:
            watch.next_beat = now + watch.interval_s
        self.beat(batch, timeout=min(b for b in budgets.values() if b is not None), for_board=reader)

    def _take_verdicts(self, batch: Sequence[AttemptWatch], budgets: dict[AttemptWatch, float | None]) -> None:
        """Apply the board's verdicts that are newer than each attempt's own view, as a read of its own would."""
        assert self._board is not None
        interval = min(w.interval_s for w in batch)
        verdicts = self._board.exchange([(w.rollout_id, w.attempt_id) for w in batch], interval)
        if not verdicts:
            return
        now, wall = time.monotonic(), time.time()
        for watch in batch:
            verdict = verdicts.get(watch.attempt_id)
            if verdict is None or verdict.read_at <= watch.viewed_at:
                continue
            if verdict.reason is not None:
                if not watch.reporting:  # a finished rollout may be our own report landing: no reason to stop
                    watch.stop(verdict.reason)
                continue
            if wall - verdict.read_at > watch.interval_s:
                continue  # older than one read (a round whose reader died): no proof for a heartbeat, read anew
            watch.viewed_at = verdict.read_at
            watch.next_beat = max(watch.next_beat, now + watch.interval_s - max(0.0, wall - verdict.read_at))
            watch.beats += 1
            self._heartbeat_quietly(watch, budgets.get(watch) or HEARTBEAT_TIMEOUT_S)

    def beat(
        self, watches: Sequence[AttemptWatch], *, timeout: float = HEARTBEAT_TIMEOUT_S, for_board: bool = False
    ) -> None:
        """Fence read of all ``watches`` in one request, then a heartbeat where one is needed.

        ``timeout`` bounds each Store call. Read first: any update of the latest attempt makes the Store
        recompute the rollout's status from it, so a heartbeat sent after a cancellation turns `cancelled` back
        into `preparing` (observed with agentlightning 0.3.0). Only an attempt that passed this read is touched.
        ``for_board``: this process holds the board's round, so the same read covers every listed attempt of
        the cluster and its verdicts are posted for the other processes.
        """
        watches = [w for w in watches if not w.reporting and w.store_fenced]
        if not watches or self._store is None:
            return
        listed = self._board.listed() if for_board and self._board is not None else []
        own = list(dict.fromkeys(w.rollout_id for w in watches))
        mine = set(own)
        others = [rid for rid in dict.fromkeys(rid for rid, _ in listed) if rid not in mine]
        room = -len(own) % ROLLOUTS_PER_READ  # other processes' attempts that fit in this process's own requests
        sent_at, started = time.time(), time.monotonic()
        try:
            views = self._store.get_rollouts(own + others[:room], retries=0, timeout=timeout)
        except StoreError as exc:
            self.store_backoff.failed()
            log.warning("fence read of %d attempts failed (will retry): %s", len(own), exc)
            return
        self.store_backoff.succeeded()
        if listed and self._board is not None:
            views.update(self._board.read(self._store, others[room:], budget=timeout - (time.monotonic() - started)))
            ttl = LISTING_LAPSES_INTERVALS * min(w.interval_s for w in watches)
            self._board.post(listed, views, sent_at, ttl_s=ttl)
        for watch in watches:
            view = views.get(watch.rollout_id)
            reason = (
                "the Store no longer knows this rollout (it restarted?)"
                if view is None
                else fence(view, watch.attempt_id)
            )
            if reason is not None:
                # The final report may have landed while this read was in flight: the rollout then reads finished
                # because of our own report, which is no reason to stop (and no warning worth logging).
                if not watch.reporting:
                    watch.stop(reason)
                continue
            watch.viewed_at = max(watch.viewed_at, sent_at)
            watch.beats += 1
            self._heartbeat_quietly(watch, timeout)

    def _heartbeat_quietly(self, watch: AttemptWatch, timeout: float) -> None:
        try:
            self.send_heartbeat(watch, timeout)
        except UnknownIdError:
            watch.stop("the Store no longer knows this rollout (it restarted?)")
        except StoreError as exc:
            log.warning("heartbeat to the Store failed for attempt %s (will retry): %s", watch.attempt_id, exc)

    def send_heartbeat(self, watch: AttemptWatch, timeout: float) -> None:
        """``last_heartbeat_time`` for an attempt that passed the fence, when the watchdog needs one."""
        exported = watch.telemetry.spans_exported if watch.telemetry is not None else 0
        if not watch.unresponsive_s or watch.reporting:
            return  # without unresponsive_seconds the watchdog never looks at liveness: nothing to send
        if exported > watch.spans_at_last_beat:
            # Spans stored since the last beat already refreshed the attempt's heartbeat, on the Store's
            # clock (docs/store-protocol.md 6.4): no heartbeat request.
            watch.spans_at_last_beat = exported
            return
        left = self.store_budget(watch)
        if left is None:
            return  # the read used up what the latest renewal guarantees: the next beat sends it
        if self._store is None:
            return
        with watch.sending:
            if watch.reporting:
                return  # the report won the race: it waits for no heartbeat but this one
            sent_at = time.time()
            attempt = self._store.update_attempt(
                watch.rollout_id,
                watch.attempt_id,
                last_heartbeat_time=sent_at,
                worker_id=watch.executor,  # the Store learns who runs it, at no extra cost
                retries=0,
                timeout=min(timeout, left),
            )
        if attempt.status not in ACTIVE_ATTEMPT and not watch.reporting:
            watch.stop(f"the Store marked the attempt {attempt.status}")
            return
        watch.alive_at = sent_at
