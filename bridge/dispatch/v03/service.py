"""The 0.3 bridge process (``python -m bridge``): wire the Store client, Redis and the publisher into the one
dispatcher with the 0.3 line and run it until SIGINT/SIGTERM, finishing the publish in hand. The 1.0 process is
``bridge.dispatch.v1.run_v1``; both start the same way (``bridge.dispatch.dispatcher.start_process``)."""

from __future__ import annotations

import logging
import threading

import redis

from bridge.core.coordination import coordination_redis, deployment_scope
from bridge.core.coordination.capacity import advertised_agents
from bridge.core.infra import redact_url, setup_process_tracing
from bridge.core.settings import DispatcherSettings
from bridge.core.store import StoreClient
from bridge.core.task import DEFAULT_AGENT
from bridge.dispatch.dispatcher import StopSignal, install_signal_handlers, start_process
from bridge.dispatch.publisher import Publisher
from bridge.dispatch.v03.dispatcher import V03Dispatcher

log = logging.getLogger("bridge")


def run_bridge(settings: DispatcherSettings, *, metrics_port: int | None = None) -> int:
    """The 0.3 bridge until SIGINT/SIGTERM; MissingSetting at once without AGENT_LIGHTNING_STORE_URL."""
    settings.require_store("the bridge (`python -m bridge run`)")
    start_process(settings, metrics_port, log)
    setup_process_tracing(settings.service_name + "-bridge")
    stop = threading.Event()
    install_signal_handlers(stop)
    dispatch_until(settings, stop)
    return 0


def dispatch_until(
    settings: DispatcherSettings, stop: StopSignal, *, agent: str | None = None, strict_scope: bool = False
) -> None:
    """The dispatch loop until ``stop`` is set, finishing the publish in hand; then its clients are closed.

    ``python -m bridge`` and ``bridge.runner.CeleryRunner.iter`` both run exactly this. ``agent`` is the
    agent path the messages name (default ``AGENT``); the leader lock keeps one dispatcher active however
    many run. ``strict_scope``: raise ScopeMismatchError when this Store's workers show up only under another
    spelling of its URL (``bridge.core.coordination.scope_check``), as CeleryRunner wants, instead of logging it.
    """
    store = StoreClient.from_settings(settings)
    if not store.health():
        log.warning("the Store at %s does not answer yet; the bridge keeps trying", redact_url(settings.store_base))
    client = coordination_redis(settings)
    if agent is None:
        _warn_about_other_agents(client, settings)
    try:
        V03Dispatcher(settings, store, client, Publisher(settings, agent=agent), stop, strict_scope=strict_scope).run()
    finally:
        store.close()
        client.close()


def _warn_about_other_agents(client: redis.Redis, settings: DispatcherSettings) -> None:
    """Say at start when online workers run an agent this bridge's messages will not name.

    A worker refuses a message for another agent (failure class ``agent``), so a bridge left at the
    built-in ``webshop`` beside LitAgent workers (or the reverse) would fail every rollout it publishes.
    Only the built-in/LitAgent split is compared: a LitAgent path may be a factory whose workers advertise
    its class, which the bridge cannot know without importing it.
    """
    try:
        advertised = advertised_agents(client, deployment_scope(settings), settings.all_queues())
    except redis.RedisError:
        return  # the dispatcher reports Redis problems itself
    builtin = settings.agent == DEFAULT_AGENT
    others = {node: agent for node, agent in advertised.items() if agent and (agent == DEFAULT_AGENT) != builtin}
    if others:
        listed = ", ".join(f"{node} runs {agent!r}" for node, agent in sorted(others.items()))
        log.warning(
            "the bridge publishes for AGENT=%s but %s: those workers fail such rollouts with class agent; "
            "set the same AGENT on the bridge and the workers",
            settings.agent,
            listed,
        )
