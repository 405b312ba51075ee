"""How long an attempt may run, derived from the settings: its Celery time limits and the longest budget the broker
covers. The one policy of both lines, on both sides: the dispatcher publishes a clamped budget (and the task's
limits with it), and the worker clamps the budget it reads again (a 0.3 takeover's Store read, the gateway's copy
a 1.0 attempt runs), so an agent's deadline never outlasts its task's limits or the broker's redelivery
(docs/architecture.md, "Guarantees").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from bridge.core.settings import BrokerSettings


def _budget(settings: BrokerSettings, timeout_s: float | None) -> float:
    """``timeout_s``, or ``ROLLOUT_DEFAULT_TIMEOUT_S`` when it is unset or not positive."""
    return timeout_s if timeout_s and timeout_s > 0 else settings.default_timeout_s


def soft_time_limit(settings: BrokerSettings, timeout_s: float | None) -> float:
    """A 0.3 task's soft limit: a little before the Store's own deadline, so its report still counts."""
    return max(1.0, _budget(settings, timeout_s) * 0.9 - 5.0)


def hard_time_limit(settings: BrokerSettings, timeout_s: float | None) -> float:
    """A 0.3 task's hard limit."""
    return max(2.0, _budget(settings, timeout_s) * 0.95)


def longest_hard_limit_s(settings: BrokerSettings) -> float:
    """The longest hard time limit the broker covers: with the longest queue wait it stays under the broker's
    visibility (Redis) or consumer (RabbitMQ) timeout, with 1 s to spare. A task that may run longer is
    redelivered while it runs."""
    return settings.redelivery_timeout_s - settings.max_queue_wait_s - 1.0


def longest_timeout_s(settings: BrokerSettings) -> float:
    """The largest 0.3 ``timeout_seconds`` whose hard limit the broker covers (``longest_hard_limit_s``)."""
    share = hard_time_limit(settings, 1e6) / 1e6
    return longest_hard_limit_s(settings) / share


def v1_time_limits(settings: BrokerSettings, timeout_s: float) -> tuple[float, float]:
    """(soft, hard) Celery limits of a 1.0 attempt: above the worker's own deadline, since the worker kills the
    agent program at ``timeout_s`` and then reports."""
    return timeout_s + settings.lease_ttl_s + 30.0, timeout_s + settings.lease_ttl_s + 60.0


def v1_longest_timeout_s(settings: BrokerSettings) -> float:
    """The largest 1.0 ``timeout_seconds`` whose hard limit (``v1_time_limits``) the broker covers."""
    return max(1.0, longest_hard_limit_s(settings) - v1_time_limits(settings, 0.0)[1])


@overload
def clamp_to_broker(settings: BrokerSettings, timeout_s: float, *, agl_v1: bool = False) -> float: ...


@overload
def clamp_to_broker(settings: BrokerSettings, timeout_s: None, *, agl_v1: bool = False) -> None: ...


def clamp_to_broker(settings: BrokerSettings, timeout_s: float | None, *, agl_v1: bool = False) -> float | None:
    """``timeout_s`` lowered to the longest budget the broker covers: ``longest_timeout_s`` for a 0.3 rollout,
    ``v1_longest_timeout_s`` in whole seconds for a 1.0 one (``agl_v1``); None or <= 0 (the default applies)
    unchanged."""
    if not timeout_s or timeout_s <= 0:
        return timeout_s
    longest = float(int(v1_longest_timeout_s(settings))) if agl_v1 else longest_timeout_s(settings)
    return min(timeout_s, longest)
