"""Deployment files only use what the project has: docker-compose.yml, the Dockerfile, .env.example and the
Grafana dashboard are checked against the bridge's commands, its settings and the metrics it exports.

Static checks, no process started; `docker compose config` itself runs in tests/integration/test_entry_points.py
where the docker CLI has the compose plugin.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from bridge.cli import build_parser
from bridge.core.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr,arg-type]


# Variables compose uses that are not bridge settings: each read by the named program.
NON_SETTINGS = {
    "FLOWER_BASIC_AUTH",  # Flower
    "PROMETHEUS_MULTIPROC_DIR",  # prometheus_client (workers.metrics)
    "LITELLM_LOCAL_MODEL_COST_MAP",  # agl store (litellm)
    "GF_SECURITY_ADMIN_PASSWORD",  # Grafana
    "RABBITMQ_DEFAULT_USER",  # the rabbitmq image (profile rabbitmq)
    "RABBITMQ_DEFAULT_PASS",
    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
}


def test_bridge_has_the_operator_commands() -> None:
    assert {"run", "demo", "status"} <= set(BRIDGE_COMMANDS)


def _documented() -> set[str]:
    text = (ROOT / ".env.example").read_text()
    return set(re.findall(r"^#?\s?([A-Z][A-Z0-9_]+)=", text, flags=re.M))


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def _argv(command: Any) -> list[str]:
    """A compose command as argv; ``sh -c "..."`` is unwrapped to the program it execs."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2].replace("$$", "$"))
        argv = argv[1:] if argv[0] == "exec" else argv
    return argv


def test_compose_commands_exist_in_the_project() -> None:
    services = _compose()["services"]
    assert {"redis", "store", "webshop", "policy", "worker", "bridge", "flower"} <= set(services)
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("agl-celery-bridge") or "command" not in service:
            continue
        argv = _argv(service["command"])
        if argv[0] == "python":
            assert argv[1] == "-m" and importlib.util.find_spec(argv[2]) is not None, (name, argv)
            if argv[2] == "bridge":
                assert argv[3] in BRIDGE_COMMANDS, (name, argv)
                assert {"--metrics-port"} <= set(argv) or argv[3] != "run"
        elif argv[0] == "celery":
            assert argv[1:3] == ["-A", "workers"] and argv[3] in {"worker", "flower"}, (name, argv)
        else:
            assert argv[0] == "agl" and argv[1] == "store", (name, argv)
    for name in ("worker", "bridge", "flower", "store", "webshop", "redis"):
        assert "healthcheck" in services[name], name
        assert services[name].get("restart") == "unless-stopped", name
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]  # --scale worker=N
    assert services["policy"]["profiles"] == ["standin"]


def test_compose_variables_are_settings_or_documented() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    settings = {env_name(name) for name in Settings.model_fields}
    documented = _documented()
    for service in _compose()["services"].values():
        for key in service.get("environment") or {}:
            assert key in settings or key in NON_SETTINGS, f"compose sets {key}, which nothing reads"
    interpolated = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))
    assert interpolated, "expected ${VAR} interpolations"
    assert not interpolated - documented, f"undocumented in .env.example: {sorted(interpolated - documented)}"
    for mount in re.findall(r"- \./([\w./-]+):", text):
        assert (ROOT / mount).exists(), mount


def _host_ip(port: Any) -> str:
    """The host address a compose port entry binds ("" for every interface); short or long syntax."""
    if isinstance(port, dict):
        return str(port.get("host_ip") or "")
    parts = re.sub(r"\$\{[^}]*\}", "0", str(port)).rsplit("/", 1)[0].split(":")  # ${PORT:-1} counts as a port
    return parts[0] if len(parts) == 3 else ""


def test_only_flower_is_published_beyond_the_host_and_grafana_needs_a_login() -> None:
    services = _compose()["services"]
    published = {name: service.get("ports") or [] for name, service in services.items()}
    assert published["flower"] and "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    for name, ports in published.items():
        if name != "flower":
            assert all(_host_ip(port) == "127.0.0.1" for port in ports), (name, ports)
    assert {"store", "bridge", "prometheus", "grafana"} <= {name for name, ports in published.items() if ports}
    grafana = {str(k).upper(): str(v) for k, v in services["grafana"]["environment"].items()}
    assert not [k for k in grafana if k.startswith("GF_AUTH_ANONYMOUS")], grafana
    assert grafana.get("GF_SECURITY_ADMIN_PASSWORD"), "Grafana's admin password comes from GRAFANA_ADMIN_PASSWORD"
    assert _host_ip("127.0.0.1:3001:3000") == "127.0.0.1" and _host_ip("3001:3000") == _host_ip("9090") == ""


def test_dockerfile_copies_what_exists() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_grafana_dashboard_uses_exported_series() -> None:
    from bridge.dispatch import metrics as bridge_metrics
    from workers import metrics as worker_metrics

    exported = {
        collector._name
        for module in (bridge_metrics, worker_metrics)
        for collector in vars(module).values()
        if hasattr(collector, "_name") and hasattr(collector, "_type")
    }
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/agl-celery-bridge.json").read_text())
    used = {
        re.sub(r"_(bucket|sum|count|total)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"agl_[a-z_]+", target["expr"])
    }
    assert used and not used - exported, sorted(used - exported)
