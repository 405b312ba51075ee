"""The 1.0 line's backlog (``bridge.dispatch.backlog``): the gateway's rollouts ``queuing``, all on the 1.0
dispatcher's queue.

The gateway counts nothing, so one listing of at most ``BRIDGE_BACKLOG_LIST_LIMIT`` (oldest first, its creation
order) is counted; a full page is a lower bound. The oldest is the smallest ``created_at`` listed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge.core.gateway import GatewayClient, GatewayError, V1State
from bridge.core.settings import DispatcherSettings
from bridge.dispatch import metrics
from bridge.dispatch.backlog import Backlog, BacklogReader


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
