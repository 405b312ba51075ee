"""Generate .env.example and docs/configuration.md from the settings' groups, so neither can drift from them.

One section per group of ``bridge.core.settings`` (``GROUPS``, in that order), headed by the group's ``title``
and the processes that read it (``PROCESSES``); each variable comes from a field of the group, in the class's
order: its name (the field's ``validation_alias``), type, range and default, the value its .env.example line
shows (``examples``, else the default) and its description (the string below the field).
``set_in_example`` in a field's ``json_schema_extra`` leaves its .env.example line set instead of commented out.
Variables that other programs read (docker compose, Flower, OpenTelemetry, prometheus_client) are in ``FOREIGN``.

    python -m bridge_lab.configdoc            # print docs/configuration.md
    python -m bridge_lab.configdoc --write    # write .env.example and docs/configuration.md
    python -m bridge_lab.configdoc --check    # exit 1 when either is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import HttpUrl
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from bridge.core.settings import (
    GROUPS,
    PROCESSES,
    SET_IN_EXAMPLE,
    BrokerSettings,
    Settings,
    SettingsGroup,
    TelemetrySettings,
    WorkerNodeSettings,
    env_name,
)

ROOT = Path(__file__).resolve().parents[1]
ENV_EXAMPLE = ROOT / ".env.example"
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python -m bridge_lab.configdoc --write"
WIDTH = 110


@dataclass(frozen=True)
class Variable:
    """One line of .env.example and one row of docs/configuration.md."""

    name: str
    description: str
    example: str  # the value its .env.example line shows
    set_in_example: bool = False
    info: FieldInfo | None = None  # None: another program reads it (marked † in the reference)


@dataclass
class Section:
    title: str
    readers: str = ""  # who reads the section's variables, e.g. "the dispatchers and the workers"
    variables: list[Variable] = field(default_factory=list)


FOREIGN: dict[str, tuple[Variable, ...]] = {
    TelemetrySettings.title: (
        Variable(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "Operator traces (bridge publish -> worker run) go to a standard OTLP collector only when one of the "
            "standard OpenTelemetry variables is set, e.g. OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318",
            "",
        ),
    ),
    BrokerSettings.title: (
        Variable(
            "COMPOSE_BROKER_URL",
            "docker compose only: the broker inside compose's network (default its redis; this one for "
            "`--profile rabbitmq`).",
            "amqp://agl:<RABBITMQ_PASSWORD>@rabbitmq:5672//",
        ),
        Variable(
            "RABBITMQ_PASSWORD",
            "docker compose only: the password of that profile's RabbitMQ. Required with `--profile rabbitmq`: "
            "compose refuses to start RabbitMQ without one of 12+ characters that is no placeholder "
            "(preflight-rabbitmq), before RabbitMQ makes its user.",
            "",
        ),
        Variable(
            "RABBITMQ_CONSUMER_TIMEOUT_MS",
            "docker compose only: that RabbitMQ's consumer_timeout in ms (set BROKER_CONSUMER_TIMEOUT_S to match).",
            "1800000",
        ),
    ),
    WorkerNodeSettings.title: (
        Variable(
            "PROMETHEUS_MULTIPROC_DIR",
            "prometheus_client's multiprocess directory of a worker node (wiped when the node starts; one per "
            "node). Default: a private temporary directory.",
            "/tmp/agl-worker-metrics",
        ),
    ),
    "Flower and docker compose": (
        Variable(
            "REDIS_PASSWORD",
            "The password compose's Redis requires, put into every Redis URL compose hands to the bridge, the "
            "dispatchers, the workers and Flower. Letters and digits only (it goes into URLs), e.g. the output "
            "of `openssl rand -hex 24`. Required: compose refuses to start without it.",
            "",
        ),
        Variable(
            "FLOWER_BASIC_AUTH",
            "Flower's basic auth, user:password (Flower reads FLOWER_* variables itself). Required: compose refuses to "
            "start without it, and Flower (python -m bridge.ops.flower) with a placeholder password such as "
            "change-me or one under 12 characters.",
            "admin:change-me",
        ),
        Variable(
            "FLOWER_READ_ONLY",
            "Flower's read-only mode: its API and UI cannot send tasks by name (code execution on the workers), "
            "revoke them or control the workers. false turns those on, for whoever has Flower's login.",
            "true",
        ),
        Variable(
            "FLOWER_PORT",
            "Port compose publishes Flower on (http://127.0.0.1:5555).",
            "5555",
        ),
        Variable(
            "FLOWER_PUBLISH_ADDRESS",
            "Interface compose publishes Flower on: 127.0.0.1 (this host only), or 0.0.0.0 for every interface "
            "(then put TLS in front: basic auth travels in clear).",
            "127.0.0.1",
        ),
        Variable(
            "WORKER_CONCURRENCY", "Worker containers: slots per container (scale out with --scale worker=N).", "8"
        ),
        Variable("WORKER_POOL", "Worker containers: the Celery pool.", "prefork"),
        Variable("WORKER_QUEUES", "Worker containers: the queues they consume.", "rollouts"),
        Variable(
            "STORE_PORT", "Port on 127.0.0.1 (this host only) where compose publishes the Store (dashboard).", "4747"
        ),
        Variable(
            "BRIDGE_METRICS_PUBLISH_PORT", "Port on 127.0.0.1 where compose publishes the bridge's metrics.", "9100"
        ),
        Variable(
            "V1_METRICS_PUBLISH_PORT",
            "Port on 127.0.0.1 where compose publishes the 1.0 dispatcher's metrics (profile `agl-v1`).",
            "9102",
        ),
        Variable(
            "GATEWAY_PUBLISH_PORT",
            "Port on 127.0.0.1 where compose publishes 1.0's gateway, `agl-server` (profile `agl-v1-gateway`; its "
            "key is AGL_V1_KEY, required).",
            "8080",
        ),
        Variable(
            "PROMETHEUS_PORT", "Port on 127.0.0.1 where compose publishes Prometheus (profile `monitoring`).", "9090"
        ),
        Variable("GRAFANA_PORT", "Port on 127.0.0.1 where compose publishes Grafana (profile `monitoring`).", "3001"),
        Variable(
            "GRAFANA_ADMIN_PASSWORD",
            "Grafana's admin password (profile `monitoring`; user admin, on http://127.0.0.1:3001, no anonymous "
            "access). Required with `--profile monitoring`: compose refuses to start Grafana without one of 12+ "
            "characters that is no placeholder (preflight-monitoring).",
            "",
        ),
        *(
            Variable(name, f"The {what} image compose runs (a private registry's copy of it, for one).", default)
            for name, what, default in (
                ("REDIS_IMAGE", "Redis", "redis:7-alpine"),
                ("RABBITMQ_IMAGE", "RabbitMQ", "rabbitmq:3.13-alpine"),
                ("PROMETHEUS_IMAGE", "Prometheus", "prom/prometheus:v2.53.0"),
                ("GRAFANA_IMAGE", "Grafana", "grafana/grafana:11.1.0"),
            )
        ),
    ),
}
"""Variables that other programs read, appended to the section of that title (a new one at the end if none)."""

ENV_HEADER = f"""\
# agl-celery-bridge configuration. Copy to .env (read by the bridge, the workers, `python -m bridge demo`
# and docker compose, which passes each service only the variables docker-compose.yml lists for it) or export
# the variables. Every setting of bridge/core/settings/groups.py is listed here with its default, one section
# per group, each naming the processes that read it; a bad value stops those processes at start with one line
# naming the variable (exit code 2). Lines left commented keep the default.
# Secrets (tokens, API keys, Flower password) belong in .env only.
# Generated from bridge/core/settings/groups.py by `{COMMAND}`: do not edit by hand.
"""

DOC_HEADER = f"""\
# Configuration reference

