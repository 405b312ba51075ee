"""Parsers and broker rules behind ``bridge.core.settings``, kept apart so the settings module stays a list of knobs.

Each parser takes what the environment gives (a string) and returns the typed value or raises ``ValueError`` with a
message the settings turn into one readable line naming the variable.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo

REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://")
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES)


def is_amqp_url(url: str) -> bool:
    return url.startswith(AMQP_SCHEMES)


def check_broker_url(value: str) -> str:
    """Redis or RabbitMQ (AMQP 0-9-1): the two brokers whose redelivery rules this project accounts for."""
    if not (is_redis_url(value) or is_amqp_url(value)):
        schemes = ", ".join(REDIS_SCHEMES + AMQP_SCHEMES)
        raise ValueError(f"expected a Redis or RabbitMQ URL ({schemes})")
    return value


def check_redis_url(value: str | None) -> str | None:
    """The coordination store is always Redis (leases, slots, rate limits, the leader lock); empty means unset."""
    if not value:
        return None
    if not is_redis_url(value):
        raise ValueError(f"expected a Redis URL ({', '.join(REDIS_SCHEMES)})")
    return value


# Query parameters of a broker or Redis URL that turn TLS checks off (kombu and redis-py read them).
_TLS_OFF = {
    "ssl_cert_reqs": {"none", "optional", "cert_none", "cert_optional"},
    "ssl_check_hostname": {"false", "0", "no", "off", "n", "f"},
}


def check_tls_verified(name: str, url: str | None) -> None:
    """Raise ``ValueError`` when ``url``'s query turns certificate or host name checks off."""
    if not url:
        return
    try:
        query = parse_qsl(urlsplit(url).query)
    except ValueError:
        return
    for key, value in query:
        if value.strip().lower() in _TLS_OFF.get(key.lower(), ()):
            raise ValueError(
                f"{name} sets {key}={value}, which turns TLS certificate checks off: "
                "set BROKER_TLS_INSECURE=true to allow that"
            )


def split_host_port(entry: str) -> tuple[str, int | None] | None:
    """``host`` or ``host:port`` (IPv6 in brackets) as (lower-case host, port or None); None if it is neither."""
    if not entry or any(c in entry for c in "/@?#\\ \t"):
        return None
    try:
        parts = urlsplit(f"//{entry}")
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if not host or port == 0:
        return None
    return host, port


def parse_key_hosts(value: Any) -> Any:
    """Comma-separated ``host`` or ``host:port`` entries, lower-cased; a host without a port means any port."""
    entries = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if not isinstance(entries, list):
        return value
    hosts: list[str] = []
    for entry in entries:
        split = split_host_port(entry.strip()) if isinstance(entry, str) else None
        if split is None:
            raise ValueError(f"expected comma-separated host or host:port entries, got {entry!r}")
        host, port = split
        host = f"[{host}]" if ":" in host else host
        hosts.append(host if port is None else f"{host}:{port}")
    return hosts


def is_import_path(value: str) -> bool:
    """``module.path:attr`` (attr may be dotted, e.g. ``mod:Outer.Inner``); checked here, imported only by workers."""
    return bool(_IMPORT_PATH.match(value))


def parse_queue_map(value: Any) -> Any:
    """``mode=queue`` pairs separated by commas."""
    if not isinstance(value, str):
        return value
    mapping: dict[str, str] = {}
    for pair in (p.strip() for p in value.split(",") if p.strip()):
        mode, sep, queue = pair.partition("=")
        if not sep or not mode.strip() or not queue.strip():
            raise ValueError(f"expected mode=queue pairs separated by commas, got {pair!r}")
        mapping[mode.strip()] = queue.strip()
    return mapping


def parse_hooks(value: Any) -> Any:
    """Comma-separated ``module.path:attr`` entries."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list):
        bad = [p for p in value if not isinstance(p, str) or not is_import_path(p)]
        if bad:
            raise ValueError(f"expected comma-separated 'module.path:attr' entries, got {bad!r}")
    return value


def parse_rate_limits(value: Any) -> Any:
    """``model=rpm[:tpm]`` pairs; model names may hold '/' or ':', the numbers never '='."""
    if not isinstance(value, str):
        return value
    limits: dict[str, tuple[float | None, float | None]] = {}
    for pair in (p.strip() for p in value.split(",")):
        if not pair:
            continue
        model, sep, numbers = pair.rpartition("=")
        rpm, _, tpm = numbers.partition(":")
        try:
            parsed = (float(rpm) if rpm.strip() else None, float(tpm) if tpm.strip() else None)
        except ValueError:
            parsed = (-1.0, None)
        if not sep or not model.strip() or any(v is not None and v <= 0 for v in parsed):
            raise ValueError(f"expected model=rpm[:tpm] pairs with positive numbers, got {pair!r}")
        limits[model.strip()] = parsed
    return limits


def describe_errors(error: ValidationError, fields: dict[str, FieldInfo]) -> str:
    """One line per bad variable, named by its environment variable (the first alias), not the field."""
    lines = []
    for item in error.errors():
        loc = item.get("loc") or ()
        field = str(loc[0]) if loc else "settings"
        info = fields.get(field)
        name = field.upper()
        if info is not None and isinstance(info.validation_alias, AliasChoices):
            name = str(info.validation_alias.choices[0])
        message = item.get("msg", "invalid value")
        if item.get("type") == "missing":
            message = "is required but not set"
        lines.append(f"{name}: {message}")
    return "invalid configuration: " + "; ".join(lines)
