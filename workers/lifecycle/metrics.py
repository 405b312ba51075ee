"""Prometheus series of the worker nodes, served by each node on ``WORKER_METRICS_PORT``.

Prefork children cannot serve HTTP, so the series use prometheus_client's multiprocess mode: every process
writes to files in one directory per node (``PROMETHEUS_MULTIPROC_DIR``, chosen and wiped by ``serve`` before the
pool forks: ``workers.lifecycle.steps.exporter``), and the node's main process serves the sum. Every series has at
least one label, so that no value is created at import, before multiprocess mode is on. The bridge imports this
module too (through the task) but never records. Why: docs/operations.md, "Prometheus metrics".
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server, values
from prometheus_client.multiprocess import MultiProcessCollector

from bridge.core.store import AttemptStatus
from workers.lifecycle import state
from workers.protocol.failures import FailureClass

log = logging.getLogger("workers.lifecycle.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_EPISODE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
_STEP_BUCKETS = (1, 2, 3, 5, 8, 10, 15, 20, 30, 50, 100, 200)
_REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
_START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

ROLLOUTS = Counter(
    "agl_worker_rollouts_total",
    "Task deliveries by outcome: succeeded/failed (reported to the Store), skipped (duplicate, superseded), error",
    ["status", "failure_class"],
)
STUCK_THREADS = Gauge(
    "agl_worker_stuck_threads",
    "Agent threads abandoned at their attempt's deadline or stop verdict that have not returned (-P threads)",
    ["kind"],
    multiprocess_mode="livesum",
)
EPISODE_SECONDS = Histogram(
    "agl_worker_episode_duration_seconds",
    "Wall time of one attempt on the worker, claim check to final report",
    ["status"],
    buckets=_EPISODE_BUCKETS,
)
EPISODE_STEPS = Histogram(
    "agl_worker_episode_steps", "Agent steps per finished episode", ["mode"], buckets=_STEP_BUCKETS
)
REWARD = Histogram("agl_worker_reward", "Reward of each succeeded episode", ["mode"], buckets=_REWARD_BUCKETS)
DEQUEUE_TO_START = Histogram(
    "agl_worker_dequeue_to_start_seconds",
    "Store dequeue (attempt start, Store clock) to the task starting on a worker: broker wait plus dispatch",
    ["queue"],
    buckets=_START_BUCKETS,
)
LLM_SECONDS = Histogram(
    "agl_worker_llm_request_seconds",
    "One chat-completion request (a retried call counts each try)",
    ["outcome"],
    buckets=_LATENCY_BUCKETS,
)
LLM_RATE_LIMITED = Counter("agl_worker_llm_rate_limited_total", "LLM answers with HTTP 429", ["source"])
RATELIMIT_BYPASSED = Counter(
    "agl_worker_ratelimit_bypassed_total",
    "Global LLM rate-limit operations skipped because Redis did not answer (BYPASS_S back-off)",
    ["op"],
)
ENV_SECONDS = Histogram(
    "agl_worker_env_request_seconds", "One WebShop request (reset or step)", ["op"], buckets=_LATENCY_BUCKETS
)
UNSERVED_HANDBACKS = Counter(
    "agl_worker_unserved_handbacks_total",
    "Tasks of a line this worker is not configured for (no Store, no 1.0 gateway), handed back to the broker",
    ["line"],
)
ENV_ERRORS = Counter("agl_worker_env_errors_total", "Failed WebShop requests (retried or not)", ["op", "kind"])
RELAY_REFUSED = Counter(
    "agl_worker_relay_refused_total",
    "1.0 agent programs' requests the attempt relay refused: no live token of an attempt (token), a route that is"
    " not the attempt's own (route), past the relay's connections (connections)",
    ["reason"],
)
RELAY_REASONS = ("token", "route", "connections")
PROGRAMS_STARTED = Counter(
    "agl_worker_programs_started_total",
    "1.0 agent programs started, by start (warm, cold) and isolation (box: a uid and directory of its own under"
    " limits; none: AGL_V1_ISOLATION=none)",
    ["start", "isolation"],
)

# --- set-up (worker main process) ---------------------------------------------------------------


@dataclass(frozen=True)
class Exporter:
    """The node's running exporter (``state.node.exporter``), held for the process's lifetime."""

    server: Any  # prometheus_client's HTTP server
    directory: Path  # the multiprocess directory every pool process writes to


def enable_multiprocess(directory: str | None = None) -> Path:
    """Switch this process (and the pool it will fork) to multiprocess values in a fresh directory.

    ``directory`` or ``PROMETHEUS_MULTIPROC_DIR`` is used when given (one per node: it is wiped);
    otherwise a private temporary directory is made.
    """
    chosen = directory or os.environ.get(MULTIPROC_ENV)
    path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="agl-worker-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = str(path)
    values.ValueClass = values.MultiProcessValue()
    return path


def serve(port: int, host: str = "127.0.0.1") -> str | None:
    """Serve the node's summed series on ``host:port``; returns the URL, or None if the port is taken."""
    directory = enable_multiprocess()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("worker metrics not served: cannot bind %s:%d (%s); set WORKER_METRICS_PORT", host, port, exc)
        return None
    state.node.exporter = Exporter(server, directory)
    _export_zeros()
    url = f"http://{host}:{port}/metrics"
    log.info("worker metrics on %s (multiprocess dir %s)", url, directory)
    return url


