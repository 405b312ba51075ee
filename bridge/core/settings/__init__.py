"""The settings of the bridge, the dispatchers and the workers: one validated group per concern
(``groups``), a class per process composed of the groups it reads (``processes``), the parsers of their values
(``values``). Everything is validated when a process starts, the groups it reads only: a bad value raises
``ConfigError`` with one readable line naming the variable, which entry points turn into exit code 2.
"""

from bridge.core.settings.groups import (
    GROUPS,
    SET_IN_EXAMPLE,
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
from bridge.core.settings.processes import (
    PROCESSES,
    DispatcherSettings,
    Settings,
    SharedSettings,
    WebShopProgramSettings,
    WorkerSettings,
    env_name,
    get_settings,
    load_settings,
)
from bridge.core.settings.values import is_amqp_url, is_redis_url, split_host_port

__all__ = [
    "GROUPS",
    "PROCESSES",
    "SET_IN_EXAMPLE",
    "AgentLoopSettings",
    "AgentSettings",
    "AttemptTraceSettings",
    "BrokerSettings",
    "DispatchSettings",
    "DispatcherSettings",
    "GatewaySettings",
    "LLMSettings",
    "LitAgentSettings",
    "ProgramSettings",
    "Settings",
    "SettingsGroup",
    "SharedSettings",
    "StoreSettings",
    "TelemetrySettings",
    "WebShopProgramSettings",
    "WebShopSettings",
    "WorkerNodeSettings",
    "WorkerSettings",
    "env_name",
    "get_settings",
    "is_amqp_url",
    "is_redis_url",
    "load_settings",
    "split_host_port",
]
