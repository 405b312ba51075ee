"""The settings each process reads: a class per process composed of the groups it uses
(``bridge.core.settings.groups``), so a process validates those groups only and starts whatever another
process's settings say. ``Settings`` holds every group, for the tools that show everything (``python -m bridge
status``, the lab, the configuration reference). Loading raises ``ConfigError`` with one readable line naming
each bad variable, which entry points turn into exit code 2.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypeVar, overload

from pydantic import ValidationError

from bridge.core.infra import ConfigError, MissingSetting
from bridge.core.settings.groups import (
    AgentLoopSettings,
    AgentSettings,
    AttemptTraceSettings,
    BrokerSettings,
    DispatchSettings,
    GatewaySettings,
    LitAgentSettings,
    LLMSettings,
    ProgramSettings,
    SettingsGroup,
    StoreSettings,
    TelemetrySettings,
    WebShopSettings,
    WorkerNodeSettings,
)
from bridge.core.store import TRACES

S = TypeVar("S", bound=SettingsGroup)


class SharedSettings(StoreSettings, GatewaySettings, BrokerSettings, TelemetrySettings, AgentSettings):
    """The groups every process reads: the Store and the gateway (whose URLs scope the deployment's Redis keys),
    the broker and the coordination Redis, logging and metrics, the agent the messages name."""


class DispatcherSettings(SharedSettings, DispatchSettings):
    """What a dispatcher reads: the 0.3 bridge (``python -m bridge``), the 1.0 dispatcher (``python -m bridge v1``)
    and ``CeleryRunner``."""


class WorkerSettings(
    SharedSettings,
    WorkerNodeSettings,
    LitAgentSettings,
    AttemptTraceSettings,
    WebShopSettings,
    AgentLoopSettings,
    LLMSettings,
    ProgramSettings,
):
    """What a worker node reads (``celery -A workers worker``, its health probe)."""

    @property
    def traces_endpoint(self) -> str:
        """Where an attempt's spans go: AGENT_LIGHTNING_OTLP_ENDPOINT, else the Store's own /v1/traces."""
        if self.otlp_endpoint is not None:
            return str(self.otlp_endpoint)
        return self.store_base + TRACES


class WebShopProgramSettings(WebShopSettings, AgentLoopSettings):
    """What the built-in 1.0 WebShop agent program reads (``workers.agents.webshop_program``, its ``PASS_ENV``): a bad
    value elsewhere does not stop it. Built here, with the rest, so that a program forked warm from the node's program
    server finds it built instead of building it anew in every program."""


class Settings(DispatcherSettings, WorkerSettings):
    """Every group: for what shows or starts everything (``python -m bridge status``, the lab, the docs)."""


PROCESSES: dict[str, type[SharedSettings]] = {
    "the dispatchers": DispatcherSettings,
    "the workers": WorkerSettings,
}
"""Who reads which groups, as the configuration reference names them."""


def env_name(field: str) -> str:
    """The environment variable that sets the field named ``field``."""
    return str(Settings.model_fields[field].validation_alias)


@overload
def load_settings(**overrides: Any) -> Settings: ...
@overload
def load_settings(settings_class: type[S], /, **overrides: Any) -> S: ...


def load_settings(settings_class: type[SettingsGroup] = Settings, /, **overrides: Any) -> SettingsGroup:
    """The settings of ``settings_class`` (every group by default) from the environment, ``.env`` and
    ``overrides`` (by field or variable name); a variable of a group the class lacks is not read.

    Raises MissingSetting when a required variable is unset, else ConfigError, with one readable line per problem;
    an override that names no setting of ``settings_class`` is a ConfigError too (never silently dropped).
    """
    _check_overrides(settings_class, overrides)
    try:
        return settings_class(**overrides)
    except ValidationError as error:
        raise _config_error(error) from None


@lru_cache(maxsize=1)
def get_settings() -> WorkerSettings:
    """The worker process's settings, read once; the shared code a worker runs reads them here (a dispatcher is
    given its own)."""
    return load_settings(WorkerSettings)


def _check_overrides(settings_class: type[SettingsGroup], overrides: dict[str, Any]) -> None:
    """Each override must name a field (or its variable) of ``settings_class``; one of another process's groups is
    named with the processes that read it."""
    known = set(settings_class.model_fields) | _variables(settings_class)
    for key in overrides:
        if key in known:
            continue
        field = Settings.model_fields.get(key) or next(
            (f for f in Settings.model_fields.values() if f.validation_alias == key), None
        )
        if field is None:
            raise ConfigError(f"{key}: no such setting", setting=str(key))
        variable = str(field.validation_alias)
        readers = [who for who, cls in PROCESSES.items() if variable in _variables(cls)]
        raise ConfigError(
            f"{variable}: read by {' and '.join(readers) or 'another process'}, not here; set it where that runs",
            setting=variable,
        )


def _variables(settings_class: type[SettingsGroup]) -> set[str]:
    return {str(field.validation_alias) for field in settings_class.model_fields.values()}


def _config_error(error: ValidationError) -> ConfigError:
    """``error`` as a ConfigError naming each bad variable the way the user sets it (a MissingSetting when a
    required one is unset); ``setting`` is the first variable named."""
    problems: list[tuple[str, str]] = []
    missing: str | None = None
    for item in error.errors():
        loc = item.get("loc") or ()
        name = _variable(str(loc[0])) if loc else "SETTINGS"
        message = item.get("msg", "invalid value")
        if item.get("type") == "missing":
            message = "is required but not set"
            missing = missing or name
        problems.append((name, message))
    text = "invalid configuration: " + "; ".join(f"{name}: {message}" for name, message in problems)
    if missing is not None:
        return MissingSetting(text, setting=missing)
    named = [name for name, _ in problems if name != "SETTINGS"]
    return ConfigError(text, setting=named[0] if named else None)


def _variable(key: str) -> str:
    """The variable behind an error's location: a field's variable, or the key itself (upper-cased)."""
    return env_name(key) if key in Settings.model_fields else key.upper()