<!-- Generated by `{COMMAND}` from bridge/core/settings/groups.py, like .env.example.
     Do not edit by hand: change the settings and regenerate (tests/unit/test_docs.py checks). -->

The settings come in groups, one per concern (`bridge.core.settings.groups`), one section below
each. Every process reads the groups it uses (`bridge.core.settings.processes`), from the environment
and from a `.env` file in the working directory; an environment variable wins over `.env`. The
dispatchers (`python -m bridge`, `python -m bridge v1`, `CeleryRunner`) read `DispatcherSettings`,
the Celery workers `WorkerSettings`; `python -m bridge status`, `python -m bridge demo` and the lab's
tools read every group (`Settings`). A process validates its groups when it starts: a bad value among
them stops it with one line that names the variable, and exit code 2, while a bad value in a group it
does not read leaves it alone. Each section says which processes read it. `.env.example` lists every
variable with the value it would take; copy it to `.env` and uncomment what you change.

Columns: *type* is what the value must parse as, with its allowed range; *default* is what an unset
variable means, followed by the example from `.env.example` where that differs. A variable marked †
is not a setting of this project: another program (Flower, docker compose, OpenTelemetry,
prometheus_client) reads it, as its description says.
"""


def readers(group: type[SettingsGroup]) -> str:
    """The processes that read ``group``, e.g. "the dispatchers and the workers"."""
    names = [name for name, process in PROCESSES.items() if issubclass(process, group)]
    return " and ".join(names)


def sections() -> list[Section]:
    """The settings' variables, one section per group in ``GROUPS`` order, with the foreign ones appended."""
    found: list[Section] = []
    for group in GROUPS:
        found.append(Section(group.title, readers(group)))
        for name in group.model_fields:
            info = Settings.model_fields[name]
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            example = str(info.examples[0]) if info.examples else default_of(info) or ""
            description = " ".join((info.description or "").split())
            found[-1].variables.append(
                Variable(env_name(name), description, example, bool(extra.get(SET_IN_EXAMPLE)), info)
            )
    for title, foreign in FOREIGN.items():
        section = next((s for s in found if s.title == title), None)
        if section is None:
            section = Section(title)
            found.append(section)
        section.variables.extend(foreign)
    return found


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return type_name(inner[0]) if len(inner) == 1 else " or ".join(type_name(a) for a in inner)
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in get_args(annotation))
    if origin is dict:
        return "comma-separated pairs"
    if origin is list:
        return "comma-separated list"
    if annotation is HttpUrl:
        return "URL"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, str(annotation))


