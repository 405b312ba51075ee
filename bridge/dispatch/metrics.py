"""Prometheus series of the dispatchers, served on ``BRIDGE_METRICS_PORT`` (``python -m bridge run|v1
--metrics-port``): the 0.3 bridge's and the 1.0 dispatcher's, one definition each.

A dispatcher exports only the series its line sets: those one line alone sets (``LINE_ONLY``) leave the registry
at import, and ``export_line`` registers them in the process that runs that line; so a 1.0 dispatcher never
serves the 0.3 bridge's Store series as zeros it never measured, nor the bridge the gateway's.

A series both lines export for their own work carries ``line`` (``v03`` or ``v1``, as ``SLOT_SHARE_WEIGHTS``
names them); the per-queue gauges describe the shared queue, whichever leader exports them, and carry none:
aggregate those with ``max by (queue)`` (docs/operations.md, "Autoscaling signal"). The dispatchers see the path
from the Store or gateway to the broker. What happens after a worker takes a message (dequeue-to-start latency,
outcomes, episode, LLM and environment series) is measured where it happens, in ``workers.lifecycle.metrics``;
the Grafana dashboard in deploy/grafana puts them side by side.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

from bridge.core.coordination.slot_share import V03, V1
from bridge.core.infra import ConfigError

DEQUEUED = Counter("agl_bridge_dequeued_total", "Rollouts claimed from the Store")
PUBLISHED = Counter("agl_bridge_published_total", "Rollouts published to the broker", ["queue", "line"])
HANDED_BACK = Counter("agl_bridge_handed_back_total", "Dequeued rollouts returned to the Store queue", ["reason"])
REPUBLISHED = Counter(
    "agl_bridge_republished_total", "Stranded attempts re-published by reconciliation (same attempt id)", ["line"]
)
ORPHANS_FREED = Counter(
    "agl_bridge_orphans_freed_total", "In-flight slots freed because the attempt's executor was gone (no lease)"
)
STRANDED_IN_FLIGHT = Counter(
    "agl_bridge_stranded_in_flight_total",
    "In-flight entries freed by reconciliation: older than the longest queue wait, never started, no lease",
    ["line"],
)
RERUNS = Counter(
    "agl_bridge_reruns_total",
    "1.0 rollouts run again under the next attempt id: its worker was lost (lost) or drained (handover)",
    ["reason"],
)
FAILED = Counter(
    "agl_bridge_failed_total",
    "1.0 rollouts the dispatcher itself failed on the gateway, by failure class (the workers count theirs)",
    ["failure_class"],
)
GATEWAY_ERRORS = Counter("agl_bridge_gateway_errors_total", "Failed 1.0 gateway requests", ["kind"])
DEQUEUE_REQUESTS = Counter("agl_bridge_dequeue_requests_total", "Dequeue requests sent to the Store")
HELD = Gauge("agl_bridge_held_rollouts", "Claimed rollouts the bridge holds until their queue has room", ["queue"])
UNSERVED = Gauge("agl_bridge_unserved_queue", "1 when no live worker consumes the queue", ["queue"])
HAND_BACKS_WITHHELD = Counter(
    "agl_bridge_hand_backs_withheld_total",
    "Hand-backs not made because the Store had moved on (cancelled, finished, started or superseded)",
)
SETTLED = Counter(
    "agl_bridge_rollouts_settled_total",
    "Rollouts reconciliation found active with a finished latest attempt and no lease, by the status it wrote",
    ["status"],
)
TIMEOUTS_CLAMPED = Counter(
    "agl_bridge_timeouts_clamped_total",
    "Rollouts whose timeout_seconds was lowered to what the broker's visibility timeout covers",
)
LOOP_ERRORS = Counter(
    "agl_bridge_loop_errors_total",
    "Unexpected errors in the dispatch loop (logged with the rollout ids; the loop goes on)",
)
STORE_ERRORS = Counter("agl_bridge_store_errors_total", "Failed Store requests", ["kind"])
BROKER_ERRORS = Counter("agl_bridge_broker_errors_total", "Failed broker (Redis) operations")
IN_FLIGHT = Gauge("agl_bridge_in_flight", "Attempts published and not yet finished", ["queue"])
FREE_SLOTS = Gauge(
    "agl_bridge_free_slots",
    "Rollouts the queue's workers can start now (negative: claimed beyond its slots)",
    ["queue"],
)
QUEUE_DEPTH = Gauge("agl_bridge_queue_depth", "Messages waiting in the broker", ["queue"])
OLDEST_QUEUED_AGE = Gauge(
    "agl_bridge_oldest_queued_age_seconds", "How long the oldest message in the broker queue has waited", ["queue"]
)
OLDEST_IN_FLIGHT_AGE = Gauge(
    "agl_bridge_oldest_in_flight_age_seconds", "Age of the oldest published, unfinished attempt", ["queue"]
)
SLOTS = Gauge(
    "agl_bridge_total_slots",
    "Slots of the live worker nodes consuming the queue (a node on two queues counts on both)",
    ["queue"],
)
STORE_WAITING = Gauge(
    "agl_bridge_store_waiting_rollouts",
    "Rollouts queuing or requeuing in the Store whose mode routes to the queue (read every BRIDGE_BACKLOG_INTERVAL_S)",
    ["queue"],
)
STORE_OLDEST_WAITING = Gauge(
    "agl_bridge_store_oldest_waiting_seconds",
    "How long the oldest rollout waiting in the Store for the queue has waited since its enqueue",
    ["queue"],
)
GATEWAY_WAITING = Gauge(
    "agl_bridge_gateway_waiting_rollouts",
    "Rollouts queuing on the 1.0 gateway for the queue (read every BRIDGE_BACKLOG_INTERVAL_S, at most "
    "BRIDGE_BACKLOG_LIST_LIMIT)",
    ["queue"],
)
GATEWAY_OLDEST_WAITING = Gauge(
    "agl_bridge_gateway_oldest_waiting_seconds",
    "How long the oldest rollout queuing on the 1.0 gateway has waited since its creation",
    ["queue"],
)
DESIRED_SLOTS = Gauge(
    "agl_bridge_desired_slots",
    "Slots the queue needs now: rollouts in flight + waiting in the Store + held by the 0.3 bridge + queuing on "
    "the 1.0 gateway; every leader exports the whole figure (scale on the max of this)",
    ["queue"],
)
IS_LEADER = Gauge("agl_bridge_is_leader", "1 when this dispatcher holds its line's dispatch lock", ["line"])
DISPATCH_LATENCY = Histogram(
    "agl_bridge_dequeue_to_publish_seconds",
    "Time from the Store's attempt start (dequeue) to the publish",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

# The per-queue gauges only the leader knows: a standby exports none of them, and a bridge that loses the lock
# clears them (``clear_leader_gauges``), so a scrape never mixes a standby's stale view with the leader's.
LEADER_GAUGES = (
    HELD,
    UNSERVED,
    IN_FLIGHT,
    FREE_SLOTS,
    SLOTS,
    QUEUE_DEPTH,
    OLDEST_QUEUED_AGE,
    OLDEST_IN_FLIGHT_AGE,
    STORE_WAITING,
    STORE_OLDEST_WAITING,
    GATEWAY_WAITING,
    GATEWAY_OLDEST_WAITING,
    DESIRED_SLOTS,
)


# The series one line alone sets: out of the registry until ``export_line`` registers them for that line.
LINE_ONLY: dict[str, tuple[Collector, ...]] = {
    V03: (
        DEQUEUED,
        DEQUEUE_REQUESTS,
        HANDED_BACK,
        HAND_BACKS_WITHHELD,
        ORPHANS_FREED,
        SETTLED,
        STORE_ERRORS,
        DISPATCH_LATENCY,
        HELD,
        UNSERVED,
        FREE_SLOTS,
        QUEUE_DEPTH,
        OLDEST_QUEUED_AGE,
        OLDEST_IN_FLIGHT_AGE,
        STORE_WAITING,
        STORE_OLDEST_WAITING,
    ),
    V1: (RERUNS, FAILED, GATEWAY_ERRORS, GATEWAY_WAITING, GATEWAY_OLDEST_WAITING),
}
_exported: set[str] = set()
_export_lock = threading.Lock()
for _collectors in LINE_ONLY.values():
    for _collector in _collectors:
        REGISTRY.unregister(_collector)


def clear_leader_gauges() -> None:
    for gauge in LEADER_GAUGES:
        gauge.clear()


def serve(host: str, port: int) -> None:
    """Serve /metrics on ``host:port`` from a thread of its own. ConfigError when the port cannot be bound (a 0.3
    bridge and a 1.0 dispatcher on one host each need their own ``--metrics-port``)."""
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (is another dispatcher serving there? "
            "give this one its own --metrics-port or BRIDGE_METRICS_PORT)"
        ) from None


def export_line(line: str) -> None:
    """Export ``line``'s series in this process: register the ones only it sets (once), and create those a
    dashboard alerts on at zero from the start, not only after the first event."""
    with _export_lock:
        if line not in _exported:
            for collector in LINE_ONLY.get(line, ()):
                REGISTRY.register(collector)
            _exported.add(line)
    REPUBLISHED.labels(line)
    STRANDED_IN_FLIGHT.labels(line)
    IS_LEADER.labels(line)
    if line == V1:
        for reason in ("lost", "handover"):
            RERUNS.labels(reason)
        for failure_class in ("input", "infra"):
            FAILED.labels(failure_class)
        for kind in ("dispatch", "backlog"):
            GATEWAY_ERRORS.labels(kind)
    if line == V03:
        for kind in ("dequeue", "hand_back", "backlog", "settle"):
            STORE_ERRORS.labels(kind)
        for reason in ("publish_failed", "stranded", "no_room", "shutdown", "error"):
            HANDED_BACK.labels(reason)
        SETTLED.labels("requeuing")
