"""The task message both processes agree on: its name, its keyword arguments and the Celery settings
that must match on the publishing and the executing side.

The bridge publishes by name through an app built here, so it never imports the worker stack (agent,
LLM client, telemetry). The worker's app (``workers.app``) starts from the same base and adds what
only an executor needs (acks_late, prefetch, time limits, events).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import Celery

from bridge.core.infra import tls
from bridge.core.patches import kombu_redis_client
from bridge.core.store import AttemptedRollout

if TYPE_CHECKING:
    from bridge.core.settings import SharedSettings

TASK_NAME = "workers.run_rollout"
"""The one task: one message = one Store attempt, and the task id is the attempt id."""


DEFAULT_AGENT = "webshop"
"""The built-in agent: the one a message without an ``agent`` expects."""


def task_kwargs(rollout: AttemptedRollout, queue: str, agent: str = DEFAULT_AGENT) -> dict[str, Any]:
    """The message body: the rollout as the Store returned it (no secret in it), the queue it was
    routed to, so the worker frees the right slot, and the agent the sender expects to run it.

    ``agent`` is only compared with what the worker was configured to run (its ``AGENT`` string or the
    resolved class path ``module:QualName``); a worker never imports anything a message names.
    """
    return {"rollout": rollout.model_dump(mode="json"), "queue": queue, "agent": agent}


def base_app(settings: SharedSettings, main: str, include: tuple[str, ...] = ()) -> Celery:
    """A Celery app with the broker settings both sides must share (broker, serializer, redelivery, queue type)."""
    app = Celery(main, broker=settings.broker_url, include=list(include))
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        # Celery keeps a backend that is not thread-safe per thread, and building one (even the disabled
        # backend) scans every installed package's entry points: ~15 ms of CPU for each of a ``-P threads``
        # worker's threads. The disabled backend keeps no state, so one is shared (built below).
        result_backend_thread_safe=True,
        task_default_queue=settings.default_queue,
        task_create_missing_queues=True,
        broker_transport_options=broker_transport_options(settings),
        broker_connection_retry_on_startup=True,
        task_default_delivery_mode="persistent",  # a broker restart keeps queued messages (durable queues)
        broker_pool_limit=64,
        # No task-sent events from the bridge: each would be a second broker publish per rollout, a large share
        # of the bridge's CPU; Flower lists a task from the worker's own events once it is received.
        task_send_sent_event=False,
    )
    if settings.broker_url.startswith(("redis://", "rediss://")):
        app.conf.update(broker_transport=kombu_redis_client.TRANSPORT)  # one Redis client per channel, not per call
    use_ssl = tls.broker_use_ssl(settings)
    if use_ssl is not None:  # rediss:// / amqps://: certificates checked unless BROKER_TLS_INSECURE (warned here)
        app.conf.update(broker_use_ssl=use_ssl)
        tls.warn_if_insecure(settings)
    if settings.broker_is_amqp:
        # Quorum queues are replicated and durable; Celery then drops global QoS (RabbitMQ refuses it on them),
        # so a countdown retry holds a slot until it fires (docs/operations.md, RabbitMQ as broker).
        app.conf.update(task_default_queue_type=settings.queue_type, task_create_missing_queue_type=settings.queue_type)
    _ = app.backend  # now, once: the first wave of task threads would otherwise race to build it each
    return app


def broker_transport_options(settings: SharedSettings) -> dict[str, Any]:
    """What each broker needs so a message is neither lost nor handed to a second worker while it runs.

    Redis: the visibility timeout (checked against the hard time limit in settings). RabbitMQ: publisher
    confirms, so ``apply_async`` returns only once the broker has the (persistent) message; its redelivery
    rule is the server's consumer timeout, checked in settings as ``BROKER_CONSUMER_TIMEOUT_S``.
    """
    if settings.broker_is_amqp:
        return {"confirm_publish": True}
    return {"visibility_timeout": int(settings.visibility_timeout_s)}


def publishing_app(settings: SharedSettings) -> tuple[Celery, Any]:
    """The bridge's app and a stand-in for the task, registered under its name.

    OpenTelemetry's Celery instrumentation closes a publish span only for a task it finds in the current
    app's registry; a name-only ``send_task`` would leave every publish span open. The stand-in is never
    executed here: workers run the real task of the same name.
    """
    app = base_app(settings, "bridge")

    @app.task(name=TASK_NAME)
    def run_rollout(  # pragma: no cover - never runs
        rollout: dict[str, Any], queue: str | None = None, agent: str | None = None
    ) -> None:
        raise RuntimeError(f"{TASK_NAME} runs on the workers (celery -A workers worker), not in the bridge")

    return app, app.tasks[TASK_NAME]


def agent_identity(agent: object) -> str:
    """How a message names a LitAgent, computed the same way by ``CeleryRunner`` and by the workers.

    ``module:QualName`` of the agent's class; for an ``@agentlightning.rollout`` function, whose class is
    Agent Lightning's wrapper shared by every decorated function, the wrapped function's own
    ``module:qualname`` (read duck-typed, so this module needs no agentlightning).
    """
    wrapped = getattr(agent, "_rollout_func", None)
    named = wrapped if callable(wrapped) and hasattr(wrapped, "__qualname__") else type(agent)
    return f"{named.__module__}:{named.__qualname__}"
