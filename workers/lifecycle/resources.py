"""Per-process clients (Store, Redis, WebShop, lease and heartbeat threads), created lazily after fork.

Under prefork, sockets and threads made in the parent must not be used by the children, so the
clients are built on first use in each process (held in ``workers.lifecycle.state``, which the prefork child
hook resets) and rebuilt if the process id changes. A 1.0 attempt needs
only the settings and the coordination Redis (``get_coordination``), so a 1.0-only worker never builds the
Store's clients; ``get_resources`` (the 0.3 task's) raises MissingSetting without AGENT_LIGHTNING_STORE_URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis

from bridge.core.coordination import coordination_redis, deployment_scope
from bridge.core.settings import WorkerSettings, get_settings
from bridge.core.store import StoreClient
from workers.agents.webshop import WebShopClient
from workers.lifecycle import state
from workers.lifecycle.shared_resources import RedisResources
from workers.protocol.fence_board import FenceBoard
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.telemetry.courier import TraceCourier


@dataclass
class WorkerResources:
    settings: WorkerSettings
    store: StoreClient
    redis: redis.Redis
    webshop: WebShopClient
    monitor: HeartbeatMonitor
    courier: TraceCourier
    pid: int


def get_resources() -> WorkerResources:
    """This process's 0.3 clients (``workers.lifecycle.state``), built on first use."""
    process = state.process
    with process.lock:
        if process.resources is None or process.resources.pid != os.getpid():
            process.resources = _build(get_settings())
        return process.resources


def get_coordination() -> tuple[WorkerSettings, redis.Redis]:
    """This process's settings and coordination Redis client (the one ``get_resources`` holds too)."""
    process = state.process
    with process.coordination_lock:
        if process.coordination is None or process.coordination[0] != os.getpid():
            process.coordination = (os.getpid(), coordination_redis(get_settings(), timeout_s=10))
        return get_settings(), process.coordination[1]


def get_monitor() -> HeartbeatMonitor:
    """This process's heartbeat monitor, which renews every attempt's lease and stops them at a drain: the 0.3
    resources' one where a Store is configured, else one without a Store (a 1.0-only worker)."""
    settings = get_settings()
    if settings.store_url is not None:
        return get_resources().monitor
    _, client = get_coordination()
    process = state.process
    with process.coordination_lock:
        if process.monitor is None or process.monitor[0] != os.getpid():
            drain_scope = deployment_scope(settings) if settings.worker_shutdown_grace_s is not None else None
            process.monitor = (os.getpid(), HeartbeatMonitor(None, client, None, drain_scope))
        return process.monitor[1]


def _build(settings: WorkerSettings) -> WorkerResources:
    store = StoreClient.from_settings(settings)
    _, client = get_coordination()
    store.shared_resources = RedisResources(client, deployment_scope(settings))
    webshop = WebShopClient(
        str(settings.webshop_url),
        token=settings.webshop_token,
        timeout_s=settings.webshop_timeout_s,
        retries=settings.webshop_retries,
    )
    board = FenceBoard(client, deployment_scope(settings)) if settings.fence_board else None
    drain_scope = deployment_scope(settings) if settings.worker_shutdown_grace_s is not None else None
    monitor = HeartbeatMonitor(store, client, board, drain_scope)
    courier = TraceCourier(store, settings.traces_endpoint, gather_max_s=settings.span_gather_max_s)
    return WorkerResources(settings, store, client, webshop, monitor, courier, os.getpid())
