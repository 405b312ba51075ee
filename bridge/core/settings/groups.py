"""The settings, one validated group per concern; each process composes the groups it reads
(``bridge.core.settings.processes``).

Variable names follow Agent Lightning's reference runner (``AGENT_LIGHTNING_STORE_URL``, ``WEBSHOP_URL``,
``OPENAI_API_BASE``, ...) so a user can switch executors without touching their environment. Each field reads
the variable named by its ``validation_alias`` (keyword arguments may use the field's name instead) and is
documented by the string below it; a group's ``title`` heads its section of .env.example and
docs/configuration.md, which are generated from the groups (``python -m bridge_lab.configdoc --write``). A group
checks its own fields, alone and together; a check that needs two groups belongs to the process class that
has both. How values are parsed: ``bridge.core.settings.values``; the time budgets derived from the fields:
``bridge.core.task.time_budget``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, HttpUrl, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bridge.core.infra import MissingSetting, redact_url
from bridge.core.settings.values import (
    AMQP_SCHEMES,
    REDIS_SCHEMES,
    check_tls_verified,
    hook_list,
    is_amqp_url,
    is_import_path,
    is_redis_url,
    key_host_list,
    module_prefix_list,
    pass_env_list,
    queue_map,
    rate_limit_map,
    share_weights,
)
from bridge.core.task import hard_time_limit

SET_IN_EXAMPLE = "set_in_example"
"""``json_schema_extra`` key: the variable's line in .env.example is set, not commented out."""

SECRETS = frozenset({"openai_api_key", "store_token", "webshop_token", "agl_v1_key"})
"""Fields ``redacted`` never shows."""


class SettingsGroup(BaseSettings):
    """A group of settings read from the environment and ``.env``; ``title`` names its section in the docs."""

    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", populate_by_name=True, use_attribute_docstrings=True
    )

    title: ClassVar[str] = "Settings"

    def redacted(self) -> dict[str, Any]:
        """The settings as they may be logged: secrets removed, URLs stripped of passwords."""
        shown: dict[str, Any] = {}
        for name, value in self.model_dump().items():
            if name in SECRETS:
                shown[name] = "***" if value else None
            elif isinstance(value, str) or name.endswith(("_url", "_base", "endpoint")):
                shown[name] = redact_url(str(value)) if value is not None else None
            else:
                shown[name] = value
        return shown


class StoreSettings(SettingsGroup):
    """Agent Lightning 0.3's Store: where the 0.3 line's rollouts and spans live."""

    title: ClassVar[str] = "Agent Lightning Store"

    store_url: HttpUrl | None = Field(
        default=None,
        validation_alias="AGENT_LIGHTNING_STORE_URL",
        examples=["http://127.0.0.1:4747"],
        json_schema_extra={SET_IN_EXAMPLE: True},
    )
    """Base URL of the Store (`agl store`). Required by what serves Agent Lightning 0.3 (`python -m bridge`,
    CeleryRunner, the workers' 0.3 rollouts); a 1.0-only deployment leaves it unset (docs/agl-v1.md, "Without
    a Store"). `python -m bridge demo` starts a Store when it is unset."""
    store_token: str | None = Field(default=None, validation_alias="AGENT_LIGHTNING_STORE_TOKEN")
    """Bearer token sent to the Store, if a proxy in front of it asks for one (the Store itself has no auth)."""
    store_timeout_s: float = Field(default=30.0, gt=0, validation_alias="STORE_TIMEOUT_S")
    """Seconds per Store request."""
    store_retries: int = Field(default=5, ge=0, le=50, validation_alias="STORE_RETRIES")
    """Retries of a Store request's transient failures (connection errors, 5xx), with backoff."""

    @property
    def store_base(self) -> str:
        """The Store's URL without a trailing slash; MissingSetting when AGENT_LIGHTNING_STORE_URL is unset."""
        return self.require_store("this command")

    def require_store(self, needed_by: str) -> str:
        """``store_base``, or MissingSetting naming AGENT_LIGHTNING_STORE_URL and ``needed_by`` (the part that
        serves Agent Lightning 0.3) when it is unset: entry points call this at start-up."""
        if self.store_url is None:
            raise MissingSetting(
                f"invalid configuration: AGENT_LIGHTNING_STORE_URL: is required but not set ({needed_by} works "
                "with Agent Lightning 0.3's Store; a 1.0-only deployment runs `python -m bridge v1`, docs/agl-v1.md)",
                setting="AGENT_LIGHTNING_STORE_URL",
            )
        return str(self.store_url).rstrip("/")


class GatewaySettings(SettingsGroup):
    """Agent Lightning 1.0's gateway and its key."""

    title: ClassVar[str] = "Agent Lightning 1.0 gateway"

    agl_v1_url: str = Field(
        default="",
        validation_alias="AGL_V1_SERVER_URL",
        examples=["http://127.0.0.1:8080"],
    )
    """Agent Lightning 1.0's gateway (`agl-server`) as this process reaches it: `python -m bridge v1` reads its
    rollouts, the workers report to it and give its proxy and events URLs to the agent programs."""
    agl_v1_key: str | None = Field(default=None, validation_alias="AGL_V1_KEY")
    """The gateway's key (its `key`): sent as a bearer token by the dispatcher and the workers, never given to an
    agent program, whose AGL_KEY is a token of its attempt that the worker's relay accepts (docs/agl-v1.md)."""


