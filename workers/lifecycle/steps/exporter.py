"""The node's Prometheus exporter (``WORKER_METRICS_PORT``): the sum of every pool process's series, served by the main
process.

A worker bootstep (``MetricsExporter``), included where the port is set. Started in ``create``, before any step
starts, since the pool forks in its own step's ``start`` and each child must inherit the multiprocess mode and its
directory (``workers.lifecycle.metrics.serve``; its state is ``state.node.exporter``). It serves until the process
exits, so that a scrape during the drain still answers: it has nothing to stop.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from bridge.core.settings import get_settings
from workers.lifecycle import metrics
from workers.lifecycle.steps.startup import NodeStartup


class MetricsExporter(bootsteps.StartStopStep):
    """Serves the node's series as the worker applies its steps, after the configuration checks."""

    label = "metrics exporter"
    requires = (NodeStartup,)

    def include_if(self, w: Any) -> bool:
        return get_settings().worker_metrics_port is not None

    def create(self, w: Any) -> None:
        settings = get_settings()
        assert settings.worker_metrics_port is not None  # include_if
        metrics.serve(settings.worker_metrics_port, settings.metrics_host)
