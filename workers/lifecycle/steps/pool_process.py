"""Each prefork child's own start: a fresh per-process state, its logging and tracing, its clients built early.

Behind one hook, Celery's ``worker_process_init``, which each prefork child sends itself as it starts (once per child,
respawned ones included) and no bootstep reaches: the worker's steps run in the main process only. The step
``PoolProcessStart`` connects it in ``create``, before the pool forks, so every child inherits the connection; a threads
or solo worker never sends it (its main process runs the tasks, with what ``NodeStartup`` set up).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps, signals

from workers.agents import loading as agent_loading
from workers.lifecycle import state
from workers.lifecycle.steps.startup import NodeStartup, set_up_logging_and_tracing

log = logging.getLogger(__name__)


class PoolProcessStart(bootsteps.StartStopStep):
    """Hooks ``start_pool_process`` on ``worker_process_init`` before the pool forks."""

    label = "pool process start"
    requires = (NodeStartup,)

    def create(self, w: Any) -> None:
        signals.worker_process_init.connect(start_pool_process, weak=False, dispatch_uid=__name__)


def start_pool_process(**_: Any) -> None:
    """A prefork child: its own state from the start (``workers.lifecycle.state``: nothing of its parent's but what the
    node set up for every process), then its clients."""
    state.start_child()
    settings = set_up_logging_and_tracing()
    # Build the child's clients now, not in its first task: measured, the first rollout of each prefork
    # child spent ~0.5 s more between "received" and "started" (client and TLS context construction).
    try:
        from workers.agents.llm import shared_http
        from workers.lifecycle.resources import get_resources

        if settings.store_url is not None:  # a 1.0-only worker has no Store clients to build
            get_resources()
        shared_http(settings.llm_timeout_s)
        agent_loading.configured_agent(settings)  # this child's own instance of the agent
    except Exception as exc:  # the first task builds them instead
        log.warning("could not pre-build this process's clients: %r", exc)
