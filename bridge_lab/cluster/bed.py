"""The multi-host test bed: services on the subnet's root-side address, worker hosts and a bridge host.

``TestBed`` owns a ``Cluster`` (``bridge_lab.cluster.netns``) and one ``LocalStack`` of services
(Redis, Store, WebShop server, LLM stand-in) bound to the cluster's gateway address, so every host reaches
them over its veth link exactly as a worker machine reaches them over a network. ``TestBed.nodes`` starts
Celery worker nodes inside chosen hosts and the bridge inside a host of its own, as a ``LocalStack``
that uses the services' URLs and is torn down per scenario. ``TestBed.run`` runs one scenario on such
nodes: it enqueues, observes and audits with the chaos suite's ``ChaosRun`` and ``audit`` (the same four
zeros), and records the run's figures (throughput, recovery times).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bridge.core.settings import Settings
from bridge.core.store import StoreClient
from bridge_lab.chaos.audit import conclude
from bridge_lab.chaos.run import reset_between_scenarios
from bridge_lab.chaos.scenarios import CHAOS_DISPATCHER_ID, CHAOS_ENV, RETRY_CONFIG
from bridge_lab.chaos.state import ChaosRun, ScenarioResult
from bridge_lab.cluster.netns import Cluster, ClusterUnavailable, Host
from bridge_lab.procs import ManagedProcess
from bridge_lab.rabbitmq import Vhost
from bridge_lab.stack import LocalStack, StackConfig

log = logging.getLogger("bridge_lab.cluster")

BRIDGE_HOST = "bridgehost"
# The chaos suite's short intervals (heartbeat 1 s, lease 4 s) and a 5 s reconcile: a lost host's work is
# running again within seconds, so the tests stay short. ``BedConfig.default_intervals`` uses the product's.
FAST_ENV = {**CHAOS_ENV, "BRIDGE_RECONCILE_INTERVAL_S": "5", "LOG_LEVEL": "INFO"}
# The product's lease, heartbeat and reconcile intervals; only what a bounded scenario needs is set.
DEFAULT_ENV = {
    "MAX_STEPS": "8",
    "ROLLOUT_DEFAULT_TIMEOUT_S": "300",
    "BRIDGE_MAX_QUEUE_WAIT_S": "120",
    "BROKER_VISIBILITY_TIMEOUT_S": "900",
    "LOG_LEVEL": "INFO",
}
# The Store's watchdog is kept out of recovery (unresponsive after 10 min) so that what is measured is the
# bridge's and the workers' own recovery: the lease, the reconcile scan and the takeover.
CLUSTER_ROLLOUT_CONFIG = {**RETRY_CONFIG, "unresponsive_seconds": 600, "timeout_seconds": 300}


@dataclass
class BedConfig:
    """How many worker hosts, how each node is sized, the workload's LLM latency and the intervals."""

    hosts: int = 3
    concurrency: int = 4
    pool: str = "prefork"
    policy_latency_ms: float = 500.0
    default_intervals: bool = False
    log_dir: Path | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # settings of workers and bridge, over the above
    rabbitmq_url: str | None = None  # amqp://…@127.0.0.1: RabbitMQ as broker, in a vhost of the run's own

    @property
    def env(self) -> dict[str, str]:
        return {**(DEFAULT_ENV if self.default_intervals else FAST_ENV), **self.overrides}

    def interval(self, name: str) -> float:
        """One of the settings the nodes run with (for the bounds a scenario reports): set, else its default."""
        if name in self.env:
            return float(self.env[name])
        for info in Settings.model_fields.values():
            if info.validation_alias == name:
                return float(info.default)
        raise KeyError(f"no setting is read from {name}")


@dataclass
class ClusterResult:
    """A scenario run's audit (the chaos suite's four zeros) and its measured figures."""

    audit: ScenarioResult
    hosts: int
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.audit.clean and not self.figures.get("errors")