class BrokerSettings(SettingsGroup):
    """The Celery broker, its queues and redelivery timeouts, and the coordination Redis (leases, slots, rate
    limits, the leader lock): what the dispatchers and the workers must set alike. Refuses timeouts under which the
    broker could redeliver work that is still running."""

    title: ClassVar[str] = "Celery broker and coordination Redis"

    broker_url: str = Field(
        default="redis://localhost:6379/0",
        validation_alias="CELERY_BROKER_URL",
        examples=["redis://127.0.0.1:6379/0"],
        json_schema_extra={SET_IN_EXAMPLE: True},
    )
    """The broker: Redis (redis://, rediss://, redis+socket://) or RabbitMQ (amqp://, amqps://, pyamqp://). The
    demo starts its own Redis when this is unset or does not answer."""
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL", examples=["redis://127.0.0.1:6379/0"])
    """Coordination Redis (leases, slot accounting, rate limits, the leader lock). Defaults to CELERY_BROKER_URL
    when that is Redis; required with RabbitMQ, e.g. CELERY_BROKER_URL=amqp://agl:pw@rabbit:5672// + this."""
    consumer_timeout_s: float = Field(default=1800.0, gt=0, validation_alias="BROKER_CONSUMER_TIMEOUT_S")
    """RabbitMQ only: the server's consumer_timeout in seconds (rabbitmq.conf consumer_timeout, in ms there; 30 min
    by default) or its queues' consumer-timeout. RabbitMQ closes a channel whose message stays unacknowledged
    longer, so start-up refuses a hard limit + BRIDGE_MAX_QUEUE_WAIT_S above it. Raise the server's value first,
    then this."""
    queue_type: Literal["classic", "quorum"] = Field(default="classic", validation_alias="QUEUE_TYPE")
    """RabbitMQ only: classic (durable) or quorum (replicated; no global QoS). Set it alike on every process."""
    redis_key_scope: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", validation_alias="REDIS_KEY_SCOPE"
    )
    """The scope of this deployment's keys in Redis (slots, leases, the leader lock). By default a digest of
    AGENT_LIGHTNING_STORE_URL in canonical form (without one: of AGL_V1_SERVER_URL; localhost and 127.0.0.1 are
    one), so every process must name the same host; a name set alike on every process (letters, digits, . _ -)
    lets them reach the Store or the gateway by different names (localhost here, store in compose)."""
    broker_tls_insecure: bool = Field(default=False, validation_alias="BROKER_TLS_INSECURE")
    """rediss:// and amqps:// URLs (CELERY_BROKER_URL, REDIS_URL) check the server's certificate and host name
    against the system's CAs (a private CA: SSL_CERT_FILE=/path/ca.pem). true turns both checks off, with a
    warning at every start; without it a URL's own ssl_cert_reqs=none or ssl_check_hostname=false is refused."""
    default_queue: str = Field(default="rollouts", validation_alias="CELERY_DEFAULT_QUEUE")
    """Queue of rollouts whose mode has no entry in QUEUE_BY_MODE."""
    queue_by_mode: Annotated[dict[str, str], NoDecode, BeforeValidator(queue_map)] = Field(
        default_factory=dict,
        validation_alias="QUEUE_BY_MODE",
        examples=["train=rollouts-train,val=rollouts-val,test=rollouts-val"],
    )
    """Queue per rollout mode, so validation can run on its own workers: mode=queue pairs."""
    default_timeout_s: float = Field(default=900.0, gt=0, validation_alias="ROLLOUT_DEFAULT_TIMEOUT_S")
    """Time budget of a rollout whose config sets no timeout_seconds (soft limit ~90 %, hard limit 95 %)."""
    visibility_timeout_s: float = Field(default=7200.0, gt=0, validation_alias="BROKER_VISIBILITY_TIMEOUT_S")
    """Redis redelivers an unacknowledged message after this; must exceed the hard limit + BRIDGE_MAX_QUEUE_WAIT_S."""
    max_queue_wait_s: float = Field(default=300.0, gt=0, validation_alias="BRIDGE_MAX_QUEUE_WAIT_S")
    """A message older than this in the broker expires and its rollout is handed back to the Store queue."""
    heartbeat_interval_s: float = Field(default=10.0, gt=0, le=300, validation_alias="HEARTBEAT_INTERVAL_S")
    """Seconds between a running attempt's fence reads of its rollout, and heartbeats for rollouts with
    unresponsive_seconds (capped at unresponsive_seconds/3 of the rollout)."""
    lease_ttl_s: float = Field(default=30.0, gt=0, validation_alias="LEASE_TTL_S")
    """Lifetime of the Redis lease that admits one executor per attempt; more than twice the heartbeat."""
    done_marker_ttl_s: int = Field(default=7 * 24 * 3600, gt=0, validation_alias="DONE_MARKER_TTL_S")
    """How long Redis remembers that an attempt was reported, so a late duplicate delivery is dropped without a
    Store read; at least twice the broker's redelivery timeout. About 150 bytes of Redis memory per attempt for
    this long: at 10 rollouts/s, 0.9 GB with the default week. A duplicate that comes later still stops at the
    fence (it reads the Store, which says the attempt is no longer running)."""

    @field_validator("broker_url")
    @classmethod
    def _check_broker(cls, value: str) -> str:
        """Redis or RabbitMQ (AMQP 0-9-1): the two brokers whose redelivery rules this project accounts for."""
        if not (is_redis_url(value) or is_amqp_url(value)):
            raise ValueError(f"expected a Redis or RabbitMQ URL ({', '.join(REDIS_SCHEMES + AMQP_SCHEMES)})")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis(cls, value: str | None) -> str | None:
        """The coordination store is always Redis; empty means unset."""
        if not value:
            return None
        if not is_redis_url(value):
            raise ValueError(f"expected a Redis URL ({', '.join(REDIS_SCHEMES)})")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> BrokerSettings:
        """A URL that turns certificate checks off is refused unless BROKER_TLS_INSECURE says so."""
        if not self.broker_tls_insecure:
            for name, url in (("CELERY_BROKER_URL", self.broker_url), ("REDIS_URL", self.redis_url)):
                check_tls_verified(name, url)
        return self

    @model_validator(mode="after")
    def _check_timeouts(self) -> BrokerSettings:
        """Refuse configurations under which the broker could redeliver work that is still running."""
        if self.broker_is_amqp and not self.redis_url:
            raise ValueError(
                "REDIS_URL must be set with a RabbitMQ broker: leases, slots, rate limits and the leader lock "
                "live in Redis (e.g. REDIS_URL=redis://localhost:6379/0)"
            )
        longest = hard_time_limit(self, self.default_timeout_s) + self.max_queue_wait_s
        if self.redelivery_timeout_s <= longest:
            name, why = (
                ("BROKER_CONSUMER_TIMEOUT_S", "RabbitMQ closes the channel of a rollout running that long")
                if self.broker_is_amqp
                else ("BROKER_VISIBILITY_TIMEOUT_S", "Redis redelivers running rollouts")
            )
            raise ValueError(
                f"{name} ({self.redelivery_timeout_s:g}s) must exceed the hard time limit "
                f"plus BRIDGE_MAX_QUEUE_WAIT_S ({longest:g}s), or {why}; "
                f"raise {name} (for RabbitMQ: the server's consumer_timeout first) or lower ROLLOUT_DEFAULT_TIMEOUT_S"
            )
        if self.done_marker_ttl_s < 2 * self.redelivery_timeout_s:
            raise ValueError(
                f"DONE_MARKER_TTL_S ({self.done_marker_ttl_s}s) must be at least twice the broker's redelivery "
                f"timeout ({self.redelivery_timeout_s:g}s), which is how late a duplicate delivery can come"
            )
        if self.lease_ttl_s <= self.heartbeat_interval_s * 2:
            raise ValueError("LEASE_TTL_S must be more than twice HEARTBEAT_INTERVAL_S so a live lease never lapses")
        return self

    @property
    def broker_is_amqp(self) -> bool:
        return is_amqp_url(self.broker_url)

    @property
    def coordination_url(self) -> str:
        """The Redis that holds leases, slots, rate limits and the leader lock (``bridge.core.coordination``)."""
        return self.redis_url or self.broker_url

    @property
    def redelivery_timeout_s(self) -> float:
        """How long the broker lets a message stay unacknowledged before another worker may get it."""
        return self.consumer_timeout_s if self.broker_is_amqp else self.visibility_timeout_s

    def queue_for_mode(self, mode: str | None) -> str:
        return self.queue_by_mode.get(mode or "", self.default_queue)

    def all_queues(self) -> list[str]:
        return sorted({self.default_queue, *self.queue_by_mode.values()})


