"""What each docker-compose.yml service gets of the operator's .env: only the variables its command reads.

No service takes the whole .env (``env_file``); each names its variables in ``environment:``, passed through
from .env (a name without a value: unset in the container when .env leaves it unset) or set by compose. What a
service of ours reads is read from the source by ``tests/settings_readers.py`` (nothing is imported): the
settings its code reads, ``settings.<field>`` in the modules its command imports, derived values expanded to
their fields, and the fields the settings' cross-checks read, which a process checks together at start. A
service gets all of them but those ``NOT_READ`` names with the reason, and nothing else of the settings. The
secrets (keys, tokens, passwords, URLs that may hold one) reach exactly the services of ``SECRETS``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.core.settings import Settings, env_name
from tests.compose import load, read_env_file
from tests.settings_readers import (
    AGENT_03,
    CHECKED_TOGETHER,
    ENTRIES,
    STORE_CLIENT,
    V1_WORKER,
    fields_of,
    settings_read,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROFILES = ("standin", "monitoring", "rabbitmq", "agl-v1", "agl-v1-gateway")

NOT_READ: dict[str, dict[str, str]] = {  # service -> variable its modules read but its command does not need: why
    "bridge": {
        "AGL_V1_SERVER_URL": "names the Redis key scope only without a Store URL, which compose always sets",
        "BRIDGE_METRICS_PORT": "its command gives --metrics-port",
        **dict.fromkeys(V1_WORKER, "the 1.0 workers' settings"),
    },
    "dispatcher-v1": {
        "AGENT": "the 0.3 publisher's agent",
        "BRIDGE_METRICS_PORT": "its command gives --metrics-port",
        **dict.fromkeys(STORE_CLIENT, "it makes no Store request (its Store URL names the Redis key scope)"),
        **dict.fromkeys(V1_WORKER, "the 1.0 workers' settings"),
    },
    "worker": dict.fromkeys(
        [name for name in (env_name(f) for f in Settings.model_fields) if name.startswith("AGL_V1_")],
        "the 1.0 line's: compose sends 1.0 rollouts to worker-agl-v1 (with AGL_V1_SERVER_URL this worker would "
        "start a program server its image cannot run)",
    ),
    "worker-agl-v1": dict.fromkeys(AGENT_03, "the 0.3 agent's: this worker runs 1.0 programs only"),
    "flower": {
        **dict.fromkeys((*STORE_CLIENT, "AGENT_LIGHTNING_STORE_URL"), "Flower makes no Store request"),
        **dict.fromkeys(V1_WORKER, "the 1.0 workers' settings"),
    },
    "webshop": {},  # the WebShop server loads no settings
}
SECRETS = {  # variable of .env -> the services that may get its value
    "OPENAI_API_KEY": {"worker"},
    "AGENT_LIGHTNING_STORE_TOKEN": {"bridge", "worker", "worker-agl-v1"},
    "WEBSHOP_TOKEN": {"worker", "worker-agl-v1"},
    "AGL_V1_KEY": {"dispatcher-v1", "worker-agl-v1", "agl-gateway"},
    "COMPOSE_BROKER_URL": {"bridge", "dispatcher-v1", "worker", "worker-agl-v1", "flower"},
    "FLOWER_BASIC_AUTH": {"flower"},
    "RABBITMQ_PASSWORD": {"rabbitmq", "preflight-rabbitmq"},
    "REDIS_PASSWORD": {"redis", "bridge", "dispatcher-v1", "worker", "worker-agl-v1", "flower"},
    "GRAFANA_ADMIN_PASSWORD": {"grafana", "preflight-monitoring"},
}
BROKERS = {"CELERY_BROKER_URL", "REDIS_URL"}  # may hold a password: only for the services that use a broker
CONTAINER_VARIABLES = {"HOSTNAME"}  # set by Docker in every container


def every_variable() -> dict[str, str]:
    """Each variable .env.example names, set to a value of its own that shows where it ends up."""
    names = re.findall(r"^#?\s?([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), flags=re.M)
    values = {name: f"value-of-{name.lower()}-0123456789" for name in names}
    values |= {name: str(20000 + i) for i, name in enumerate(names) if name.endswith("_PORT")}  # published ports
    return values | {
        "FLOWER_PUBLISH_ADDRESS": "127.0.0.1",
        "FLOWER_BASIC_AUTH": "ops:value-of-flower_basic_auth",
        "COMPOSE_BROKER_URL": "amqp://agl:value-of-compose_broker_password@rabbitmq:5672//",
        "RABBITMQ_PASSWORD": "value-of-rabbitmq_password",
    }


SERVICES = load(COMPOSE, every_variable(), PROFILES)
SETTINGS = {env_name(field) for field in Settings.model_fields}


def test_no_service_takes_the_whole_env_file() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    for name, service in raw["services"].items():
        assert "env_file" not in service, f"{name} gets every variable of .env"
    assert "env_file" not in COMPOSE.read_text()


def test_the_fixtures_read_the_source() -> None:
    """The source reading sees what it should: a 0.3 worker's LLM key, the dispatcher's gateway key, a
    cross-check's fields; and the derived values expand."""
    assert "OPENAI_API_KEY" in settings_read(ENTRIES["worker"])
    assert "OPENAI_API_KEY" not in settings_read(ENTRIES["bridge"])
    assert "AGL_V1_KEY" in settings_read(ENTRIES["dispatcher-v1"]) - settings_read(ENTRIES["bridge"])
    assert fields_of("coordination_url") == {"redis_url", "broker_url"}
    assert {"lease_ttl_s", "heartbeat_interval_s"} <= set().union(*CHECKED_TOGETHER)
    assert settings_read(ENTRIES["webshop"]) == set()  # the WebShop server never loads the settings
    assert read_env_file(ROOT / ".env.example")  # the example parses