Fault = Callable[[ChaosRun, "TestBed", LocalStack, dict[str, Any]], None]


class TestBed:
    """The cluster and its services; ``close`` (or leaving the ``with``) removes both on every path."""

    __test__ = False  # not a pytest class

    def __init__(self, config: BedConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="agl-cluster-"))
        self.cluster = Cluster()
        self.services: LocalStack | None = None
        self.bridge_host: Host | None = None
        self._vhost: Vhost | None = None
        self._forwarder: ManagedProcess | None = None

    def open(self, say: Callable[[str], None] = lambda message: log.info("%s", message)) -> TestBed:
        try:
            self.cluster.open()
            say(f"subnet {self.cluster.subnet}: services on {self.cluster.gateway}")
            for n in range(1, self.config.hosts + 1):
                host = self.cluster.add_host(f"host{n}")
                say(f"{host.hostname}: namespace {host.netns}, {host.address}")
            self.bridge_host = self.cluster.add_host(BRIDGE_HOST)
            broker_url = self._rabbitmq(say) if self.config.rabbitmq_url else None
            self.services = LocalStack(
                StackConfig(
                    broker_url=broker_url,
                    bind_host=self.cluster.gateway,
                    broker_persistent=True,
                    workers=0,
                    bridge=False,
                    policy_latency_ms=self.config.policy_latency_ms,
                    log_dir=self.log_dir,
                )
            )
            self.services.start_services(say)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.services is not None:
            self.services.stop()
        if self._forwarder is not None:
            self._forwarder.stop()
        if self._vhost is not None:
            self._vhost.__exit__(None, None, None)
        self.cluster.close()

    def _rabbitmq(self, say: Callable[[str], None]) -> str:
        """A vhost of this run on the RabbitMQ at ``rabbitmq_url``, reached from the hosts through a forwarder.

        The server listens on loopback (and lets ``guest`` in only from there), so ``socat`` on the subnet's
        gateway relays each host's connection to it; a cut link still cuts the host off from the broker.
        """
        from bridge_lab.procs import find_executable, free_port
        from bridge_lab.rabbitmq import amqp_answers, with_vhost

        source = urlsplit(self.config.rabbitmq_url or "")
        socat = find_executable("socat")
        if socat is None:
            raise ClusterUnavailable("RabbitMQ across the subnet needs `socat` (apt-get install socat)")
        vhost = Vhost(self.cluster.prefix)
        why = vhost.available()
        if why:
            raise ClusterUnavailable(f"no vhost of its own on RabbitMQ: {why}")
        self._vhost = vhost.__enter__()
        port, target = free_port(), f"{source.hostname or '127.0.0.1'}:{source.port or 5672}"
        url = with_vhost(
            urlunsplit((source.scheme, f"{source.netloc.split('@')[0]}@{self.cluster.gateway}:{port}", "/", "", "")),
            vhost.name,
        )
        argv = [socat, f"TCP-LISTEN:{port},bind={self.cluster.gateway},reuseaddr,fork", f"TCP:{target}"]
        self._forwarder = ManagedProcess(
            "rabbitmq-forwarder", argv, self.log_dir / "socat.log", lambda: amqp_answers(url, 1.0), None, 30.0
        )
        self._forwarder.start()
        self._forwarder.wait_healthy()
        say(f"broker: RabbitMQ vhost {vhost.name} at {self.cluster.gateway}:{port} (relayed to {target})")
        return url

    def __enter__(self) -> TestBed:
        return self if self.services is not None else self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_hosts(self) -> list[Host]:
        return [h for name, h in self.cluster.hosts.items() if name != BRIDGE_HOST]

    def nodes(self, hosts: list[Host], log_dir: Path) -> LocalStack:
        """One worker node per host (started together, then awaited) and the bridge on its own host."""
        services = self.services
        assert services is not None and self.bridge_host is not None, "open() first"
        stack = LocalStack(
            StackConfig(
                store_url=services.store_url,
                broker_url=services.broker_url,
                redis_url=services.redis_url or None,
                webshop_url=services.webshop_url,
                llm_base_url=services.llm_base_url,
                workers=0,
                bridge=False,
                concurrency=self.config.concurrency,
                pool=self.config.pool,
                log_dir=log_dir,
                extra_env={**self.config.env, "BRIDGE_DISPATCHER_ID": CHAOS_DISPATCHER_ID},
            )
        )
        try:
            started = [stack.add_worker(prefix=h.prefix, node_host=h.hostname, wait=False) for h in hosts]
            for process in started:
                process.wait_healthy()
            stack.start_bridge(prefix=self.bridge_host.prefix)
        except BaseException:
            stack.stop()
            raise
        return stack

    def run(
        self, name: str, hosts: int, tasks: list[dict[str, Any]], fault: Fault | None, deadline_s: float
    ) -> ClusterResult:
        """Nodes on the first ``hosts`` hosts, the tasks enqueued at once, the fault in a thread; audited."""
        services = self.services
        assert services is not None, "open() first"
        reset_between_scenarios(services)
        stack = self.nodes(self.worker_hosts[:hosts], self.log_dir / name)
        figures: dict[str, Any] = {"errors": []}
        try:
            with StoreClient(services.store_url, retries=3) as store:
                rollouts = store.enqueue(
                    [{"input": t, "mode": "test", "config": CLUSTER_ROLLOUT_CONFIG} for t in tasks]
                )
            started = time.monotonic()
            run = ChaosRun(services, stack, [r.rollout_id for r in rollouts])
            observer = threading.Thread(target=run.observe, name="cluster-observer", daemon=True)
            observer.start()
            thread = threading.Thread(
                target=_guarded, args=(fault, run, self, stack, figures), name="cluster-fault", daemon=True
            )
            thread.start()
            # The clock stops when the last rollout ends, not when the fault thread does: a scenario's checks
            # (a `bridge status` subprocess on a loaded machine) can outlast a short run.
            finished_at: list[float] = []

            def done() -> bool:
                if not run.complete:  # a scenario may enqueue more while it runs
                    finished_at.clear()
                    return False
                finished_at[:] = finished_at or [time.monotonic()]
                return not thread.is_alive()

            all_done = run.wait_for(done, deadline_s)
            end = finished_at[0] if all_done and finished_at else time.monotonic()
            figures["seconds_to_finish"] = round(end - started, 2)
            if all_done:
                figures["throughput_per_s"] = round(len(run.rollout_ids) / figures["seconds_to_finish"], 3)
            result = conclude(run, thread, observer)
            figures["notes"] = list(run.notes)  # every scenario's, the audit's included
            figures["worker_ids"] = worker_hosts_of(run)
            run.close()
        finally:
            stack.stop()
        result.name = name
        result.seconds = round(time.monotonic() - started, 1)
        return ClusterResult(result, hosts, figures)


def worker_hosts_of(run: ChaosRun) -> dict[str, int]:
    """Host part of each executor id the Store recorded (``host:pid:thread``) -> attempts it reported."""
    counts: dict[str, int] = {}
    for rid in run.rollout_ids:
        for attempt in run.store.list_attempts(rid):
            worker_id = str((attempt.metadata or {}).get("worker_id") or "")
            if worker_id:
                host = worker_id.split(":")[0]
                counts[host] = counts.get(host, 0) + 1
    return dict(sorted(counts.items()))


def _guarded(fault: Fault | None, run: ChaosRun, bed: TestBed, stack: LocalStack, figures: dict[str, Any]) -> None:
    if fault is None:
        return
    try:
        fault(run, bed, stack, figures)
    except Exception as exc:  # a fault that breaks must show in the report, not kill the run silently
        figures["errors"].append(f"fault injection error: {exc!r}")
