"""The backlog per Celery queue, the autoscaling signal the broker's queue length cannot give, since backpressure
keeps the broker nearly empty (docs/operations.md, "Autoscaling signal"): what waits for each dispatch line at its
source, read by its leader on a thread of its own (``BacklogReader``).

The Store's (0.3): rollouts ``queuing`` or ``requeuing``, by the queue their mode routes to (``QUEUE_BY_MODE``),
and the oldest of them. One Store request per reading (docs/store-protocol.md 3), oldest first by ``start_time``
(the enqueue; a ``requeuing`` rollout keeps its first one): its ``total`` counts every waiting rollout, and the
Store cannot filter by mode, so with one routed queue a page of one rollout is enough, and with several the page
holds the ``BRIDGE_BACKLOG_LIST_LIMIT`` oldest, whose split is exact, and the rest is split in their proportions.

The gateway's (1.0): rollouts ``queuing``, all on the 1.0 dispatcher's queue. The gateway counts nothing, so one
listing of at most ``BRIDGE_BACKLOG_LIST_LIMIT`` (oldest first, its creation order) is counted; a full page is
a lower bound. The oldest is the smallest ``created_at`` listed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bridge.core.agl_v1 import GatewayClient, GatewayError, V1State
from bridge.core.errors import StoreError
from bridge.core.line_demand import BacklogExchange
from bridge.core.models import Rollout, RolloutStatus
from bridge.core.settings import DispatcherSettings
from bridge.core.store import StoreClient
from bridge.dispatch import metrics

log = logging.getLogger("bridge.dispatch.backlog")

WAITING = (RolloutStatus.QUEUING, RolloutStatus.REQUEUING)
MODES = (None, "train", "val", "test")  # every mode a Store accepts; None routes like an unmapped mode


@dataclass(frozen=True)
class Backlog:
    """One reading: waiting rollouts per queue and the Store time each queue's oldest was enqueued."""

    waiting: dict[str, int]
    oldest: dict[str, float] = field(default_factory=dict)  # queue -> start_time (epoch s); absent: none seen
    # False: more rollouts waited than were listed: the Store's split of the rest is estimated, the gateway's
    # count is a lower bound.
    exact: bool = True

    def oldest_age(self, queue: str, now: float) -> float:
        """Seconds the queue's oldest waiting rollout has waited at ``now`` (0 when none waits)."""
        start = self.oldest.get(queue)
        return max(0.0, now - start) if start is not None else 0.0


def routed_queues(settings: DispatcherSettings) -> set[str]:
    return {settings.queue_for_mode(mode) for mode in MODES}


def read_backlog(store: StoreClient, settings: DispatcherSettings, *, timeout: float | None = None) -> Backlog:
    """One Store request, never retried (the next reading is the retry). Raises StoreError."""
    limit = 1 if len(routed_queues(settings)) == 1 else settings.backlog_list_limit
    items, total = store.list_rollouts(status_in=WAITING, sort_by="start_time", limit=limit, retries=0, timeout=timeout)
    return split(items, total, settings)


def split(items: Iterable[Rollout], total: int, settings: DispatcherSettings) -> Backlog:
    """The backlog from a page of the oldest waiting rollouts and the count of all of them (``total``)."""
    waiting = dict.fromkeys(settings.all_queues(), 0)
    oldest: dict[str, float] = {}
    for rollout in items:
        queue = settings.queue_for_mode(rollout.mode)
        waiting[queue] += 1
        if rollout.start_time is not None:
            oldest[queue] = min(oldest.get(queue, rollout.start_time), rollout.start_time)
    listed = sum(waiting.values())
    rest = max(0, total - listed)
    if rest and not listed:  # the Store counted rollouts it did not list: only the default queue can take them
        waiting[settings.default_queue] += rest
    elif rest:
        shares = {queue: rest * count / listed for queue, count in waiting.items()}
        for queue, share in shares.items():
            waiting[queue] += int(share)
        leftover = rest - sum(int(share) for share in shares.values())  # largest remainders first: sums to total
        for queue in sorted(shares, key=lambda q: shares[q] - int(shares[q]), reverse=True)[:leftover]:
            waiting[queue] += 1
    return Backlog(waiting, oldest, exact=rest == 0 or len(routed_queues(settings)) == 1)


def read_gateway_backlog(gateway: GatewayClient, queue: str, limit: int, *, timeout: float | None = None) -> Backlog:
    """One gateway listing, never retried (the next reading is the retry). Raises GatewayError."""
    return gateway_backlog(gateway.list_raw(V1State.QUEUING, limit=limit, retries=0, timeout=timeout), queue, limit)


def gateway_backlog(items: list[Any], queue: str, limit: int) -> Backlog:
    """The backlog from one listing of the gateway's queuing rollouts (at most ``limit``): every item counts, one the
    dispatcher cannot read too (it waits all the same until the dispatcher fails it); the oldest is the smallest
    ``status.created_at`` found."""
    created = [at for at in map(_created_at, items) if at is not None]
    oldest = {queue: min(created)} if created else {}
    return Backlog({queue: len(items)}, oldest, exact=len(items) < limit)


