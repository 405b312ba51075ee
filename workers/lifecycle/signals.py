"""Per-process set-up of a worker, hooked on Celery's own signals.

Everything these hooks keep lives in ``workers.lifecycle.state``.

* ``worker_init`` (before the pool forks): logging and tracing, the deployment's key scope and the configured
  LitAgent (``AGENT``; exit code 2 when either is not), the node's 1.0 program server (``workers.v1.launch``;
  exit code 2 when it cannot start), the Store clock offset (``workers.protocol.clock``; none without
  AGENT_LIGHTNING_STORE_URL: 1.0 rollouts only) and the Prometheus exporter;
  ``worker_process_init`` does the per-process part in each prefork child, its own state reset first;
* ``worker_ready``/``worker_shutting_down``: advertise and withdraw this node's slots and agent under its
  Store's key scope (``bridge.core.coordination.capacity``);
* ``task_revoked`` with ``expired``: hand the rollout back to the Store queue, off Celery's loop
  (``ExpiredHandBack``; docs/store-protocol.md section 10, "Handing a rollout back");
* ``task_prerun``/``task_postrun``: dequeue-to-start and outcomes (``workers.lifecycle.metrics``).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from typing import Any

import redis
from celery import signals

from bridge.core.coordination import capacity, coordination_redis, deployment_endpoint, deployment_scope, keys, markers
from bridge.core.gateway import V1_TASK_NAME
from bridge.core.infra import (
    EXIT_CONFIG_ERROR,
    ConfigError,
    StoreError,
    configure_logging,
    make_undumpable,
    setup_process_tracing,
)
from bridge.core.settings import WorkerSettings, get_settings
from bridge.core.store import StoreClient, handback
from bridge.core.task import DEFAULT_AGENT, TASK_NAME
from workers.agents import loading as agent_loading
from workers.lifecycle import drain, state
from workers.lifecycle import metrics as worker_metrics
from workers.protocol import clock
from workers.protocol.lease import free_slot
from workers.v1 import box, launch

log = logging.getLogger("workers.lifecycle.signals")

_ADVERTISE_EVERY_S = 10.0


def _node_slots(consumer: Any) -> tuple[str, list[str], int]:
    controller = consumer.controller
    slots = int(getattr(controller, "concurrency", 0) or 0)
    autoscaler = getattr(controller, "autoscaler", None)
    if autoscaler is not None:
        slots = int(autoscaler.max_concurrency)
    queues = [q.name for q in consumer.task_consumer.queues] if consumer.task_consumer else []
    return consumer.hostname, queues or [get_settings().default_queue], max(1, slots)


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    hostname, queues, slots = _node_slots(sender)
    client = coordination_redis(get_settings())
    scope = deployment_scope(get_settings())
    endpoint = deployment_endpoint(get_settings())
    state.node.advert.update(hostname=hostname, queues=queues, slots=slots, client=client, scope=scope)
    log.info("worker %s offers %d slots on queues %s (Redis key scope %s)", hostname, slots, ", ".join(queues), scope)

    agent = _advertised_agent()

    def advertise_forever() -> None:
        while True:
            state.node.advertise_now.clear()
            with state.node.advert_lock:  # never re-advertise after the shutdown withdrew the slots
                if state.node.advertiser_stop.is_set():
                    return
                _advertise(client, scope, hostname, queues, slots, agent, endpoint=endpoint)
            state.node.advertise_now.wait(_ADVERTISE_EVERY_S)
            if state.node.advertiser_stop.is_set():
                return

    threading.Thread(target=advertise_forever, name="slot-advertiser", daemon=True).start()


def _advertise(
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
        if (
            endpoint is not None
        ):  # bridge.core.coordination.scope_check names it to a process that spells the URL otherwise
            client.set(keys.scope_endpoint(scope), endpoint, ex=capacity.CAPACITY_TTL_S)
        if stuck_now:
            client.set(keys.worker_stuck(scope, hostname), stuck_now, ex=capacity.CAPACITY_TTL_S)
        else:
            client.delete(keys.worker_stuck(scope, hostname))
    except redis.RedisError as exc:
        log.warning("could not advertise slots (broker down?): %r", exc)


@signals.worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    """Withdraw the node's adverts at once and, with WORKER_SHUTDOWN_GRACE_S, start the bounded drain
    (``workers.lifecycle.drain``): its stop time for every process of the node, and the exit deadline of this one."""
    node = state.node
    node.advertiser_stop.set()
    node.advertise_now.set()
    advert = node.advert
    if not advert:
        return
    grace = get_settings().worker_shutdown_grace_s
    with node.advert_lock:
        try:
            capacity.withdraw(advert["client"], advert["scope"], advert["hostname"], advert["queues"])
            advert["client"].delete(
                keys.worker_agent(advert["scope"], advert["hostname"]),
                keys.worker_stuck(advert["scope"], advert["hostname"]),
                keys.worker_isolation(advert["scope"], advert["hostname"]),
            )
        except redis.RedisError:
            pass
    clock = state.process.drain_clock
    clock.incarnation = state.node.incarnation
    if grace is not None and not clock.draining:
        stop_at = clock.begin(advert["client"], advert["scope"], advert["hostname"], grace)
        drain.exit_by(time.time() + grace - drain.EXIT_EARLY_S)
        log.warning(
            "draining: episodes still running in %.1f s are stopped and handed over; exiting within %g s",
            stop_at - time.time(),
            grace,
        )


def _set_up_logging_and_tracing() -> WorkerSettings:
    """Shared by both init hooks: ``worker_init`` is the only one a threads/solo worker gets, and each
    prefork child gets ``worker_process_init`` (the set-up is idempotent where both fire)."""
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    setup_process_tracing(settings.service_name + "-worker")
    return settings


def _advertised_agent() -> str:
    try:
        return agent_loading.advertised_agent(get_settings())
    except ConfigError as exc:  # checked in worker_init already; never stop advertising slots over it
        log.error("agent: %s", exc.message)
        return get_settings().agent


def _load_agent(settings: WorkerSettings) -> None:
    """Import and build ``AGENT``/``AGENT_HOOKS`` now, so a bad configuration stops the worker at start.

    A LitAgent needs ``agentlightning`` (the ``agl`` extra): a missing package, an unimportable path or a
    factory that fails raises ConfigError, which ``_on_worker_init`` turns into one line on stderr and exit
    code 2, instead of a failed attempt per rollout. Built once per process: here (the main process, which a
    threads or solo pool runs tasks in) and again in each prefork child (``workers.agents.loading.configured_agent``).
    """
    if settings.agent == DEFAULT_AGENT:
        return
    agent_loading.configured_agent(settings)
    if settings.agent_tracer != "none":  # under agentops for the stop check, deadline and rate limit only
        from workers.agents.capture import install_openai_capture

        install_openai_capture()  # before the pool forks: every child inherits the wrapped SDK


def _pool_name(worker: Any) -> str:
    """The pool a starting worker will run (``worker_init`` comes before Celery resolves the alias)."""
    pool = getattr(worker, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "").rpartition(".")[2]
    return {"processes": "prefork", "thread": "threads"}.get(name, name or "prefork")


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    start_node(sender, _set_up_logging_and_tracing())


def start_node(worker: Any, settings: WorkerSettings) -> None:
    """What Celery's ``worker_init`` does in the node's main process, before the pool forks, with ``settings``:
    check the configuration (key scope, tracer and pool, agent, 1.0 isolation), start the node's 1.0 program
    server, record how ``worker`` (its ``pool_cls`` and ``concurrency``) runs tasks, read the Store's clock and
    serve the metrics. A configuration error prints one line on stderr and raises ``SystemExit(2)``."""
    make_undumpable("worker")  # before the pool forks: every pool process holds the keys too
    try:
        scope = deployment_scope(settings)  # nothing names this deployment's keys: exit 2 (docs/agl-v1.md)
        agent_loading.check_tracer_pool(settings, _pool_name(worker), int(getattr(worker, "concurrency", 1) or 1))
        _load_agent(settings)
        if settings.agl_v1_url:
            box.check_isolation(settings)  # before the pool forks: one box root per node
        if settings.agl_v1_url and settings.agl_v1_warm_start:  # before the pool forks: one per node
            launch.node_server(settings)
    except ConfigError as error:  # Celery logs and ignores an Exception from a signal handler: exit here
        print(f"error: {error.message}", file=sys.stderr)
        log.critical("%s", error.message)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    state.node.pool.threads = _pool_name(worker) == "threads"
    state.node.pool.prefork = _pool_name(worker) == "prefork"
    state.node.pool.max_stuck = settings.max_stuck_agent_threads
    state.node.stuck_threads.on_change.append(_on_stuck_change)
    if settings.store_url is None:
        log.info(
            "no AGENT_LIGHTNING_STORE_URL: this worker runs Agent Lightning 1.0 rollouts only (Redis key scope %s)",
            scope,
        )
    else:  # before the pool forks, so every pool process inherits the offset; exits beyond CLOCK_SKEW_TOLERANCE_S
        clock.check_store_clock(settings)
    if settings.worker_metrics_port is not None:
        worker_metrics.serve(settings.worker_metrics_port, settings.metrics_host)


def _on_stuck_change(count: int) -> None:
    worker_metrics.STUCK_THREADS.labels("agent").set(count)
    state.node.advertise_now.set()


@signals.task_prerun.connect
def _on_task_prerun(sender: Any = None, task: Any = None, kwargs: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) != TASK_NAME or not isinstance(kwargs, dict):
        return
    if getattr(getattr(task, "request", None), "retries", 0):
        return  # a Celery retry starts late on purpose; only first deliveries measure the dispatch path
    rollout = kwargs.get("rollout")
    attempt = rollout.get("attempt") if isinstance(rollout, dict) else None
    started = attempt.get("start_time") if isinstance(attempt, dict) else None
    if isinstance(started, (int, float)):
        started = clock.to_local(started)  # stamped by the Store's clock
    worker_metrics.observe_start(kwargs.get("queue"), started, time.time())


@signals.task_postrun.connect
def _on_task_postrun(sender: Any = None, retval: Any = None, state: str | None = None, **_: Any) -> None:
    if getattr(sender, "name", None) not in (TASK_NAME, V1_TASK_NAME) or state == "RETRY":
        return
    worker_metrics.observe_outcome(retval)


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    """A prefork child: its own state from the start (``workers.lifecycle.state``: nothing of its parent's but
    what the node set up for every process), then its clients."""
    state.start_child()
    settings = _set_up_logging_and_tracing()
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


@signals.task_revoked.connect
def _on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    if getattr(sender, "name", None) != TASK_NAME or request is None:
        return
    kwargs = getattr(request, "kwargs", None) or {}
    rollout = kwargs.get("rollout") if isinstance(kwargs, dict) else None
    queue = kwargs.get("queue") if isinstance(kwargs, dict) else None
    task_id = str(getattr(request, "id", ""))
    advert = state.node.advert
    if advert and queue:
        try:
            # Not while another executor holds the attempt: a revoked duplicate must not free the live one's slot.
            free_slot(advert["client"], advert["scope"], queue, task_id)
        except redis.RedisError:
            pass
    has_store = get_settings().store_url is not None  # else the rollout was never this worker's to run
    if expired and isinstance(rollout, dict) and has_store and not _started_elsewhere(task_id):
        _expired_hand_back().submit(rollout)  # the Store calls run on a thread of their own, off the consumer loop


def _started_elsewhere(attempt_id: str) -> bool:
    """An expired duplicate of an attempt another executor runs (a Celery retry keeps the first ``expires``):
    handing it back would fence the live execution out and waste its episode."""
    advert = state.node.advert
    if not advert:
        return False
    try:
        fact = markers.read_markers(advert["client"], [attempt_id])[attempt_id]
    except redis.RedisError:
        return False  # the hand-back re-checks the Store: only a still-unstarted latest attempt is requeued
    return fact.leased or fact.started


class ExpiredHandBack:
    """Hands expired messages' rollouts back to the Store from a thread of its own, never Celery's loop.

    ``task_revoked`` runs inside the consumer's event loop (the only thread taking messages for every slot of the
    node), where Store calls with retries would stop the node taking messages while the Store is slow, exactly
    when a burst of expiries arrives. The handler only queues the rollout; one lazily started daemon thread per
    process does the Store calls. A hand-back lost when the process exits leaves the attempt ``preparing`` until
    the Store's watchdog or the bridge's reconcile hands it back.
    """

    MAX_QUEUED = 10_000

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=self.MAX_QUEUED)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, rollout: dict[str, Any]) -> None:
        """Queue a hand-back and return at once (called in the consumer loop)."""
        try:
            self._queue.put_nowait(rollout)
        except queue.Full:
            log.error("too many expired messages waiting to be handed back; dropping one (the watchdog will)")
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="expired-hand-back", daemon=True)
                self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait until every queued hand-back was tried (tests); True if the queue drained in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.05)
        return False

    def _run(self) -> None:
        settings = get_settings()
        with StoreClient.from_settings(settings, retries=2) as store:
            while True:  # a daemon thread: it ends with its process
                rollout = self._queue.get()
                try:
                    hand_back_expired(rollout, store)
                except Exception:  # the thread must survive anything one rollout throws
                    log.exception("handing back an expired rollout failed")
                finally:
                    self._queue.task_done()


def _expired_hand_back() -> ExpiredHandBack:
    """The node's hand-back of expired messages (``workers.lifecycle.state``), made on first use."""
    node = state.node
    if node.hand_back is None:
        node.hand_back = ExpiredHandBack()
    assert isinstance(node.hand_back, ExpiredHandBack)
    return node.hand_back


def hand_back_expired(rollout: dict[str, Any], store: StoreClient) -> None:
    """Requeue an expired message's rollout in the Store if it is live and its attempt the unstarted latest one."""
    rid = rollout.get("rollout_id")
    aid = (rollout.get("attempt") or {}).get("attempt_id")
    if not isinstance(rid, str) or not isinstance(aid, str):
        return
    try:
        why_not = handback.hand_back(store, rid, aid)
    except StoreError as exc:
        log.error("[rollout=%s attempt=%s] expired message could not be handed back: %s", rid, aid, exc)
        return
    if why_not is None:
        log.warning("[rollout=%s attempt=%s] message expired in the broker; handed back", rid, aid)
    else:
        log.info("[rollout=%s attempt=%s] message expired in the broker; not handed back: %s", rid, aid, why_not)