class TelemetrySettings(SettingsGroup):
    """Every process's log, its metrics server's interface and its operator traces' service name."""

    title: ClassVar[str] = "Logging, metrics and operator traces"

    log_level: str = Field(default="INFO", validation_alias="LOG_LEVEL")
    """Level of every process's log: DEBUG, INFO, WARNING, ERROR or CRITICAL."""
    log_json: bool = Field(default=False, validation_alias="LOG_JSON")
    """One JSON object per line (with rollout_id / attempt_id / task_id fields) instead of plain text."""
    metrics_host: str = Field(default="127.0.0.1", validation_alias="METRICS_HOST")
    """Interface both metrics servers bind; 0.0.0.0 in containers so Prometheus can scrape them."""
    service_name: str = Field(default="agl-celery-bridge", validation_alias="AGENT_LIGHTNING_SERVICE_NAME")
    """service.name of the spans; the bridge and workers append -bridge / -worker for operator traces."""

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return level


class AgentSettings(SettingsGroup):
    """Which agent the workers run, which every message names."""

    title: ClassVar[str] = "Agent"

    agent: str = Field(default="webshop", validation_alias="AGENT")
    """Which agent the workers run: `webshop` (the built-in WebShop loop) or `module.path:attr` naming an Agent
    Lightning LitAgent (class, instance, zero-argument factory or @agentlightning.rollout function); needs
    `pip install -e '.[agl]'`. Messages only name the agent to check it; workers never import from them."""

    @field_validator("agent")
    @classmethod
    def _check_agent(cls, value: str) -> str:
        value = value.strip()
        if value != "webshop" and not is_import_path(value):
            raise ValueError(f"expected 'webshop' or 'module.path:attr', got {value!r}")
        return value


