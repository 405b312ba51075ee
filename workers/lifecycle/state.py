"""Everything a worker process keeps for its lifetime, in one place, and one ``reset``.

Two kinds, in two objects that modules read at each use (``state.process.x``, ``state.node.x``), never copy:

* ``NodeState``: what the node's main process sets up (its worker bootsteps, ``workers.lifecycle.steps``) and every
  prefork child inherits: the node's 1.0 program server, the Store clock's offset, how the pool runs tasks, the
  stuck-thread count and its listeners, the restart flag, the metrics exporter, the slot adverts and the
  expired-message hand-back.
* ``ProcessState``: what each process builds for itself on first use: its clients (Store, Redis, WebShop, the
  heartbeat monitor), the LLM HTTP client, its instance of the configured agent, LitAgent runners, LLM outages
  seen, endpoints already warned about, its view of the node's drain, its hand-backs of unserved tasks, its 1.0
  programs' relay.

``bridge.core.infra.process_state.reset()``, the one reset of every per-process state (tests, between cases), starts
both afresh (``reset_all``, registered with it on import); ``start_child()`` only the process's own, which the
prefork child hook (``worker_process_init``) calls so a child never uses a client, lock or cache of its parent.
Locks live beside what they guard, so a child never inherits one held by a thread of its parent.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge.core.infra import process_state

if TYPE_CHECKING:
    import httpx
    import redis

    from workers.agents.loading import ConfiguredAgent
    from workers.lifecycle.drain import DrainClock
    from workers.lifecycle.metrics import Exporter
    from workers.lifecycle.resources import WorkerResources
    from workers.lifecycle.steps.advertising import Advertising
    from workers.lifecycle.steps.expired import ExpiredHandBack
    from workers.lifecycle.stuck import Pool, StuckThreads
    from workers.protocol.heartbeat import HeartbeatMonitor
    from workers.protocol.unserved import Refusals
    from workers.v1.relay import AttemptRelay
    from workers.v1.server_supervisor import ProgramServer


def _drain_clock() -> DrainClock:
    from workers.lifecycle.drain import DrainClock

    return DrainClock()


def _refusals() -> Refusals:
    from workers.protocol.unserved import Refusals

    return Refusals()


def _pool() -> Pool:
    from workers.lifecycle.stuck import Pool

    return Pool()


def _stuck_threads() -> StuckThreads:
    from workers.lifecycle.stuck import StuckThreads

    return StuckThreads()


@dataclass
class ProcessState:
    """What one process builds for itself; a forked child starts it afresh. Each ``(pid, value)`` pair is also
    rebuilt by its getter in a process other than ``pid`` (a fork without the child hook)."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # guards resources
    resources: WorkerResources | None = None  # workers.lifecycle.resources.get_resources (carries its pid)
    coordination_lock: threading.Lock = field(default_factory=threading.Lock)  # guards coordination, monitor
    coordination: tuple[int, redis.Redis] | None = None  # get_coordination
    monitor: tuple[int, HeartbeatMonitor] | None = None  # get_monitor, on a worker without a Store
    llm_http_lock: threading.Lock = field(default_factory=threading.Lock)
    llm_http: httpx.Client | None = None  # workers.agents.llm.shared_http
    agent_lock: threading.Lock = field(default_factory=threading.Lock)
    configured_agent: ConfiguredAgent | None = None  # workers.agents.loading.configured_agent (carries its pid)
    litagent_runners: dict[int, Any] = field(default_factory=dict)  # by id(agent): workers.agents.litagent
    llm_outages_lock: threading.Lock = field(default_factory=threading.Lock)
    # per rate-limit pool: the outage its calls share (workers.agents.ratelimit)
    llm_outages: weakref.WeakKeyDictionary[object, Any] = field(default_factory=weakref.WeakKeyDictionary)
    withheld_lock: threading.Lock = field(default_factory=threading.Lock)
    withheld_endpoints: set[str] = field(default_factory=set)  # LLM endpoints already named in a warning
    drain_clock: DrainClock = field(default_factory=_drain_clock)  # workers.lifecycle.drain
    refusals: Refusals = field(default_factory=_refusals)  # workers.protocol.unserved
    relay_lock: threading.Lock = field(default_factory=threading.Lock)
    relay: tuple[int, AttemptRelay] | None = None  # workers.v1.relay.process_relay: its 1.0 programs' gateway


@dataclass
class NodeState:
    """What the node's main process sets up once and every pool process inherits."""

    program_server_lock: threading.Lock = field(default_factory=threading.Lock)
    program_server: ProgramServer | None = None  # workers.v1.launch.node_server
    program_server_failed: str | None = None  # why this process's start of it failed: not tried for every program
    box_root: str | None = None  # the node's 1.0 programs' box root (workers.v1.box)
    isolation: str | None = None  # how the node boxes its 1.0 programs, as it advertises it (workers.v1.box)
    box_namespaces: bool = False  # whether its boxes get PID namespaces (the start-up probe's finding)
    clock_offset_s: float = 0.0  # the Store's clock minus ours (workers.protocol.clock)
    pool: Pool = field(default_factory=_pool)  # how tasks run (workers.lifecycle.stuck)
    stuck_threads: StuckThreads = field(default_factory=_stuck_threads)
    restarting: threading.Event = field(default_factory=threading.Event)  # workers.lifecycle.stuck.restart_worker
    exporter: Exporter | None = None  # workers.lifecycle.metrics.serve (steps.exporter)
    advertising: Advertising | None = None  # the node's slot adverts (workers.lifecycle.steps.advertising)
    hand_back: ExpiredHandBack | None = None  # expired messages' hand-back, made on first use (steps.expired)
    # This main process among all that ever carried its node name: what its drain record names (lifecycle.drain).
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)


process = ProcessState()
node = NodeState()


def start_child() -> None:
    """A forked child's own state afresh, the node's kept as its parent set it up. Nothing is closed: the clients
    are its parent's."""
    global process
    process = ProcessState()


def reset_all() -> None:
    """This process's state and the node's afresh, as a new worker's main process has them; called by
    ``bridge.core.infra.process_state.reset``. Nothing is closed."""
    global node
    start_child()
    node = NodeState()


process_state.on_reset(reset_all)