def _export_zeros() -> None:
    """Error series a dashboard alerts on are exported at zero from the start (main process values)."""
    for source in ("llm", "proxy_llm", "settings"):
        LLM_RATE_LIMITED.labels(source)
    for op in ("reset", "step"):
        ENV_ERRORS.labels(op, "transport")
    for op in ("acquire", "charge"):
        RATELIMIT_BYPASSED.labels(op)
    for reason in RELAY_REASONS:
        RELAY_REFUSED.labels(reason)


# --- recording (any pool process) ---------------------------------------------------------------


def observe_outcome(outcome: Any) -> None:
    """Count one finished delivery from the task's return value (or the exception it raised)."""
    if isinstance(outcome, dict):
        status = str(outcome.get("status") or "unknown")
        failure = str(outcome.get("failure_class") or "none")
    else:
        status, failure = "error", str(FailureClass.INFRA)
    ROLLOUTS.labels(status, failure).inc()


def observe_report(status: AttemptStatus, metadata: dict[str, Any], mode: str | None) -> None:
    """Histograms of one attempt whose final status reached the Store."""
    label_mode = mode or "none"
    duration = metadata.get("duration_s")
    if isinstance(duration, (int, float)):
        EPISODE_SECONDS.labels(status).observe(float(duration))
    steps = metadata.get("steps")
    if isinstance(steps, int):
        EPISODE_STEPS.labels(label_mode).observe(steps)
    reward = metadata.get("reward")
    if status is AttemptStatus.SUCCEEDED and isinstance(reward, (int, float)):
        REWARD.labels(label_mode).observe(float(reward))


def observe_start(queue: str | None, dequeued_at: float | None, now: float) -> None:
    """Dequeue-to-start; clocks of the Store and the worker may differ slightly, so never below zero."""
    if isinstance(dequeued_at, (int, float)):
        DEQUEUE_TO_START.labels(queue or "none").observe(max(0.0, now - float(dequeued_at)))


def observe_llm(seconds: float, outcome: str, source: str) -> None:
    """One chat-completion try: ``ok``, ``rate_limited`` (HTTP 429), ``paused`` (429 from a paused gateway) or
    ``error``."""
    LLM_SECONDS.labels(outcome).observe(seconds)
    if outcome == "rate_limited":
        LLM_RATE_LIMITED.labels(source).inc()


def observe_ratelimit_bypassed(op: str) -> None:
    """One limiter operation (``acquire``, ``charge``, ``refund``) that went ahead without Redis."""
    RATELIMIT_BYPASSED.labels(op).inc()


def relay_refused(reason: str) -> None:
    """One request of a 1.0 agent program the attempt relay refused (``RELAY_REASONS``)."""
    RELAY_REFUSED.labels(reason).inc()


def program_started(start: str, isolation: str) -> None:
    """One 1.0 agent program started (``start``: warm or cold; ``isolation``: box or none)."""
    PROGRAMS_STARTED.labels(start, isolation).inc()


def observe_env(op: str, seconds: float, outcome: int | str) -> None:
    """One WebShop request; ``outcome`` is the HTTP status, or ``transport`` when no answer came."""
    ENV_SECONDS.labels(op).observe(seconds)
    if not isinstance(outcome, int) or outcome >= 400:
        ENV_ERRORS.labels(op, str(outcome)).inc()