class DispatchSettings(SettingsGroup):
    """The dispatchers' own knobs: the 0.3 bridge's polling and batching, both lines' reconciling, publishing,
    backlog reads and slot sharing, the 1.0 dispatcher's reruns."""

    title: ClassVar[str] = "Dispatch"

    dispatcher_id: str = Field(default="celery-bridge", validation_alias="BRIDGE_DISPATCHER_ID")
    """worker_id the bridge dequeues under (keep one per deployment; several bridges share it, one leads)."""
    poll_min_s: float = Field(default=0.1, gt=0, validation_alias="BRIDGE_POLL_MIN_S")
    """Seconds between the bridge's polls of the Store after a dequeue that found work, while slots are free;
    every empty dequeue doubles the wait (jittered) up to BRIDGE_POLL_MAX_S."""
    poll_max_s: float = Field(default=0.2, gt=0, validation_alias="BRIDGE_POLL_MAX_S")
    """Longest wait between polls while slots are free: the Store cannot notify, so this bounds the wait of a
    rollout enqueued into an empty queue (a trainer's first rollout of every batch). 0.2 costs an idle Store 5-10
    dequeues a second (2-4% of its capacity): raise it for a shared Store. Once the slots were all busy, empty
    polls may wait longer, up to the coalescing wait (BRIDGE_COALESCE_MAX_S; docs/performance.md)."""
    max_batch: int = Field(default=64, ge=1, le=10000, validation_alias="BRIDGE_MAX_BATCH")
    """Most rollouts claimed per dequeue (never more than the workers' free slots)."""
    coalesce_max_s: float = Field(default=1.5, ge=0, le=5, validation_alias="BRIDGE_COALESCE_MAX_S")
    """Once every slot is busy, the bridge lets freed slots gather for 2% of the mean episode time, at most this
    many seconds (0 = off), so that one dequeue claims several: about 0.02 x slots + 1 rollouts whatever the
    episode length below the cap, for about 1% more idle time per slot (docs/performance.md)."""
    max_held: int = Field(default=32, ge=1, le=10000, validation_alias="BRIDGE_MAX_HELD")
    """Most claimed rollouts the bridge holds while their queue is full or consumed by no worker (QUEUE_BY_MODE);
    it keeps dispatching for the other queues meanwhile, and claims nothing more while this many are held."""
    reconcile_interval_s: float = Field(default=20.0, gt=0, validation_alias="BRIDGE_RECONCILE_INTERVAL_S")
    """Seconds between the bridge's scans for stranded attempts and dead executors: with LEASE_TTL_S and a
    confirming scan (2 x HEARTBEAT_INTERVAL_S + 5 s) it bounds how soon a lost worker host's rollouts run again
    (docs/cluster.md)."""
    publish_retries: int = Field(default=5, ge=0, le=50, validation_alias="BRIDGE_PUBLISH_RETRIES")
    """Broker publish retries before a rollout is handed back."""
    backlog_interval_s: float = Field(default=5.0, gt=0, validation_alias="BRIDGE_BACKLOG_INTERVAL_S")
    """Seconds between the leading dispatcher's reads of its backlog, on a thread of its own: the 0.3 bridge's of the
    Store's waiting rollouts (one request), the 1.0 dispatcher's of the gateway's queuing ones (one listing). They
    feed agl_bridge_store_waiting_rollouts, agl_bridge_gateway_waiting_rollouts and agl_bridge_desired_slots
    (docs/operations.md, "Autoscaling signal")."""
    backlog_list_limit: int = Field(default=1000, ge=1, le=100000, validation_alias="BRIDGE_BACKLOG_LIST_LIMIT")
    """The most rollouts one backlog read lists. With several queues (QUEUE_BY_MODE) the Store cannot count by mode,
    so the 0.3 bridge lists this many of the oldest waiting rollouts and splits the rest in their proportions (the
    total stays exact; with one queue it lists one rollout). The 1.0 gateway counts nothing, so the 1.0 dispatcher
    and `python -m bridge status` list up to this many of its rollouts: beyond it the count is a lower bound, which
    caps one reading's scale-up (docs/operations.md, "Autoscaling signal")."""
    slot_share_weights: Annotated[dict[str, float], NoDecode, BeforeValidator(share_weights)] = Field(
        default_factory=lambda: {"v03": 1.0, "v1": 1.0},
        validation_alias="SLOT_SHARE_WEIGHTS",
        examples=["v03:1,v1:1"],
    )
    """How the 0.3 bridge (v03) and the 1.0 dispatcher (v1) share the slots of CELERY_DEFAULT_QUEUE while both have
    rollouts waiting: line:weight pairs (a missing line weighs 1); a line alone may use every slot. Each dispatcher
    applies its own line's weight, so set it alike on both (docs/operations.md, "Sharing a worker pool between 0.3
    and 1.0")."""
    agl_v1_max_reruns: int = Field(default=1, ge=0, le=10, validation_alias="AGL_V1_MAX_RERUNS")
    """Times a 1.0 rollout whose worker was lost mid-run runs again, under the next attempt id; then it fails."""
    agl_v1_publish_give_up_s: float = Field(default=600.0, gt=0, validation_alias="AGL_V1_PUBLISH_GIVE_UP_S")
    """How long `python -m bridge v1` keeps retrying (with backoff) a 1.0 rollout the broker will not take before it
    fails the rollout with the broker's error; meanwhile the rollouts behind it go on. An error that no retry can
    cure (the message cannot be encoded) fails it at once."""
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        validation_alias="BRIDGE_METRICS_PORT",
        examples=[9100],
    )
    """The bridge serves Prometheus /metrics here (also `python -m bridge run --metrics-port`), and so does the 1.0
    dispatcher (`python -m bridge v1 --metrics-port`; two on one host need a port each); off when unset."""

    @model_validator(mode="after")
    def _check_polls(self) -> DispatchSettings:
        if self.poll_min_s > self.poll_max_s:
            raise ValueError("BRIDGE_POLL_MIN_S must not exceed BRIDGE_POLL_MAX_S")
        return self


