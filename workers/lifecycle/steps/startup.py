"""The node's start-up: its configuration checked and its shared set-up done, before the pool forks.

A worker bootstep (``NodeStartup``), in the node's main process: every pool process inherits what it sets up, and
every other step requires it. Its work is done in ``create``, as Celery applies the steps, before any step starts
(the pool forks in its own step's ``start``); it has nothing to stop. A configuration error stops the worker with one
line on stderr and exit code 2 (``config_errors_exit``). ``start_node`` is that set-up for a given worker and settings.

One hook besides: ``worker_init`` sets up the main process's logging and tracing (``set_up_main_process``), since
Celery configures its own logging before it builds any step, and ours must come first (as the handlers Celery then
finds in place; the app includes this module, so Celery imports it before it sends the signal).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import bootsteps, signals

from bridge.core.coordination import deployment_scope
from bridge.core.infra import EXIT_CONFIG_ERROR, ConfigError, configure_logging, make_undumpable, setup_process_tracing
from bridge.core.settings import WorkerSettings, get_settings
from bridge.core.task import DEFAULT_AGENT
from workers.agents import loading as agent_loading
from workers.lifecycle import metrics as worker_metrics
from workers.lifecycle import state
from workers.protocol import clock
from workers.v1 import box

log = logging.getLogger(__name__)


class NodeStartup(bootsteps.StartStopStep):
    """Checks the configuration and sets the node up (``start_node``) as the worker applies its steps."""

    label = "node start-up"

    def create(self, w: Any) -> None:
        start_node(w, get_settings())


@signals.worker_init.connect
def set_up_main_process(**_: Any) -> None:
    """The main process's logging and tracing, before Celery sets up its logging and builds its steps."""
    set_up_logging_and_tracing()


@contextmanager
def config_errors_exit() -> Iterator[None]:
    """A ConfigError raised inside becomes one line on stderr and ``SystemExit(2)`` (``EXIT_CONFIG_ERROR``), instead
    of Celery's traceback, or its log line and carrying on for one raised in a signal handler."""
    try:
        yield
    except ConfigError as error:
        print(f"error: {error.message}", file=sys.stderr)
        log.critical("%s", error.message)
        raise SystemExit(EXIT_CONFIG_ERROR) from None


def set_up_logging_and_tracing() -> WorkerSettings:
    """This process's logging and operator tracing: the main process's (``worker_init``, the only set-up a threads or
    solo worker gets) and each prefork child's (``pool_process``); idempotent where both run."""
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    setup_process_tracing(settings.service_name + "-worker")
    return settings


def pool_name(worker: Any) -> str:
    """The pool ``worker`` runs, from its ``pool_cls``: an alias (``processes``, ``threads``) or the pool's class."""
    pool = getattr(worker, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "").rpartition(".")[2]
    return {"processes": "prefork", "thread": "threads"}.get(name, name or "prefork")


def start_node(worker: Any, settings: WorkerSettings) -> None:
    """The node's set-up in its main process, before the pool forks, with ``settings``: check the configuration (key
    scope, tracer and pool, agent, 1.0 isolation), record how ``worker`` (its ``pool_cls`` and ``concurrency``) runs
    tasks, count stuck threads in the metrics and read the Store's clock. A configuration error prints one line on
    stderr and raises ``SystemExit(2)``."""
    make_undumpable("worker")  # before the pool forks: every pool process holds the keys too
    with config_errors_exit():
        scope = deployment_scope(settings)  # nothing names this deployment's keys: exit 2 (docs/agl-v1.md)
        agent_loading.check_tracer_pool(settings, pool_name(worker), int(getattr(worker, "concurrency", 1) or 1))
        _load_agent(settings)
        if settings.agl_v1_url:
            box.check_isolation(settings)  # before the pool forks: one box root per node
    state.node.pool.threads = pool_name(worker) == "threads"
    state.node.pool.prefork = pool_name(worker) == "prefork"
    state.node.pool.max_stuck = settings.max_stuck_agent_threads
    state.node.stuck_threads.on_change.append(_count_stuck)
    if settings.store_url is None:
        log.info(
            "no AGENT_LIGHTNING_STORE_URL: this worker runs Agent Lightning 1.0 rollouts only (Redis key scope %s)",
            scope,
        )
    else:  # before the pool forks, so every pool process inherits the offset; exits beyond CLOCK_SKEW_TOLERANCE_S
        clock.check_store_clock(settings)


def _load_agent(settings: WorkerSettings) -> None:
    """Import and build ``AGENT``/``AGENT_HOOKS`` now, so a bad configuration stops the worker at start.

    A LitAgent needs ``agentlightning`` (the ``agl`` extra): a missing package, an unimportable path or a factory that
    fails raises ConfigError, which ``start_node`` turns into one line on stderr and exit code 2, instead of a failed
    attempt per rollout. Built once per process: here (the main process, which a threads or solo pool runs tasks in)
    and again in each prefork child (``workers.agents.loading.configured_agent``).
    """
    if settings.agent == DEFAULT_AGENT:
        return
    agent_loading.configured_agent(settings)
    if settings.agent_tracer != "none":  # under agentops for the stop check, deadline and rate limit only
        from workers.agents.capture import install_openai_capture

        install_openai_capture()  # before the pool forks: every child inherits the wrapped SDK


def _count_stuck(count: int) -> None:
    worker_metrics.STUCK_THREADS.labels("agent").set(count)
