"""The 0.3 line's backlog (``bridge.dispatch.backlog``): the Store's rollouts ``queuing`` or ``requeuing``, by the
queue their mode routes to (``QUEUE_BY_MODE``), and the oldest of them.

One Store request per reading (docs/store-protocol.md 3), oldest first by ``start_time`` (the enqueue; a
``requeuing`` rollout keeps its first one): its ``total`` counts every waiting rollout, and the Store cannot filter
by mode, so with one routed queue a page of one rollout is enough, and with several the page holds the
``BRIDGE_BACKLOG_LIST_LIMIT`` oldest, whose split is exact, and the rest is split in their proportions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from bridge.core.infra import StoreError
from bridge.core.settings import DispatcherSettings
from bridge.core.store import Rollout, RolloutStatus, StoreClient
from bridge.dispatch import metrics
from bridge.dispatch.backlog import Backlog, BacklogReader

WAITING = (RolloutStatus.QUEUING, RolloutStatus.REQUEUING)
MODES = (None, "train", "val", "test")  # every mode a Store accepts; None routes like an unmapped mode


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