class WorkerNodeSettings(SettingsGroup):
    """A worker node's own knobs: its metrics, shutdown, fencing and clock checks, Celery events."""

    title: ClassVar[str] = "Worker node"

    worker_metrics_port: int | None = Field(
        default=None, ge=1, le=65535, validation_alias="WORKER_METRICS_PORT", examples=[9101]
    )
    """Each worker node serves /metrics here (sums its pool processes); off when unset. One port per node: on one
    host with several nodes give each its own."""
    worker_shutdown_grace_s: float | None = Field(
        default=None, ge=8, le=86400, validation_alias="WORKER_SHUTDOWN_GRACE_S"
    )
    """Bound a worker's warm shutdown (SIGTERM) to this many seconds: episodes still running this long less a
    6 s margin after the signal are stopped and reported failed (class shutdown),
    or handed back to the Store queue when the rollout has no retry left, so they run again on another worker;
    the process exits within it. Unset: the warm shutdown waits for every running episode. Set it below the pod's
    terminationGracePeriodSeconds less 5 s (docs/operations.md, "Graceful shutdown")."""
    fence_max_age_s: float = Field(default=10.0, ge=0, le=300, validation_alias="FENCE_MAX_AGE_S")
    """How old (seconds) a worker's view of its rollout may be when it starts or reports (see
    docs/store-protocol.md section 10). The dequeue answer and every heartbeat give a fresh view, so short
    episodes make no extra Store reads; a read is always made after a takeover and when the Store's watchdog could
    have acted. 0 reads before every start and report."""
    fence_board: bool = Field(default=True, validation_alias="FENCE_BOARD")
    """Share fence reads through Redis: each heartbeat interval one worker process reads the rollouts of every
    running attempt of the cluster and posts a verdict for each, instead of one read per process (one per running
    attempt under prefork). false: every process reads its own attempts."""
    clock_skew_tolerance_s: float = Field(default=5.0, ge=0, validation_alias="CLOCK_SKEW_TOLERANCE_S")
    """Largest clock difference (seconds) between a worker host and the Store a worker starts with. It is measured
    at start from the Store's Date header (within about 1 s), logged, and corrected for wherever the worker
    compares the Store's timestamps with its own clock; beyond it the worker refuses to start. 0: no check."""
    task_events: bool = Field(default=True, validation_alias="CELERY_TASK_EVENTS")
    """Celery task events, which Flower's task list needs (three small publishes per rollout from the pool
    parent)."""


