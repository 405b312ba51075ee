"""The node's slot adverts: its slots (less its stuck agent threads), agent, 1.0 isolation and the URL its key scope
comes from, in the coordination Redis (``bridge.core.coordination.capacity``), from the moment it takes messages to
its warm shutdown.

A worker bootstep (``SlotAdvertising``): the node's main process alone holds the consumer, and with it the slots and
queues it offers. Its ``start`` (before the consumer's: Celery starts the consumer last) sets up its state,
``state.node.advertising`` (``Advertising``), and hooks two signals of that process: ``worker_ready``, sent once when
the consumer takes messages, starts the advertiser thread (every ``ADVERTISE_EVERY_S``, at once when the stuck count
changes); ``worker_shutting_down``, sent at the signal itself (SIGTERM, Ctrl-C), withdraws every advert at once: no
step's ``stop`` comes that early. Its ``stop`` ends the thread and unhooks both.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import bootsteps, signals

from bridge.core.coordination import capacity, coordination_redis, deployment_endpoint, deployment_scope, keys
from bridge.core.infra import ConfigError
from bridge.core.settings import get_settings
from workers.agents import loading as agent_loading
from workers.lifecycle import state
from workers.lifecycle.steps.startup import NodeStartup

log = logging.getLogger(__name__)

ADVERTISE_EVERY_S = 10.0


@dataclass(frozen=True)
class Advert:
    """What the node advertises under, fixed at ``worker_ready``."""

    hostname: str
    queues: list[str]
    slots: int
    client: redis.Redis
    scope: str


@dataclass
class Advertising:
    """The node's advertising: its advert once ready, and its thread's controls."""

    advert: Advert | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # never an advert after the withdrawal
    stopped: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # advertise at once


class SlotAdvertising(bootsteps.StartStopStep):
    """Advertises the node's slots from ``worker_ready`` and withdraws them at ``worker_shutting_down``."""

    label = "slot advertising"
    requires = (NodeStartup,)

    def start(self, w: Any) -> None:
        state.node.advertising = Advertising()
        state.node.stuck_threads.on_change.append(_wake)
        signals.worker_ready.connect(start_advertising, weak=False, dispatch_uid=__name__)
        signals.worker_shutting_down.connect(withdraw, weak=False, dispatch_uid=__name__)

    def stop(self, w: Any) -> None:
        signals.worker_ready.disconnect(dispatch_uid=__name__)
        signals.worker_shutting_down.disconnect(dispatch_uid=__name__)
        advertising = state.node.advertising
        if advertising is not None:
            advertising.stopped.set()
            advertising.wake.set()

    terminate = stop


def current_advert() -> Advert | None:
    """The node's advert, once it is ready (None before, and in a process that never advertised)."""
    advertising = state.node.advertising
    return advertising.advert if advertising is not None else None


def start_advertising(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: the consumer ``sender`` takes messages; advertise its slots until the shutdown."""
    advertising = state.node.advertising
    if advertising is None:
        return
    hostname, queues, slots = _node_slots(sender)
    settings = get_settings()
    client = coordination_redis(settings)
    scope = deployment_scope(settings)
    endpoint = deployment_endpoint(settings)
    advert = advertising.advert = Advert(hostname, queues, slots, client, scope)
    log.info("worker %s offers %d slots on queues %s (Redis key scope %s)", hostname, slots, ", ".join(queues), scope)
    agent = _advertised_agent()

    def advertise_forever() -> None:
        while True:
            advertising.wake.clear()
            with advertising.lock:  # never re-advertise after the shutdown withdrew the slots
                if advertising.stopped.is_set():
                    return
                advertise(advert.client, scope, hostname, queues, slots, agent, endpoint=endpoint)
            advertising.wake.wait(ADVERTISE_EVERY_S)
            if advertising.stopped.is_set():
                return

    threading.Thread(target=advertise_forever, name="slot-advertiser", daemon=True).start()


def advertise(
    client: redis.Redis,
    scope: str,
    hostname: str,
    queues: list[str],
    slots: int,
    agent: str,
    *,
    endpoint: str | None = None,
) -> None:
    """One advert of the node's slots (less its stuck agent threads), its agent and the URL its scope is
    derived from (``endpoint``, redacted), all expiring."""
    try:
        # One slot fewer per abandoned agent thread (workers.lifecycle.stuck): it still holds what it blocks on.
        stuck_now = state.node.stuck_threads.count()
        capacity.advertise(client, scope, hostname, queues, max(0, slots - stuck_now))
        # Same lifetime as the slots: CeleryRunner.init reads which online workers run which agent,
        # and status how many threads each holds stuck.
        client.set(keys.worker_agent(scope, hostname), agent, ex=capacity.CAPACITY_TTL_S)
        if state.node.isolation is not None:  # status shows how its 1.0 programs are contained
            client.set(keys.worker_isolation(scope, hostname), state.node.isolation, ex=capacity.CAPACITY_TTL_S)
        if endpoint is not None:  # bridge.core.coordination.scope_check names it to a process that spells it otherwise
            client.set(keys.scope_endpoint(scope), endpoint, ex=capacity.CAPACITY_TTL_S)
        if stuck_now:
            client.set(keys.worker_stuck(scope, hostname), stuck_now, ex=capacity.CAPACITY_TTL_S)
        else:
            client.delete(keys.worker_stuck(scope, hostname))
    except redis.RedisError as exc:
        log.warning("could not advertise slots (broker down?): %r", exc)


def withdraw(**_: Any) -> None:
    """``worker_shutting_down``: stop advertising and withdraw the node's adverts at once."""
    advertising = state.node.advertising
    if advertising is None:
        return
    advertising.stopped.set()
    advertising.wake.set()
    advert = advertising.advert
    if advert is None:
        return
    with advertising.lock:
        try:
            capacity.withdraw(advert.client, advert.scope, advert.hostname, advert.queues)
            advert.client.delete(
                keys.worker_agent(advert.scope, advert.hostname),
                keys.worker_stuck(advert.scope, advert.hostname),
                keys.worker_isolation(advert.scope, advert.hostname),
            )
        except redis.RedisError:
            pass


def _wake(count: int) -> None:
    """A stuck thread's count changed: advertise the slots it leaves at once."""
    advertising = state.node.advertising
    if advertising is not None:
        advertising.wake.set()


def _node_slots(consumer: Any) -> tuple[str, list[str], int]:
    controller = consumer.controller
    slots = int(getattr(controller, "concurrency", 0) or 0)
    autoscaler = getattr(controller, "autoscaler", None)
    if autoscaler is not None:
        slots = int(autoscaler.max_concurrency)
    queues = [q.name for q in consumer.task_consumer.queues] if consumer.task_consumer else []
    return consumer.hostname, queues or [get_settings().default_queue], max(1, slots)


def _advertised_agent() -> str:
    try:
        return agent_loading.advertised_agent(get_settings())
    except ConfigError as exc:  # checked at the node's start already; never stop advertising slots over it
        log.error("agent: %s", exc.message)
        return get_settings().agent
