"""The Store's backlog per Celery queue: rollouts ``queuing`` or ``requeuing`` there, by the queue their mode
routes to (``QUEUE_BY_MODE``), and the oldest of them. It is the autoscaling signal the broker's queue length
cannot give, since backpressure keeps the broker nearly empty (docs/operations.md, "Autoscaling signal").

One Store request per reading (docs/store-protocol.md 3), oldest first by ``start_time`` (the enqueue; a
``requeuing`` rollout keeps its first one): its ``total`` counts every waiting rollout, and the Store cannot
filter by mode, so with one routed queue a page of one rollout is enough, and with several the page holds the
``BRIDGE_BACKLOG_LIST_LIMIT`` oldest, whose split is exact, and the rest is split in their proportions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bridge.core.errors import StoreError
from bridge.core.models import Rollout, RolloutStatus
from bridge.core.settings import Settings
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
    exact: bool = True  # False: more rollouts waited than were listed, and the split of the rest is estimated

    def oldest_age(self, queue: str, now: float) -> float:
        """Seconds the queue's oldest waiting rollout has waited at ``now`` (0 when none waits)."""
        start = self.oldest.get(queue)
        return max(0.0, now - start) if start is not None else 0.0


def routed_queues(settings: Settings) -> set[str]:
    return {settings.queue_for_mode(mode) for mode in MODES}


def read_backlog(store: StoreClient, settings: Settings, *, timeout: float | None = None) -> Backlog:
    """One Store request, never retried (the next reading is the retry). Raises StoreError."""
    limit = 1 if len(routed_queues(settings)) == 1 else settings.backlog_list_limit
    items, total = store.list_rollouts(status_in=WAITING, sort_by="start_time", limit=limit, retries=0, timeout=timeout)
    return split(items, total, settings)


def split(items: Iterable[Rollout], total: int, settings: Settings) -> Backlog:
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


class BacklogReader:
    """Reads the backlog every ``BRIDGE_BACKLOG_INTERVAL_S`` on a thread of its own, so the dispatch loop never
    waits on it, and only while ``leading()``. ``latest`` is the last good reading: a failed one is logged and
    counted (``agl_bridge_store_errors_total{kind="backlog"}``) and leaves it as it was."""

    def __init__(self, store: StoreClient, settings: Settings, leading: Callable[[], bool]) -> None:
        self.store = store
        self.settings = settings
        self.leading = leading
        self.latest: Backlog | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Read now (a bridge that has just started to lead), not at the end of the current interval."""
        self._wake.set()

    def forget(self) -> None:
        """Drop the last reading (leadership lost): a later leader term starts from a fresh one."""
        self.latest = None

    def close(self) -> None:
        """Stop the thread and wait for it (at most one read's timeout): a dispatch loop that ends leaves none."""
        self._closed.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.settings.backlog_interval_s) + 1.0)

    def read_once(self) -> None:
        """Read the backlog into ``latest`` if this bridge leads; a standby sends the Store nothing."""
        if not self.leading():
            return
        started = time.monotonic()
        try:
            backlog = read_backlog(self.store, self.settings, timeout=max(5.0, self.settings.backlog_interval_s))
        except StoreError as exc:
            metrics.STORE_ERRORS.labels("backlog").inc()
            log.warning("reading the Store's backlog failed (%s); keeping the last reading", exc)
            return
        if self.leading():  # a reading finished after leadership was lost is not exported
            self.latest = backlog
        log.debug("backlog %s read in %.3fs", backlog.waiting, time.monotonic() - started)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self.read_once()
            except Exception:  # the thread outlives any surprise: the next interval tries again
                log.exception("unexpected error reading the Store's backlog")
            self._wake.wait(self.settings.backlog_interval_s)
            self._wake.clear()