class LitAgentSettings(SettingsGroup):
    """How the workers run an Agent Lightning LitAgent: its hooks, its tracer, its stuck threads."""

    title: ClassVar[str] = "LitAgents on the workers"

    agent_hooks: Annotated[list[str], NoDecode, BeforeValidator(hook_list)] = Field(
        default_factory=list, validation_alias="AGENT_HOOKS"
    )
    """Agent Lightning hooks run around each attempt of a LitAgent: comma-separated `module.path:attr` (class,
    instance or factory)."""
    agent_tracer: Literal["otel", "agentops", "none"] = Field(default="otel", validation_alias="AGENT_TRACER")
    """How a LitAgent's `openai` SDK calls become spans of its attempt: otel (captured per attempt), or none (only
    what the agent returns or emits through Agent Lightning's emitters, e.g. agl.emit_reward), or agentops (Agent
    Lightning's AgentOps tracer and its instrumentation, one attempt per process: prefork or solo pools only; a
    threads pool with more than one slot is refused at worker start)."""
    max_stuck_agent_threads: int = Field(default=4, ge=1, le=10000, validation_alias="MAX_STUCK_AGENT_THREADS")
    """Under -P threads an agent that blocks outside its LLM calls is abandoned at its attempt's deadline or stop
    verdict (its thread keeps running, counted as stuck, one slot fewer advertised per stuck thread); at this many
    stuck threads the worker drains (warm shutdown) and re-executes itself. Prefork needs none of it: Celery's
    hard time limit kills the child process."""


class AttemptTraceSettings(SettingsGroup):
    """Where and how the spans of each attempt a worker runs go."""

    title: ClassVar[str] = "Attempt traces"

    otlp_endpoint: HttpUrl | None = Field(default=None, validation_alias="AGENT_LIGHTNING_OTLP_ENDPOINT")
    """Where the spans of each attempt go (OTLP/HTTP protobuf). Default: the Store's own /v1/traces."""
    trace_content: bool = Field(default=False, validation_alias="TRACE_CONTENT")
    """Put prompts and completions into the LLM spans (off: they may hold user data)."""
    span_flush_interval_s: float | None = Field(default=None, gt=0, le=60, validation_alias="SPAN_FLUSH_INTERVAL_S")
    """Unset (default): an attempt's spans reach the Store in one batch before its report; while the episode runs
    they are shipped only to keep it alive (rollouts with unresponsive_seconds, every heartbeat) or when
    SPAN_BUFFER_MAX_SPANS are buffered. Set seconds to stream them (a live view of running attempts in the Store)
    at one Store request per running attempt per interval."""
    span_buffer_max_spans: int = Field(default=1000, ge=10, validation_alias="SPAN_BUFFER_MAX_SPANS")
    """Spans an attempt buffers before it ships them, whatever SPAN_FLUSH_INTERVAL_S says."""
    span_gather_max_s: float = Field(default=0.25, ge=0, le=5, validation_alias="SPAN_GATHER_MAX_S")
    """A worker process running many attempts (-P threads) lets an attempt's final span batch wait up to 1% of the
    mean episode, at most this long, for other attempts' batches to share one Store request; only when at least
    one other is expected to end meanwhile. 0: each batch goes as soon as no request is in flight."""


class WebShopSettings(SettingsGroup):
    """The WebShop server the built-in agent plays in."""

    title: ClassVar[str] = "WebShop environment"

    webshop_url: HttpUrl = Field(
        default=HttpUrl("http://localhost:3000"),
        validation_alias="WEBSHOP_URL",
    )
    """The WebShop server (`python -m webshop_env serve`)."""
    webshop_token: str | None = Field(default=None, validation_alias="WEBSHOP_TOKEN")
    """Bearer token sent to the WebShop server, if it asks for one."""
    webshop_timeout_s: float = Field(default=30.0, gt=0, validation_alias="WEBSHOP_TIMEOUT_S")
    """Seconds per WebShop request."""
    webshop_retries: int = Field(default=3, ge=0, le=20, validation_alias="WEBSHOP_RETRIES")
    """Retries of a WebShop request's transient failures, with backoff."""


class AgentLoopSettings(SettingsGroup):
    """The built-in WebShop agent's episode limits."""

    title: ClassVar[str] = "WebShop agent loop"

    max_steps: int = Field(default=15, ge=1, le=200, validation_alias="MAX_STEPS")
    """Steps per episode."""
    max_reprompts: int = Field(default=2, ge=0, le=10, validation_alias="MAX_REPROMPTS")
    """Re-prompts after an unparsable answer."""
    max_instruction_chars: int = Field(default=4000, ge=10, validation_alias="MAX_INSTRUCTION_CHARS")
    """Longest instruction accepted."""