@dataclass(frozen=True)
class GatewayCounts:
    """What ``python -m bridge status`` shows of the gateway: its queuing and running rollouts (each listing at most
    ``limit``: a full one, ``*_capped``, is a lower bound) and when the oldest queuing one was created."""

    queuing: int
    running: int
    oldest_queuing: float | None
    queuing_capped: bool
    running_capped: bool


def read_gateway_counts(gateway: GatewayClient, queue: str, limit: int) -> GatewayCounts:
    """Two listings, never retried. Raises GatewayError."""
    queuing = read_gateway_backlog(gateway, queue, limit)
    running = len(gateway.list_raw(V1State.RUNNING, limit=limit, retries=0))
    waiting = queuing.waiting[queue]
    return GatewayCounts(waiting, running, queuing.oldest.get(queue), not queuing.exact, running >= limit)


def _created_at(item: Any) -> float | None:
    status = item.get("status") if isinstance(item, dict) else None
    created = status.get("created_at") if isinstance(status, dict) else None
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return None
    return float(created)


class BacklogReader:
    """Reads a backlog every ``BRIDGE_BACKLOG_INTERVAL_S`` on a thread of its own, so the dispatch loop never
    waits on it, and only while ``leading()``. ``latest`` is the last good reading: a failed one (``read`` raises one
    of ``failures``) is logged and counted on ``errors`` and leaves it as it was. ``store_reader`` and
    ``gateway_reader`` build the two lines' readers."""

    def __init__(
        self,
        read: Callable[[float], Backlog],
        settings: DispatcherSettings,
        leading: Callable[[], bool],
        *,
        source: str,
        failures: tuple[type[Exception], ...],
        errors: Callable[[], None],
    ) -> None:
        self.read = read
        self.settings = settings
        self.leading = leading
        self.source, self.failures, self.errors = source, failures, errors
        self.latest: Backlog | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Read now (a dispatcher that has just started to lead), not at the end of the current interval."""
        self._wake.set()

    def forget(self) -> None:
        """Drop the last reading (leadership lost): a later leader term starts from a fresh one."""
        self.latest = None

    def close(self) -> None:
        """Stop the thread and wait for it (at most one read's timeout): a dispatch loop that ends leaves none."""
        self._closed.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._timeout() + 1.0)

    def read_once(self) -> None:
        """Read the backlog into ``latest`` if this dispatcher leads; a standby sends its source nothing."""
        if not self.leading():
            return
        started = time.monotonic()
        try:
            backlog = self.read(self._timeout())
        except self.failures as exc:
            self.errors()
            log.warning("reading %s's backlog failed (%s); keeping the last reading", self.source, exc)
            return
        if self.leading():  # a reading finished after leadership was lost is not exported
            self.latest = backlog
        log.debug("%s's backlog %s read in %.3fs", self.source, backlog.waiting, time.monotonic() - started)

    def _timeout(self) -> float:
        return max(5.0, self.settings.backlog_interval_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self.read_once()
            except Exception:  # the thread outlives any surprise: the next interval tries again
                log.exception("unexpected error reading %s's backlog", self.source)
            self._wake.wait(self.settings.backlog_interval_s)
            self._wake.clear()


class LeaderExports:
    """The per-queue gauges a leader exports (``metrics.LEADER_GAUGES``) and what they come from: its backlog reader
    and the lines' exchange. ``stop`` clears them all when leadership ends, so a standby exports none."""

    def __init__(self, reader: BacklogReader, demand: BacklogExchange) -> None:
        self.reader, self.demand = reader, demand
        self.active = False  # the gauges are set

    def stop(self) -> None:
        if self.active:
            metrics.clear_leader_gauges()
            self.reader.forget()
            self.demand.forget()
            self.active = False


def store_reader(store: StoreClient, settings: DispatcherSettings, leading: Callable[[], bool]) -> BacklogReader:
    """The 0.3 bridge's reader: the Store's waiting rollouts per queue (``read_backlog``); a failed reading counts in
    ``agl_bridge_store_errors_total{kind="backlog"}``."""
    return BacklogReader(
        lambda timeout: read_backlog(store, settings, timeout=timeout),
        settings,
        leading,
        source="the Store",
        failures=(StoreError,),
        errors=metrics.STORE_ERRORS.labels("backlog").inc,
    )


def gateway_reader(
    gateway: GatewayClient, settings: DispatcherSettings, queue: str, leading: Callable[[], bool]
) -> BacklogReader:
    """The 1.0 dispatcher's reader: the gateway's queuing rollouts on ``queue`` (``read_gateway_backlog``); a failed
    reading counts in ``agl_bridge_gateway_errors_total{kind="backlog"}``."""
    limit = settings.backlog_list_limit
    return BacklogReader(
        lambda timeout: read_gateway_backlog(gateway, queue, limit, timeout=timeout),
        settings,
        leading,
        source="the gateway",
        failures=(GatewayError,),
        errors=metrics.GATEWAY_ERRORS.labels("backlog").inc,
    )
