"""What ``docker compose config`` checks of docker-compose.yml, in Python, so the tests need no Docker.

Neither CI nor Debian 12 has Docker Compose v2 (Debian 12's ``docker-compose`` is v1, which cannot read the
file's ``env_file`` entries with ``required``), so ``load(path, env, profiles)`` does its part here:
interpolation as compose does it (``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``; a required variable that is missing raises
``ComposeError`` with compose's message), YAML anchors and merge keys, ``x-`` extension fields, and profiles;
then the checks compose makes before it starts anything: known top-level and service keys (a misspelled one
is an error), an image or a build per service, environment and env_file forms (a required env_file must
exist), port syntax with a valid host address, ``depends_on`` naming services that are active with the same
profiles and conditions compose knows, health check forms and durations, named volumes declared and bind
mounts that exist. It raises ``ComposeError`` at the first problem and returns the services that would run, each
environment as its container gets it (a name without a value: the variable's value, or left out when unset).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

TOP_LEVEL = {"version", "name", "services", "networks", "volumes", "secrets", "configs", "include"}
SERVICE_KEYS = {
    "annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup", "cgroup_parent", "command",
    "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota", "cpu_rt_period",
    "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on", "deploy", "develop",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add", "healthcheck",
    "hostname", "image", "init", "ipc", "isolation", "labels", "links", "logging", "mac_address", "mem_limit",
    "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode", "networks", "oom_kill_disable",
    "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged", "profiles",
    "pull_policy", "read_only", "restart", "runtime", "scale", "secrets", "security_opt", "shm_size",
    "stdin_open", "stop_grace_period", "stop_signal", "storage_opt", "sysctls", "tmpfs", "tty", "ulimits",
    "user", "userns_mode", "uts", "volumes", "volumes_from", "working_dir",
}  # fmt: skip
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}
RESTART = re.compile(r"no|always|unless-stopped|on-failure(:\d+)?")
DURATION = re.compile(r"(\d+(\.\d+)?(us|ms|s|m|h))+")
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)
PORT = re.compile(
    r"(?:(?:(?P<ip>\[[0-9a-fA-F:.]+\]|[0-9.]+|[0-9a-fA-F:]+):)?(?P<host>[\d-]+)?:)?(?P<target>[\d-]+)(?:/(?:tcp|udp|sctp))?"
)


class ComposeError(Exception):
    """What ``docker compose config`` would refuse the file for."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with its variables replaced as compose replaces them; a missing required one raises. A braced
    variable's default may hold variables of its own (``${A:-redis://:${B}@host}``), read only when it is used."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            if end is None:
                raise ComposeError(f"invalid interpolation format for {text[i:]!r}")
            out.append(_braced(text[i : end + 1], text[i + 2 : end], env))
            i = end + 1
        elif bare := BARE.match(text, i + 1):
            out.append(env.get(bare[0], ""))
            i = bare.end()
        else:
            out.append("$")
            i += 1
    return "".join(out)


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the ``}`` that closes the ``${`` before ``start``, nested ones skipped."""
    depth, i = 1, start
    while i < len(text):
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _braced(whole: str, inner: str, env: Mapping[str, str]) -> str:
    braced = BRACED.fullmatch(inner)
    if braced is None:
        raise ComposeError(f"invalid interpolation format for {whole!r}")
    name, op, arg = braced["name"], braced["op"], braced["arg"]
    value, unset, empty = env.get(name), name not in env, not env.get(name)
    if op is None:
        return value or ""
    missing = empty if op.startswith(":") else unset
    if op.endswith("-"):
        return interpolate(arg, env) if missing else str(value)
    if op.endswith("+"):
        return "" if missing else interpolate(arg, env)
    if missing:  # ? and :?
        raise ComposeError(f"required variable {name} is missing a value: {interpolate(arg, env)}")
    return str(value)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: _interpolated(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolated(value, env) for value in node]
    return node


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of a .env file (comments and blank lines skipped, quotes removed)."""
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("'\"")
    return values


def _duration(where: str, value: Any) -> None:
    if not isinstance(value, str) or not DURATION.fullmatch(value):
        raise ComposeError(f"{where}: invalid duration {value!r}")


def _port(where: str, port: Any) -> None:
    if isinstance(port, dict):
        if "target" not in port or set(port) - {"target", "published", "host_ip", "protocol", "mode", "name"}:
            raise ComposeError(f"{where}: invalid port {port!r}")
        ip = port.get("host_ip")
    else:
        match = PORT.fullmatch(str(port))
        if match is None:
            raise ComposeError(f"{where}: invalid port {port!r}")
        ip = match["ip"]
    if ip:
        try:
            ipaddress.ip_address(str(ip).strip("[]"))
        except ValueError as exc:
            raise ComposeError(f"{where}: invalid host address in port {port!r}") from exc


def _environment(where: str, environment: Any) -> None:
    if isinstance(environment, list):
        bad = [item for item in environment if not isinstance(item, str) or not re.match(r"[^=\s]+(=|$)", item)]
    elif isinstance(environment, dict):
        bad = [key for key, value in environment.items() if isinstance(value, dict | list)]
    else:
        bad = [environment]
    if bad:
        raise ComposeError(f"{where}: invalid environment entries {bad!r}")


def _service(name: str, service: Any, root: Path, active: set[str], volumes: Mapping[str, Any]) -> None:
    where = f"services.{name}"
    if not isinstance(service, dict):
        raise ComposeError(f"{where} must be a mapping")
    unknown = set(service) - SERVICE_KEYS - {key for key in service if str(key).startswith("x-")}
    if unknown:
        raise ComposeError(f"{where}: additional properties not allowed: {sorted(unknown)}")
    if "image" not in service and "build" not in service:
        raise ComposeError(f"{where} has neither an image nor a build context")
    if "restart" in service and not RESTART.fullmatch(str(service["restart"])):
        raise ComposeError(f"{where}.restart: invalid {service['restart']!r}")
    for key in ("stop_grace_period",):
        if key in service:
            _duration(f"{where}.{key}", service[key])
    _environment(f"{where}.environment", service.get("environment", {}))
    for entry in (
        service.get("env_file", []) if isinstance(service.get("env_file"), list) else [service.get("env_file")]
    ):
        if entry is None:
            continue
        path, required = (entry, True) if isinstance(entry, str) else (entry.get("path"), entry.get("required", True))
        if not isinstance(path, str) or not isinstance(required, bool):
            raise ComposeError(f"{where}.env_file: invalid entry {entry!r}")
        if required and not (root / path).exists():
            raise ComposeError(f"{where}.env_file: {path} not found")
    for port in service.get("ports", []):
        _port(f"{where}.ports", port)
    depends = service.get("depends_on", {})
    for other in depends if isinstance(depends, list) else list(depends):
        condition = depends[other].get("condition", "service_started") if isinstance(depends, dict) else None
        required = depends[other].get("required", True) if isinstance(depends, dict) else True
        if condition is not None and condition not in CONDITIONS:
            raise ComposeError(f"{where}.depends_on.{other}: unknown condition {condition!r}")
        if other not in active and required:
            raise ComposeError(f"service {name!r} depends on undefined service {other!r}")
    health = service.get("healthcheck")
    if health is not None:
        if set(health) - HEALTHCHECK_KEYS:
            raise ComposeError(f"{where}.healthcheck: additional properties {sorted(set(health) - HEALTHCHECK_KEYS)}")
        test = health.get("test")
        if isinstance(test, list) and (not test or test[0] not in {"CMD", "CMD-SHELL", "NONE"}):
            raise ComposeError(f"{where}.healthcheck.test must start with CMD, CMD-SHELL or NONE: {test!r}")
        for key in ("interval", "timeout", "start_period", "start_interval"):
            if key in health:
                _duration(f"{where}.healthcheck.{key}", health[key])
    for mount in service.get("volumes", []):
        source = mount.get("source") if isinstance(mount, dict) else str(mount).split(":")[0]
        if not source or ("/" not in source and ":" not in str(mount)):
            continue  # an anonymous volume
        if source.startswith((".", "/", "~")):
            if source.startswith(".") and not (root / source).exists():
                raise ComposeError(f"{where}.volumes: bind mount source {source} does not exist")
        elif source not in volumes:
            raise ComposeError(f"service {name!r} refers to undefined volume {source}")


def load(
    path: Path, env: Mapping[str, str], profiles: Iterable[str] = (), project_dir: Path | None = None
) -> dict[str, Any]:
    """The services ``docker compose --profile P... config`` would show, with ``env`` as the variables (the
    shell's and the project's .env together) and relative paths from ``project_dir`` (the file's directory);
    raises ComposeError where compose would refuse the file."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict):
        raise ComposeError(f"{path}: top-level object must be a mapping")
    unknown = {key for key in document if not str(key).startswith("x-")} - TOP_LEVEL
    if unknown:
        raise ComposeError(f"additional properties not allowed at top level: {sorted(unknown)}")
    resolved = _interpolated({k: v for k, v in document.items() if not str(k).startswith("x-")}, env)
    services: dict[str, Any] = resolved.get("services") or {}
    wanted = set(profiles)
    active = {name for name, s in services.items() if not s.get("profiles") or wanted & set(s["profiles"])}
    volumes = resolved.get("volumes") or {}
    for name in sorted(active):
        _service(name, services[name], project_dir or path.parent, active, volumes)
        if "environment" in services[name]:
            services[name]["environment"] = _passed_through(services[name]["environment"], env)
    return {name: services[name] for name in services if name in active}


def _passed_through(environment: dict[str, Any] | list[str], env: Mapping[str, str]) -> dict[str, str]:
    """A service's environment as its container gets it: a name without a value takes the variable's value from
    ``env`` (the shell and .env), and is left out of the container when ``env`` does not set it."""
    items = (
        [(key, value) for key, value in environment.items()]
        if isinstance(environment, dict)
        else [(item.partition("=")[0], item.partition("=")[2] if "=" in item else None) for item in environment]
    )
    resolved: dict[str, str] = {}
    for key, value in items:
        if value is None:
            if key in env:
                resolved[key] = env[key]
        else:
            resolved[key] = str(value)
    return resolved


SIZING = re.compile(
    r"\*\*Sizing figures:\*\* worker base (?P<base>\d+) MiB, per program (?P<program>\d+) MiB \(cold start\), "
    r"disk quota (?P<disk>\d+) MiB \(`AGL_V1_PROGRAM_DISK_MB`\), margin (?P<margin>\d+) %"
)


def v1_sizing_figures(performance_md: Path) -> dict[str, int]:
    """The figures docs/performance.md states for sizing a 1.0 worker: ``base``, ``program``, ``disk`` (MiB) and
    ``margin`` (%)."""
    match = SIZING.search(performance_md.read_text(encoding="utf-8"))
    if match is None:
        raise ComposeError(f"{performance_md} states no sizing figures")
    return {k: int(match[k]) for k in ("base", "program", "disk", "margin")}


def v1_worker_memory_mib(slots: int, performance_md: Path) -> float:
    """The memory a 1.0 worker of ``slots`` slots needs by the sizing rule of docs/performance.md ("Memory of a
    1.0 agent program, and sizing a 1.0 worker"), with the figures stated there: each slot's program and its full
    disk quota (tmpfs pages are memory)."""
    figures = v1_sizing_figures(performance_md)
    per_slot = figures["program"] + figures["disk"]
    return (1 + figures["margin"] / 100) * (figures["base"] + slots * per_slot)