class LLMSettings(SettingsGroup):
    """The LLM the workers' agents call when the Store's resources name none, its key, retries and rate limits."""

    title: ClassVar[str] = "LLM"

    openai_api_key: str | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    """API key of OPENAI_API_BASE, used when the Store's resources carry no `main_llm` (a trainer normally
    publishes one)."""
    openai_api_base: HttpUrl | None = Field(
        default=None, validation_alias="OPENAI_API_BASE", examples=["http://127.0.0.1:8000/v1"]
    )
    """The LLM endpoint used when the Store's resources carry no `main_llm`. Leave it unset for the demo to start
    the heuristic stand-in (`python -m webshop_env.policy`)."""
    llm_key_hosts: Annotated[list[str], NoDecode, BeforeValidator(key_host_list)] = Field(
        default_factory=list, validation_alias="LLM_KEY_HOSTS", examples=["api.openai.com,vllm.internal:8000"]
    )
    """Where OPENAI_API_KEY may go: the host (and port) of OPENAI_API_BASE, and these hosts (comma-separated host
    or host:port; a host without a port means any port). An LLM endpoint the Store's resources name elsewhere
    gets no key from the workers (a resource's own api_key is its own and is sent as is); its failed calls say
    so."""
    model: str = Field(default="gpt-4o-mini", validation_alias="WEBSHOP_MODEL")
    """Model name used with OPENAI_API_BASE."""
    llm_timeout_s: float = Field(default=120.0, gt=0, validation_alias="LLM_TIMEOUT_S")
    """Seconds per LLM request."""
    llm_retries: int = Field(default=6, ge=0, le=50, validation_alias="LLM_RETRIES")
    """Retries of an LLM request's 429, 5xx and network errors."""
    llm_max_backoff_s: float = Field(default=30.0, gt=0, validation_alias="LLM_MAX_BACKOFF_S")
    """Longest wait between LLM retries."""
    llm_return_token_ids: bool = Field(default=True, validation_alias="LLM_RETURN_TOKEN_IDS")
    """Ask vLLM for prompt/response token ids (the trainer builds its triplets from them; vLLM returns them only
    when asked). APIs that reject unknown request fields (api.openai.com) need false."""
    llm_rpm: float | None = Field(default=None, gt=0, validation_alias="LLM_RPM")
    """Cluster-wide LLM requests per minute per model, shared by every worker through Redis (unset: no limit)."""
    llm_tpm: float | None = Field(default=None, gt=0, validation_alias="LLM_TPM")
    """Cluster-wide LLM tokens per minute per model, shared like LLM_RPM (unset: no limit)."""
    llm_rate_limits: Annotated[
        dict[str, tuple[float | None, float | None]], NoDecode, BeforeValidator(rate_limit_map)
    ] = Field(default_factory=dict, validation_alias="LLM_RATE_LIMITS", examples=["gpt-4o-mini=500:200000,qwen=60"])
    """Per-model overrides of LLM_RPM and LLM_TPM as model=rpm[:tpm] pairs."""
    llm_rate_burst_s: float = Field(default=10.0, gt=0, le=60, validation_alias="LLM_RATE_BURST_S")
    """The burst the rate limits' token bucket allows, in seconds of the rate."""

    def llm_rate_limit(self, model: str) -> tuple[float | None, float | None]:
        """(requests, tokens) per minute for ``model``: its LLM_RATE_LIMITS entry, else LLM_RPM/LLM_TPM."""
        return self.llm_rate_limits.get(model, (self.llm_rpm, self.llm_tpm))


