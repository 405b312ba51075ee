"""How a setting's value is read and checked: the URL schemes and TLS checks of broker and Redis URLs, and the
parsers of list and map values. Each parser takes what the environment gives (a string; keyword overrides may
pass the parsed type) and returns the typed value, or raises ValueError with a message that names what was
expected; the groups of ``bridge.core.settings.groups`` apply them to their fields.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# --- URLs -------------------------------------------------------------------------------------------

REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://")
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")

# Query parameters of a broker or Redis URL that turn TLS checks off (kombu and redis-py read them).
_TLS_OFF = {
    "ssl_cert_reqs": {"none", "optional", "cert_none", "cert_optional"},
    "ssl_check_hostname": {"false", "0", "no", "off", "n", "f"},
}


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES)


def is_amqp_url(url: str) -> bool:
    return url.startswith(AMQP_SCHEMES)


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


# --- list and map values ----------------------------------------------------------------------------

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(value: str) -> bool:
    """``module.path:attr`` (attr may be dotted, e.g. ``mod:Outer.Inner``); checked here, imported only by workers."""
    return bool(_IMPORT_PATH.match(value))


def key_host_list(value: Any) -> Any:
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


def queue_map(value: Any) -> Any:
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


def hook_list(value: Any) -> Any:
    """Comma-separated ``module.path:attr`` entries."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list):
        bad = [p for p in value if not isinstance(p, str) or not is_import_path(p)]
        if bad:
            raise ValueError(f"expected comma-separated 'module.path:attr' entries, got {bad!r}")
    return value


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def comma_list(value: Any) -> Any:
    """Comma-separated entries, stripped, empty ones dropped."""
    return [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value


def pass_env_list(value: Any) -> Any:
    """Comma-separated variable names; ``AGL_*`` are the worker's own (its key among them), never passed."""
    value = comma_list(value)
    if isinstance(value, list):
        bad = [p for p in value if not isinstance(p, str) or not _ENV_NAME.match(p) or p.upper().startswith("AGL_")]
        if bad:
            raise ValueError(f"expected comma-separated variable names, none starting with AGL_, got {bad!r}")
    return value


def module_prefix_list(value: Any) -> Any:
    """Comma-separated module paths (``pkg`` or ``pkg.sub``; a trailing dot is dropped)."""
    value = comma_list(value)
    if isinstance(value, list):
        value = [p.rstrip(".") if isinstance(p, str) else p for p in value]
        bad = [p for p in value if not isinstance(p, str) or not _MODULE_PATH.match(p)]
        if bad:
            raise ValueError(f"expected comma-separated module paths (pkg or pkg.sub), got {bad!r}")
    return value


def rate_limit_map(value: Any) -> Any:
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


def share_weights(value: Any) -> Any:
    """``line:weight`` pairs, each line v03 or v1, each weight a positive number."""
    if isinstance(value, str):
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        value = {}
        for pair in pairs:
            line, sep, weight = pair.partition(":")
            try:
                value[line.strip()] = float(weight) if sep else -1.0
            except ValueError:
                value[line.strip()] = -1.0
    if isinstance(value, dict):
        bad = {k: v for k, v in value.items() if k not in ("v03", "v1") or not isinstance(v, int | float) or v <= 0}
        if bad:
            raise ValueError(f"expected line:weight pairs (lines v03, v1; positive weights), got {bad!r}")
    return value