def constraints(info: FieldInfo) -> str:
    """Numeric bounds of a field, e.g. ``> 0``, ``0 to 50``, ``>= 10``."""
    low = high = ""
    for item in info.metadata:
        if isinstance(item, Gt):
            low = f"> {item.gt}"
        elif isinstance(item, Ge):
            low = f">= {item.ge}"
        elif isinstance(item, Lt):
            high = f"< {item.lt}"
        elif isinstance(item, Le):
            high = f"<= {item.le}"
    if low.startswith(">=") and high.startswith("<="):
        return f"{low[3:]} to {high[3:]}"
    return ", ".join(part for part in (low, high) if part)


def show_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, HttpUrl):
        return str(value).rstrip("/")
    return str(value)


def default_of(info: FieldInfo) -> str | None:
    """The default as text; None when the variable is required, "" when it is unset by default."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return None
    else:
        value = info.default
    if value is None or value in ({}, [], ()):
        return ""
    return show_value(value)


# --- .env.example -----------------------------------------------------------------------------------------


def render_env_example(found: Sequence[Section]) -> str:
    """The whole .env.example: each variable's description as comment lines above its line."""
    lines = [ENV_HEADER]
    for section in found:
        lines.append(f"# --- {section.title} ".ljust(103, "-"))
        if section.readers:
            lines.append(f"# Read by {section.readers}.")
        for variable in section.variables:
            lines.extend(
                textwrap.wrap(
                    variable.description, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
                )
            )
            line = f"{variable.name}={variable.example}"
            lines.append(line if variable.set_in_example else f"# {line}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


# --- docs/configuration.md --------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def variable_cells(variable: Variable) -> tuple[str, str, str]:
    """(name, type, default) cells of one variable."""
    info = variable.info
    if info is None:
        return f"`{variable.name}` †", "-", f"e.g. `{variable.example}`" if variable.example else "-"
    bounds = constraints(info)
    kind = type_name(info.annotation) + (f", {bounds}" if bounds else "")
    default = default_of(info)
    shown = "required" if default is None else f"`{default}`" if default else "unset"
    if variable.example and variable.example != default:
        shown += f" (e.g. `{variable.example}`)"
    return f"`{variable.name}`", kind, shown


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", title).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def render_doc(found: Sequence[Section]) -> str:
    """The whole docs/configuration.md: its contents, then one table per section, one row per variable."""
    parts = [DOC_HEADER, "## Contents", ""]
    parts += [f"- [{section.title}](#{slug(section.title)})" for section in found]
    parts.append("")
    for section in found:
        parts += [f"## {section.title}", ""]
        if section.readers:
            parts += [f"Read by {section.readers}.", ""]
        parts += ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
        for variable in section.variables:
            cells = [*variable_cells(variable), variable.description]
            parts.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def generated() -> dict[Path, str]:
    """Each generated file and the text it must hold."""
    found = sections()
    return {ENV_EXAMPLE: render_env_example(found), OUTPUT: render_doc(found)}


def stale() -> list[Path]:
    """The generated files whose committed text differs from what the settings produce."""
    return [path for path, text in generated().items() if not path.exists() or path.read_text("utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_lab.configdoc", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write .env.example and docs/configuration.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when a committed file is stale")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in generated().items():
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if args.check:
        outdated = stale()
        for path in outdated:
            print(f"{path.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if outdated else 0
    sys.stdout.write(generated()[OUTPUT])
    return 0


if __name__ == "__main__":
    sys.exit(main())