@pytest.mark.parametrize("service", sorted(ENTRIES))
def test_each_service_of_ours_gets_the_settings_it_reads_and_no_other(service: str) -> None:
    given = set(SERVICES[service].get("environment") or {})
    read = settings_read(ENTRIES[service])
    not_read = NOT_READ[service]
    assert not set(not_read) - read - SETTINGS, f"{service}: NOT_READ names unknown variables"
    wanted = read - set(not_read)
    assert not wanted - given, f"{service} reads {sorted(wanted - given)}, which compose does not give it"
    assert not (given & SETTINGS) - wanted, f"{service} gets {sorted((given & SETTINGS) - wanted)}: never read"
    for together in CHECKED_TOGETHER:  # a cross-check sees all of its variables or none (else a false refusal)
        names = {env_name(field) for field in together}
        assert names <= given or not names & given, (service, sorted(names - given))


def _container_side(service: dict[str, Any]) -> set[str]:
    """The variables a service's command and health check expand in the container (``$$VAR``, ``$${VAR...}``,
    Hydra's ``$${oc.env:VAR}``): after compose's interpolation, ``$VAR`` / ``${VAR}`` / ``${oc.env:VAR}``."""
    text = str(service.get("command", "")) + str(service.get("healthcheck", {}).get("test", ""))
    return set(re.findall(r"\$\{?(?:oc\.env:)?([A-Za-z_][A-Za-z0-9_]*)", text))


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_variable_a_command_expands_in_its_container_is_given(service: str) -> None:
    definition = SERVICES[service]
    missing = _container_side(definition) - set(definition.get("environment") or {}) - CONTAINER_VARIABLES
    assert not missing, f"{service}'s command expands {sorted(missing)}, which its container does not get"


def test_the_1_0_worker_has_what_it_passes_to_its_programs() -> None:
    environment = SERVICES["worker-agl-v1"]["environment"]
    default = load(
        COMPOSE, {"FLOWER_BASIC_AUTH": "ops:a-long-password-of-ours", "REDIS_PASSWORD": "redis0123456789"}, ("agl-v1",)
    )["worker-agl-v1"]
    passed = set(default["environment"]["AGL_V1_PASS_ENV"].split(","))
    assert passed and not passed - set(environment), sorted(passed - set(environment))


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_a_secret_reaches_only_the_services_that_need_it(secret: str) -> None:
    value = every_variable()[secret]
    holders = {name for name, service in SERVICES.items() if value in yaml.safe_dump(service)}
    assert holders == SECRETS[secret], secret


def test_broker_urls_reach_only_the_services_that_use_a_broker() -> None:
    users = SECRETS["COMPOSE_BROKER_URL"]
    for name, service in SERVICES.items():
        given = set(service.get("environment") or {}) & BROKERS
        assert given == (BROKERS if name in users else set()), name


def test_a_variable_env_leaves_unset_is_unset_in_the_container() -> None:
    """A pass-through variable (no value in compose) that .env does not set is not in the container at all, so
    the setting keeps its default (an empty value would be refused as a number)."""
    bare = load(COMPOSE, {"FLOWER_BASIC_AUTH": "ops:a-long-password-of-ours", "REDIS_PASSWORD": "redis0123456789"})
    assert "LEASE_TTL_S" not in bare["worker"]["environment"]
    assert SERVICES["worker"]["environment"]["LEASE_TTL_S"] == every_variable()["LEASE_TTL_S"]
