"""The backlog per Celery queue, the autoscaling signal the broker's queue length cannot give, since backpressure
keeps the broker nearly empty (docs/operations.md, "Autoscaling signal"): what waits for each dispatch line at its
source, read by its leader on a thread of its own (``BacklogReader``). Each line reads its own source
(``bridge.dispatch.v03.backlog``: the Store's; ``bridge.dispatch.v1.backlog``: the gateway's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bridge.core.coordination.line_demand import BacklogExchange
from bridge.core.settings import DispatcherSettings
from bridge.dispatch import metrics

log = logging.getLogger(__name__)


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


class BacklogReader:
    """Reads a backlog every ``BRIDGE_BACKLOG_INTERVAL_S`` on a thread of its own, so the dispatch loop never
    waits on it, and only while ``leading()``. ``latest`` is the last good reading: a failed one (``read`` raises one
    of ``failures``) is logged and counted on ``errors`` and leaves it as it was. Each line builds its
    own (``bridge.dispatch.v03.backlog.store_reader``, ``bridge.dispatch.v1.backlog.gateway_reader``)."""

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
