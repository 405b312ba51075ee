"""The one settings object shared by the bridge and the workers.

Variable names follow Agent Lightning's reference runner (``AGENT_LIGHTNING_STORE_URL``,
``WEBSHOP_URL``, ``OPENAI_API_BASE``, ...) so a user can switch executors without touching their
environment. Everything is validated when a process starts: a bad value stops it with one readable
line naming the variable (exit code 2), never with a traceback in the middle of a run.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, HttpUrl, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bridge.core import settings_parse as parse
from bridge.core.redact import redact_url
from bridge.core.store import TRACES

EXIT_CONFIG_ERROR = 2


class ConfigError(SystemExit):
    """Raised for invalid configuration; exits with code 2 and a readable message."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_CONFIG_ERROR)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Settings(BaseSettings):
    """Every knob of the bridge and the workers; see ``.env.example`` for documentation."""

    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore", populate_by_name=True)

    # --- Agent Lightning Store -------------------------------------------------------------
    store_url: HttpUrl = Field(validation_alias=AliasChoices("AGENT_LIGHTNING_STORE_URL", "store_url"))
    store_token: str | None = Field(
        default=None, validation_alias=AliasChoices("AGENT_LIGHTNING_STORE_TOKEN", "store_token")
    )
    store_timeout_s: float = Field(
        default=30.0, gt=0, validation_alias=AliasChoices("STORE_TIMEOUT_S", "store_timeout_s")
    )
    store_retries: int = Field(default=5, ge=0, le=50, validation_alias=AliasChoices("STORE_RETRIES", "store_retries"))

    # --- Tracing -----------------------------------------------------------------------------
    otlp_endpoint: HttpUrl | None = Field(
        default=None,
        validation_alias=AliasChoices("AGENT_LIGHTNING_OTLP_ENDPOINT", "otlp_endpoint"),
    )
    service_name: str = Field(
        default="agl-celery-bridge",
        validation_alias=AliasChoices("AGENT_LIGHTNING_SERVICE_NAME", "service_name"),
    )
    trace_content: bool = Field(default=False, validation_alias=AliasChoices("TRACE_CONTENT", "trace_content"))
    span_flush_interval_s: float | None = Field(
        default=None, gt=0, le=60, validation_alias=AliasChoices("SPAN_FLUSH_INTERVAL_S", "span_flush_interval_s")
    )
    span_buffer_max_spans: int = Field(
        default=1000, ge=10, validation_alias=AliasChoices("SPAN_BUFFER_MAX_SPANS", "span_buffer_max_spans")
    )
    span_gather_max_s: float = Field(  # workers.trace_courier
        default=0.25, ge=0, le=5, validation_alias=AliasChoices("SPAN_GATHER_MAX_S", "span_gather_max_s")
    )

    # --- WebShop environment -------------------------------------------------------------------
    webshop_url: HttpUrl = Field(
        default=HttpUrl("http://localhost:3000"),
        validation_alias=AliasChoices("WEBSHOP_URL", "webshop_url"),
    )
    webshop_token: str | None = Field(default=None, validation_alias=AliasChoices("WEBSHOP_TOKEN", "webshop_token"))
    webshop_timeout_s: float = Field(
        default=30.0, gt=0, validation_alias=AliasChoices("WEBSHOP_TIMEOUT_S", "webshop_timeout_s")
    )
    webshop_retries: int = Field(
        default=3, ge=0, le=20, validation_alias=AliasChoices("WEBSHOP_RETRIES", "webshop_retries")
    )

    # --- LLM -------------------------------------------------------------------------------------
    openai_api_key: str | None = Field(default=None, validation_alias=AliasChoices("OPENAI_API_KEY", "openai_api_key"))
    openai_api_base: HttpUrl | None = Field(
        default=None, validation_alias=AliasChoices("OPENAI_API_BASE", "openai_api_base")
    )
    llm_key_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        validation_alias=AliasChoices("LLM_KEY_HOSTS", "llm_key_hosts"),
        description="hosts (host or host:port) besides OPENAI_API_BASE's that may get OPENAI_API_KEY",
    )
    model: str = Field(default="gpt-4o-mini", validation_alias=AliasChoices("WEBSHOP_MODEL", "model"))
    llm_timeout_s: float = Field(default=120.0, gt=0, validation_alias=AliasChoices("LLM_TIMEOUT_S", "llm_timeout_s"))
    llm_retries: int = Field(default=6, ge=0, le=50, validation_alias=AliasChoices("LLM_RETRIES", "llm_retries"))
    llm_max_backoff_s: float = Field(
        default=30.0, gt=0, validation_alias=AliasChoices("LLM_MAX_BACKOFF_S", "llm_max_backoff_s")
    )
    # vLLM returns token ids only when asked; the trainer's adapters need them. APIs that reject unknown
    # request fields (api.openai.com) need LLM_RETURN_TOKEN_IDS=false.
    llm_return_token_ids: bool = Field(
        default=True, validation_alias=AliasChoices("LLM_RETURN_TOKEN_IDS", "llm_return_token_ids")
    )

    # Global LLM rate limit (a token bucket in Redis shared by every worker; workers.ratelimit). Unset = off.
    llm_rpm: float | None = Field(default=None, gt=0, validation_alias=AliasChoices("LLM_RPM", "llm_rpm"))
    llm_tpm: float | None = Field(default=None, gt=0, validation_alias=AliasChoices("LLM_TPM", "llm_tpm"))
    llm_rate_limits: Annotated[dict[str, tuple[float | None, float | None]], NoDecode] = Field(
        default_factory=dict,
        validation_alias=AliasChoices("LLM_RATE_LIMITS", "llm_rate_limits"),
        description="per-model overrides, model=rpm[:tpm] pairs, e.g. 'gpt-4o-mini=500:200000,qwen=60'",
    )
    llm_rate_burst_s: float = Field(
        default=10.0, gt=0, le=60, validation_alias=AliasChoices("LLM_RATE_BURST_S", "llm_rate_burst_s")
    )

    # --- Agent loop ------------------------------------------------------------------------------
    max_steps: int = Field(default=15, ge=1, le=200, validation_alias=AliasChoices("MAX_STEPS", "max_steps"))
    max_reprompts: int = Field(default=2, ge=0, le=10, validation_alias=AliasChoices("MAX_REPROMPTS", "max_reprompts"))
    max_instruction_chars: int = Field(
        default=4000, ge=10, validation_alias=AliasChoices("MAX_INSTRUCTION_CHARS", "max_instruction_chars")
    )

    # --- Agent ----------------------------------------------------------------------------------
    agent: str = Field(
        default="webshop",
        validation_alias=AliasChoices("AGENT", "agent"),
        description="'webshop' (built in) or 'module.path:attr' naming a LitAgent class, instance or factory",
    )
    agent_hooks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        validation_alias=AliasChoices("AGENT_HOOKS", "agent_hooks"),
        description="comma-separated 'module:attr' Agent Lightning hooks (class, instance or factory)",
    )
    agent_tracer: Literal["otel", "agentops", "none"] = Field(
        default="otel", validation_alias=AliasChoices("AGENT_TRACER", "agent_tracer")
    )

    # --- Celery ----------------------------------------------------------------------------------
    broker_url: str = Field(
        default="redis://localhost:6379/0",
        validation_alias=AliasChoices("CELERY_BROKER_URL", "broker_url"),
        description="Redis (redis://, rediss://, redis+socket://) or RabbitMQ (amqp://, amqps://, pyamqp://)",
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "redis_url"),
        description="coordination Redis (leases, slots, rate limits, leader lock); default: a Redis broker's URL",
    )
    consumer_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        validation_alias=AliasChoices("BROKER_CONSUMER_TIMEOUT_S", "consumer_timeout_s"),
        description="RabbitMQ only: the server's consumer_timeout (rabbitmq.conf) or its queues' consumer-timeout",
    )
    queue_type: Literal["classic", "quorum"] = Field(
        default="classic",
        validation_alias=AliasChoices("QUEUE_TYPE", "queue_type"),
        description="RabbitMQ only: durable classic or quorum (replicated) queues",
    )
    redis_key_scope: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        validation_alias=AliasChoices("REDIS_KEY_SCOPE", "redis_key_scope"),
        description="this deployment's Redis key scope; default: a digest of AGENT_LIGHTNING_STORE_URL",
    )
    broker_tls_insecure: bool = Field(
        default=False,
        validation_alias=AliasChoices("BROKER_TLS_INSECURE", "broker_tls_insecure"),
        description="rediss:// and amqps:// (broker and REDIS_URL) without certificate checks; warned at start",
    )
    default_queue: str = Field(
        default="rollouts", validation_alias=AliasChoices("CELERY_DEFAULT_QUEUE", "default_queue")
    )
    queue_by_mode: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        validation_alias=AliasChoices("QUEUE_BY_MODE", "queue_by_mode"),
        description="mode=queue pairs, e.g. 'train=rollouts-train,val=rollouts-eval'",
    )
    default_timeout_s: float = Field(
        default=900.0, gt=0, validation_alias=AliasChoices("ROLLOUT_DEFAULT_TIMEOUT_S", "default_timeout_s")
    )
    visibility_timeout_s: float = Field(
        default=7200.0, gt=0, validation_alias=AliasChoices("BROKER_VISIBILITY_TIMEOUT_S", "visibility_timeout_s")
    )
    heartbeat_interval_s: float = Field(
        default=10.0, gt=0, le=300, validation_alias=AliasChoices("HEARTBEAT_INTERVAL_S", "heartbeat_interval_s")
    )
    lease_ttl_s: float = Field(default=30.0, gt=0, validation_alias=AliasChoices("LEASE_TTL_S", "lease_ttl_s"))
    done_marker_ttl_s: int = Field(  # workers.reporting: a redelivery of a reported attempt is not run again
        default=7 * 24 * 3600, gt=0, validation_alias=AliasChoices("DONE_MARKER_TTL_S", "done_marker_ttl_s")
    )
    # How old a worker's view of its rollout may be when it starts or reports (docs/store-protocol.md 10): the
    # dequeue answer is a fresh view and every heartbeat renews it, so a short episode reads nothing extra.
    # A read is always made after a takeover and when the Store's watchdog could have acted; 0: always.
    fence_max_age_s: float = Field(
        default=10.0, ge=0, le=300, validation_alias=AliasChoices("FENCE_MAX_AGE_S", "fence_max_age_s")
    )
    fence_board: bool = Field(default=True, validation_alias=AliasChoices("FENCE_BOARD", "fence_board"))
    # Largest difference between a worker's clock and the Store's that a worker starts with (measured at start
    # from the Store's Date header, then corrected for in every comparison of the Store's timestamps); 0: no check.
    clock_skew_tolerance_s: float = Field(
        default=5.0, ge=0, validation_alias=AliasChoices("CLOCK_SKEW_TOLERANCE_S", "clock_skew_tolerance_s")
    )

    # --- Bridge ----------------------------------------------------------------------------------
    dispatcher_id: str = Field(
        default="celery-bridge", validation_alias=AliasChoices("BRIDGE_DISPATCHER_ID", "dispatcher_id")
    )
    # Poll interval while slots are free: after a dequeue that found work the bridge polls again after
    # poll_min_s; every empty dequeue doubles the wait, with jitter, up to poll_max_s. The Store cannot
    # notify, so poll_max_s bounds how long a rollout enqueued into an empty queue waits (a trainer's first
    # rollout of every batch): 0.2 s keeps dispatch p99 under 250 ms for 5-10 empty dequeues a second, about
    # 2-4% of a Store's capacity. Raise it for a Store shared with other work. Once the slots were all busy,
    # empty polls back off up to the coalescing wait (2% of the episode time), where that is longer.
    poll_min_s: float = Field(default=0.1, gt=0, validation_alias=AliasChoices("BRIDGE_POLL_MIN_S", "poll_min_s"))
    poll_max_s: float = Field(default=0.2, gt=0, validation_alias=AliasChoices("BRIDGE_POLL_MAX_S", "poll_max_s"))
    max_batch: int = Field(default=64, ge=1, le=10000, validation_alias=AliasChoices("BRIDGE_MAX_BATCH", "max_batch"))
    coalesce_max_s: float = Field(  # bridge.dispatch.coalesce
        default=1.5, ge=0, le=5, validation_alias=AliasChoices("BRIDGE_COALESCE_MAX_S", "coalesce_max_s")
    )
    max_queue_wait_s: float = Field(
        default=300.0, gt=0, validation_alias=AliasChoices("BRIDGE_MAX_QUEUE_WAIT_S", "max_queue_wait_s")
    )
    max_stuck_agent_threads: int = Field(  # workers.stuck
        default=4, ge=1, le=10000, validation_alias=AliasChoices("MAX_STUCK_AGENT_THREADS", "max_stuck_agent_threads")
    )
    max_held: int = Field(  # bridge.dispatch.hold
        default=32, ge=1, le=10000, validation_alias=AliasChoices("BRIDGE_MAX_HELD", "max_held")
    )
    reconcile_interval_s: float = Field(  # with the lease, bounds a lost host's recovery (docs/cluster.md)
        default=20.0, gt=0, validation_alias=AliasChoices("BRIDGE_RECONCILE_INTERVAL_S", "reconcile_interval_s")
    )
    publish_retries: int = Field(
        default=5, ge=0, le=50, validation_alias=AliasChoices("BRIDGE_PUBLISH_RETRIES", "publish_retries")
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, validation_alias=AliasChoices("BRIDGE_METRICS_PORT", "metrics_port")
    )
    worker_metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        validation_alias=AliasChoices("WORKER_METRICS_PORT", "worker_metrics_port"),
        description="each worker node serves Prometheus metrics here (off when unset)",
    )
    task_events: bool = Field(
        default=True,
        validation_alias=AliasChoices("CELERY_TASK_EVENTS", "task_events"),
        description="Celery task events (Flower's task list); off saves ~4 Redis publishes per rollout",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        validation_alias=AliasChoices("METRICS_HOST", "metrics_host"),
        description="interface the bridge and worker metrics servers bind (0.0.0.0 in containers)",
    )

    # --- Logging ---------------------------------------------------------------------------------
    log_level: str = Field(default="INFO", validation_alias=AliasChoices("LOG_LEVEL", "log_level"))
    log_json: bool = Field(default=False, validation_alias=AliasChoices("LOG_JSON", "log_json"))

    @field_validator("queue_by_mode", mode="before")
    @classmethod
    def _parse_queue_map(cls, value: Any) -> Any:
        return parse.parse_queue_map(value)

    @field_validator("agent")
    @classmethod
    def _check_agent(cls, value: str) -> str:
        value = value.strip()
        if value != "webshop" and not parse.is_import_path(value):
            raise ValueError(f"expected 'webshop' or 'module.path:attr', got {value!r}")
        return value

    @field_validator("agent_hooks", mode="before")
    @classmethod
    def _parse_hooks(cls, value: Any) -> Any:
        return parse.parse_hooks(value)

    @field_validator("llm_key_hosts", mode="before")
    @classmethod
    def _parse_key_hosts(cls, value: Any) -> Any:
        return parse.parse_key_hosts(value)

    @field_validator("llm_rate_limits", mode="before")
    @classmethod
    def _parse_rate_limits(cls, value: Any) -> Any:
        return parse.parse_rate_limits(value)

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return level

    @field_validator("broker_url")
    @classmethod
    def _check_broker(cls, value: str) -> str:
        return parse.check_broker_url(value)

    @field_validator("redis_url")
    @classmethod
    def _check_redis(cls, value: str | None) -> str | None:
        return parse.check_redis_url(value)

    @model_validator(mode="after")
    def _check_tls(self) -> Settings:
        """A URL that turns certificate checks off is refused unless BROKER_TLS_INSECURE says so."""
        if not self.broker_tls_insecure:
            for name, url in (("CELERY_BROKER_URL", self.broker_url), ("REDIS_URL", self.redis_url)):
                parse.check_tls_verified(name, url)
        return self

    @model_validator(mode="after")
    def _check_timeouts(self) -> Settings:
        """Refuse configurations under which the broker could redeliver work that is still running."""
        if self.poll_min_s > self.poll_max_s:
            raise ValueError("BRIDGE_POLL_MIN_S must not exceed BRIDGE_POLL_MAX_S")
        if self.broker_is_amqp and not self.redis_url:
            raise ValueError(
                "REDIS_URL must be set with a RabbitMQ broker: leases, slots, rate limits and the leader lock "
                "live in Redis (e.g. REDIS_URL=redis://localhost:6379/0)"
            )
        longest = self.hard_time_limit(self.default_timeout_s) + self.max_queue_wait_s
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

    # --- derived values ------------------------------------------------------------------------

    @property
    def broker_is_amqp(self) -> bool:
        return parse.is_amqp_url(self.broker_url)

    @property
    def coordination_url(self) -> str:
        """The Redis that holds leases, slots, rate limits and the leader lock (``bridge.core.coordination``)."""
        return self.redis_url or self.broker_url

    @property
    def redelivery_timeout_s(self) -> float:
        """How long the broker lets a message stay unacknowledged before another worker may get it."""
        return self.consumer_timeout_s if self.broker_is_amqp else self.visibility_timeout_s

    @property
    def store_base(self) -> str:
        return str(self.store_url).rstrip("/")

    @property
    def traces_endpoint(self) -> str:
        if self.otlp_endpoint is not None:
            return str(self.otlp_endpoint)
        return self.store_base + TRACES

    def queue_for_mode(self, mode: str | None) -> str:
        return self.queue_by_mode.get(mode or "", self.default_queue)

    def all_queues(self) -> list[str]:
        return sorted({self.default_queue, *self.queue_by_mode.values()})

    def soft_time_limit(self, timeout_s: float | None) -> float:
        """Stop an episode a little before the Store's own deadline so its report still counts."""
        budget = timeout_s if timeout_s and timeout_s > 0 else self.default_timeout_s
        return max(1.0, budget * 0.9 - 5.0)

    def hard_time_limit(self, timeout_s: float | None) -> float:
        budget = timeout_s if timeout_s and timeout_s > 0 else self.default_timeout_s
        return max(2.0, budget * 0.95)

    def longest_timeout_s(self) -> float:
        """The largest ``timeout_seconds`` whose hard limit plus the longest queue wait stays under the
        broker's visibility (Redis) or consumer (RabbitMQ) timeout, with 1 s to spare: a longer one would be
        redelivered while it runs, so the bridge publishes it clamped to this and a takeover clamps it too."""
        share = self.hard_time_limit(1e6) / 1e6
        return (self.redelivery_timeout_s - self.max_queue_wait_s - 1.0) / share

    def covered_timeout(self, timeout_s: float | None) -> float | None:
        """``timeout_s`` lowered to ``longest_timeout_s``; None or <= 0 (the default applies) unchanged."""
        if not timeout_s or timeout_s <= 0:
            return timeout_s
        return min(timeout_s, self.longest_timeout_s())

    def llm_rate_limit(self, model: str) -> tuple[float | None, float | None]:
        """(requests, tokens) per minute for ``model``: its LLM_RATE_LIMITS entry, else LLM_RPM/LLM_TPM."""
        return self.llm_rate_limits.get(model, (self.llm_rpm, self.llm_tpm))

    def redacted(self) -> dict[str, Any]:
        """The settings as they may be logged: secrets removed, URLs stripped of passwords."""
        shown: dict[str, Any] = {}
        for name, value in self.model_dump().items():
            if name in {"openai_api_key", "store_token", "webshop_token"}:
                shown[name] = "***" if value else None
            elif isinstance(value, str) or name.endswith(("_url", "_base", "endpoint")):
                shown[name] = redact_url(str(value)) if value is not None else None
            else:
                shown[name] = value
        return shown


def format_validation_error(error: ValidationError) -> str:
    """One line per bad variable, named the way the user sets it."""
    return parse.describe_errors(error, Settings.model_fields)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings or raise ConfigError with a message a user can act on."""
    try:
        return Settings(**overrides)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once."""
    return load_settings()