class ProgramSettings(SettingsGroup):
    """How the workers start and contain Agent Lightning 1.0 agent programs (docs/agl-v1.md, "Boxes")."""

    title: ClassVar[str] = "Agent Lightning 1.0 programs"

    agl_v1_agent_python: str | None = Field(default=None, validation_alias="AGL_V1_AGENT_PYTHON")
    """The interpreter that runs 1.0 agent programs on the workers. Default: the worker's own."""
    agl_v1_pass_env: Annotated[list[str], NoDecode, BeforeValidator(pass_env_list)] = Field(
        default_factory=list, validation_alias="AGL_V1_PASS_ENV", examples=["WEBSHOP_URL,MAX_STEPS,PYTHONPATH"]
    )
    """Variables of the worker's environment that 1.0 agent programs also get (comma-separated names; `AGL_*`
    refused). Programs otherwise get only PATH, HOME, LANG, LC_*, TZ, TMPDIR, VIRTUAL_ENV, the AGL_* variables
    of their attempt and their env_map (docs/agl-v1.md, "Trust model"): never the worker's keys or URLs."""
    agl_v1_agent_modules: Annotated[list[str], NoDecode, BeforeValidator(module_prefix_list)] = Field(
        default_factory=list, validation_alias="AGL_V1_AGENT_MODULES", examples=["myagents,workers.agents"]
    )
    """The modules 1.0 agent programs may be imported from (comma-separated module prefixes: `myagents` allows
    `myagents:A` and `myagents.sub:B`). Empty (default): any; a rollout naming another fails without starting."""
    agl_v1_warm_start: bool = Field(default=True, validation_alias="AGL_V1_WARM_START")
    """How 1.0 agent programs start. True (default): forked from the worker node's program server, an interpreter
    of AGL_V1_AGENT_PYTHON with the common modules already imported, at a fraction of the CPU; the program sees
    what a cold start gives it (docs/agl-v1.md, "Warm starts"). False: a fresh interpreter per program
    (`python -c`), as 1.0's `local` runner starts them."""
    agl_v1_preload: Annotated[list[str], NoDecode, BeforeValidator(module_prefix_list)] = Field(
        default_factory=list, validation_alias="AGL_V1_PRELOAD", examples=["numpy,tiktoken"]
    )
    """Modules the program server imports at its start beside its defaults (openai, httpx, pydantic, when
    installed): comma-separated module names. One that does not import stops the worker at start-up."""
    agl_v1_preload_agents: bool = Field(default=False, validation_alias="AGL_V1_PRELOAD_AGENTS")
    """Also import the modules of AGL_V1_AGENT_MODULES (which must be set) in the program server at its start:
    the agents' own imports are then paid once per node. Only for agent modules that read no per-rollout variable
    and start no thread at import (docs/agl-v1.md, "Warm starts")."""
    agl_v1_isolation: Literal["box", "none"] = Field(default="box", validation_alias="AGL_V1_ISOLATION")
    """How 1.0 agent programs are contained. `box` (default): each program runs as a uid of its own
    (AGL_V1_PROGRAM_UID_BASE plus its pid) with no groups, no capabilities and no_new_privs, in a private 0700
    directory that is its cwd, HOME and TMPDIR, under the AGL_V1_PROGRAM_* limits; at its end everything of its
    uid is killed and the directory removed. The worker needs CAP_SETUID and CAP_SETGID for it (root has them;
    docs/agl-v1.md, "Boxes"), else it refuses to start. `none`: programs run as the worker's uid in its cwd (the
    worker logs at start that they are not isolated)."""
    agl_v1_program_uid_base: int = Field(
        default=2_000_000_000, ge=1_000_000, le=4_000_000_000, validation_alias="AGL_V1_PROGRAM_UID_BASE"
    )
    """A boxed program runs as this uid plus its pid (a PID namespace's pids stay below 4,194,305): a range no
    user, service or container's uid map on the host may overlap."""
    agl_v1_program_pid_namespace: bool = Field(default=True, validation_alias="AGL_V1_PROGRAM_PID_NAMESPACE")
    """Where the worker holds CAP_SYS_ADMIN (root outside a container), also give each boxed program PID and mount
    namespaces of its own: it sees no other process, and is PID 1 of its namespace (signals it has no handler for
    are ignored, as for any PID 1). False: the uid alone keeps it from the others' /proc entries and signals."""
    agl_v1_program_memory_mb: int = Field(default=8192, ge=64, validation_alias="AGL_V1_PROGRAM_MEMORY_MB")
    """A boxed program's address space, in MiB (RLIMIT_AS; a program that forks has it per process): past it an
    allocation fails (Python's MemoryError) and the attempt fails, naming the limit. Address space, not memory in
    use: a program that reserves far more than it touches (CUDA, some JITs, many threads' arenas) needs more."""
    agl_v1_program_max_processes: int = Field(default=512, ge=8, validation_alias="AGL_V1_PROGRAM_MAX_PROCESSES")
    """Processes and threads a boxed program may hold at once (RLIMIT_NPROC of its own uid)."""
    agl_v1_program_max_open_files: int = Field(default=4096, ge=64, validation_alias="AGL_V1_PROGRAM_MAX_OPEN_FILES")
    """Files and sockets a boxed program's process may hold open at once (RLIMIT_NOFILE)."""
    agl_v1_program_cpu_s: int = Field(default=3600, ge=1, validation_alias="AGL_V1_PROGRAM_CPU_S")
    """CPU seconds a boxed program's process may use (RLIMIT_CPU): then SIGXCPU ends it and the attempt fails,
    naming the limit. The rollout's own timeout bounds its wall-clock time."""
    agl_v1_program_max_file_mb: int = Field(default=1024, ge=1, validation_alias="AGL_V1_PROGRAM_MAX_FILE_MB")
    """The largest file a boxed program may write, in MiB (RLIMIT_FSIZE): a write past it fails ("File too
    large")."""
    agl_v1_program_disk_mb: int = Field(default=64, ge=0, validation_alias="AGL_V1_PROGRAM_DISK_MB")
    """The space a boxed program's directory (its cwd, HOME and TMPDIR together) may hold, in MiB, with 128 files
    per MiB: a tmpfs of that size in the box's own mount namespace, so a write past it fails ("No space left on
    device") and the attempt fails, naming the limit. Its pages count against the worker's memory: size the
    worker's memory limit for it (docs/performance.md). Needs the box's PID and mount namespaces
    (AGL_V1_PROGRAM_PID_NAMESPACE); without them, or at 0, AGL_V1_PROGRAM_MAX_FILE_MB alone bounds its files."""

    @model_validator(mode="after")
    def _check_preload_agents(self) -> ProgramSettings:
        if self.agl_v1_preload_agents and not self.agl_v1_agent_modules:
            raise ValueError(
                "AGL_V1_PRELOAD_AGENTS needs AGL_V1_AGENT_MODULES: only modules the operator allows agents to come "
                "from are imported into the program server, which every later program of the node is forked from"
            )
        return self


GROUPS: tuple[type[SettingsGroup], ...] = (
    StoreSettings,
    GatewaySettings,
    BrokerSettings,
    TelemetrySettings,
    AgentSettings,
    DispatchSettings,
    WorkerNodeSettings,
    LitAgentSettings,
    AttemptTraceSettings,
    WebShopSettings,
    AgentLoopSettings,
    LLMSettings,
    ProgramSettings,
)
"""Every group, in the order of docs/configuration.md."""
