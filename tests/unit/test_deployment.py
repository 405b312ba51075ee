"""Deployment files only use what the project has: docker-compose.yml, the Dockerfile, .env.example and the
Grafana dashboard are checked against the bridge's commands, its settings and the metrics it exports.

Static checks, no process started. What `docker compose config` checks runs here without Docker
(tests/compose.py: interpolation, profiles, keys, ports, depends_on, env_file), with the safe defaults: compose
refuses .env.example as it is (no Flower login), every port binds 127.0.0.1, Flower runs read-only.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.cli import build_parser
from bridge.core.settings import Settings, env_name
from bridge.ops.flower import login_problem
from tests.compose import ComposeError, interpolate, load, read_env_file, v1_sizing_figures, v1_worker_memory_mib
from tests.images import (
    IMAGES,
    INTERPRETER_IMAGES,
    LAB_SOURCES,
    command_argv,
    extras_needed,
    image_name,
    stages,
    target_for,
)

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr,arg-type]


# Variables compose uses that are not bridge settings: each read by the named program.
NON_SETTINGS = {
    "FLOWER_BASIC_AUTH",  # Flower
    "FLOWER_READ_ONLY",
    "PROMETHEUS_MULTIPROC_DIR",  # prometheus_client (workers.lifecycle.metrics)
    "LITELLM_LOCAL_MODEL_COST_MAP",  # agl store (litellm)
    "GF_SECURITY_ADMIN_PASSWORD",  # Grafana
    "RABBITMQ_DEFAULT_USER",  # the rabbitmq image (profile rabbitmq)
    "RABBITMQ_DEFAULT_PASS",
    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
    "REDISCLI_AUTH",  # redis-cli, in the Redis container's health check
    "HOME",  # the 1.0 worker's, set where setpriv leaves root's (worker-agl-v1)
    "RABBITMQ_PASSWORD",  # what preflight-rabbitmq and preflight-monitoring check (python -m bridge preflight)
    "GRAFANA_ADMIN_PASSWORD",
}


def test_bridge_has_the_operator_commands() -> None:
    assert {"run", "demo", "status"} <= set(BRIDGE_COMMANDS)


def _documented() -> set[str]:
    text = (ROOT / ".env.example").read_text()
    return set(re.findall(r"^#?\s?([A-Z][A-Z0-9_]+)=", text, flags=re.M))


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_compose_commands_exist_in_the_project() -> None:
    services = _compose()["services"]
    assert {"redis", "store", "webshop", "policy", "worker", "bridge", "flower"} <= set(services)
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("agl-celery-bridge") or "command" not in service:
            continue
        argv = command_argv(service["command"])
        if argv[0] == "python":
            assert argv[1] == "-m" and importlib.util.find_spec(argv[2]) is not None, (name, argv)
            if argv[2] == "bridge":
                assert argv[3] in BRIDGE_COMMANDS, (name, argv)
                assert {"--metrics-port"} <= set(argv) or argv[3] != "run"
        elif argv[0] == "celery":
            assert argv[1:3] == ["-A", "workers"] and argv[3] in {"worker", "flower"}, (name, argv)
        elif argv[0] == "/opt/agent/bin/agl-server":  # 1.0's gateway, in the image that installs it there
            assert service["build"]["target"] == "worker-agl-v1", name
        else:
            assert argv[0] == "agl" and argv[1] == "store", (name, argv)
    for name in ("worker", "bridge", "flower", "store", "webshop", "redis"):
        assert "healthcheck" in services[name], name
        assert services[name].get("restart") == "unless-stopped", name
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]  # --scale worker=N
    assert services["policy"]["profiles"] == ["standin"]


PREFLIGHTS = {  # service -> the one-shot check it waits for (python -m bridge preflight)
    "worker": "preflight",
    "bridge": "preflight",
    "flower": "preflight",
    "dispatcher-v1": "preflight-v1",
    "worker-agl-v1": "preflight-v1",
    "rabbitmq": "preflight-rabbitmq",
    "grafana": "preflight-monitoring",
}


def test_a_stack_that_cannot_work_waits_for_a_preflight_that_refuses_it() -> None:
    """Each service that cannot work without an LLM, a gateway or a password of the operator's own starts only
    once its profile's preflight exited 0, and each preflight is in the same profiles as what waits for it."""
    services = _compose()["services"]
    for name, preflight in PREFLIGHTS.items():
        assert services[name]["depends_on"][preflight] == {"condition": "service_completed_successfully"}, name
        assert services[name].get("profiles") == services[preflight].get("profiles"), name
        argv = command_argv(services[preflight]["command"])
        assert argv[:4] == ["python", "-m", "bridge", "preflight"] and services[preflight]["restart"] == "no"
    checks = {name: command_argv(services[name]["command"]) for name in set(PREFLIGHTS.values())}
    assert checks["preflight"][4:6] == ["--llm", "${OPENAI_API_BASE:-http://policy:8000/v1}"]
    assert services["worker"]["environment"]["OPENAI_API_BASE"] == checks["preflight"][5]  # one address, checked
    assert checks["preflight-v1"][4:] == ["--gateway", services["worker-agl-v1"]["environment"]["AGL_V1_SERVER_URL"]]
    assert checks["preflight-rabbitmq"][4:] == ["--password", "RABBITMQ_PASSWORD"]
    assert checks["preflight-monitoring"][4:] == ["--password", "GRAFANA_ADMIN_PASSWORD"]
    assert services["rabbitmq"]["environment"]["RABBITMQ_DEFAULT_PASS"] == "${RABBITMQ_PASSWORD:-}"  # no default


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


def test_every_port_binds_loopback_unless_told_and_grafana_needs_a_login() -> None:
    services = load(COMPOSE, {**LOGIN}, PROFILES)
    published = {name: service.get("ports") or [] for name, service in services.items()}
    for name, ports in published.items():
        assert all(_host_ip(port) == "127.0.0.1" for port in ports), (name, ports)
    assert {"flower", "store", "bridge", "prometheus", "grafana"} <= {
        name for name, ports in published.items() if ports
    }
    opened = load(COMPOSE, {**LOGIN, "FLOWER_PUBLISH_ADDRESS": "0.0.0.0"}, PROFILES)
    assert [_host_ip(port) for port in opened["flower"]["ports"]] == ["0.0.0.0"]
    grafana = {str(k).upper(): str(v) for k, v in services["grafana"]["environment"].items()}
    assert not [k for k in grafana if k.startswith("GF_AUTH_ANONYMOUS")], grafana
    assert not grafana.get("GF_SECURITY_ADMIN_PASSWORD"), "Grafana's admin password has no default"
    given = load(COMPOSE, {**LOGIN, "GRAFANA_ADMIN_PASSWORD": "an-own-password"}, PROFILES)["grafana"]["environment"]
    assert given["GF_SECURITY_ADMIN_PASSWORD"] == "an-own-password"
    assert services["grafana"]["depends_on"]["preflight-monitoring"]["condition"] == "service_completed_successfully"
    assert _host_ip("127.0.0.1:3001:3000") == "127.0.0.1" and _host_ip("3001:3000") == _host_ip("9090") == ""


COMPOSE = ROOT / "docker-compose.yml"
LOGIN = {"FLOWER_BASIC_AUTH": "ops:a-long-password-of-ours", "REDIS_PASSWORD": "redis0123456789abcdef"}
PROFILES = ("standin", "monitoring", "rabbitmq", "agl-v1", "agl-v1-gateway")


@pytest.mark.parametrize(
    "profiles",
    [(), ("standin",), ("monitoring",), ("rabbitmq",), ("agl-v1",), ("agl-v1", "agl-v1-gateway"), PROFILES],
)
def test_compose_config_validates(profiles: tuple[str, ...]) -> None:
    """`docker compose [--profile P] config` with a login set: the file is valid and runs the expected services."""
    services = load(COMPOSE, LOGIN, profiles)
    assert {"redis", "store", "webshop", "worker", "bridge", "flower"} <= set(services)
    assert set(_COMPOSE_PROFILE) & set(services) == {
        name for name, profile in _COMPOSE_PROFILE.items() if profile in profiles
    }


_COMPOSE_PROFILE = {
    "policy": "standin",
    "prometheus": "monitoring",
    "grafana": "monitoring",
    "rabbitmq": "rabbitmq",
    "dispatcher-v1": "agl-v1",
    "worker-agl-v1": "agl-v1",
    "agl-gateway": "agl-v1-gateway",
}


def test_compose_refuses_the_example_env_and_flower_refuses_its_placeholder() -> None:
    """`cp .env.example .env && docker compose up -d` stops at once, asking for a Flower login; uncommenting the
    example's login gets Flower refused at start; the login set, Flower runs read-only."""
    example = read_env_file(ROOT / ".env.example")
    with pytest.raises(ComposeError, match="REDIS_PASSWORD"):
        load(COMPOSE, example)
    example["REDIS_PASSWORD"] = LOGIN["REDIS_PASSWORD"]
    with pytest.raises(ComposeError, match="FLOWER_BASIC_AUTH"):
        load(COMPOSE, example)
    (placeholder,) = re.findall(r"^# FLOWER_BASIC_AUTH=(.*)$", (ROOT / ".env.example").read_text(), flags=re.M)
    flower = load(COMPOSE, {**example, "FLOWER_BASIC_AUTH": placeholder})["flower"]
    assert command_argv(flower["command"])[:3] == ["python", "-m", "bridge.ops.flower"]
    assert login_problem(flower["environment"]) is not None
    flower = load(COMPOSE, {**example, **LOGIN})["flower"]
    assert login_problem(flower["environment"]) is None
    assert flower["environment"]["FLOWER_READ_ONLY"] == "true"
    assert "FLOWER_UNAUTHENTICATED_API" not in flower["environment"]


def test_the_compose_checker_bites(tmp_path: Path) -> None:
    """A copy of the file broken in each way `docker compose config` refuses is refused here too."""
    text = COMPOSE.read_text()
    broken = {  # the change, and what the refusal says
        "healthchek": (text.replace("    healthcheck:\n", "    healthchek:\n", 1), "additional properties"),
        "stor": (
            text.replace("      store:\n        condition", "      stor:\n        condition", 1),
            "undefined service",
        ),
        "port": (text.replace('"127.0.0.1:${STORE_PORT:-4747}:4747"', '"127.0.0.300:4747:4747"', 1), "host address"),
        "volume": (text.replace("      - redis-data:/data", "      - redis-dat:/data", 1), "undefined volume"),
        "duration": (text.replace("stop_grace_period: 30s", "stop_grace_period: 30 seconds", 1), "invalid duration"),
        "condition": (text.replace("condition: service_healthy", "condition: healthy", 1), "unknown condition"),
        "interpolation": (text.replace("${STORE_PORT:-4747}", "${STORE PORT}", 1), "invalid interpolation"),
        "top level": (text + "\nvolume:\n  extra:\n", "at top level"),
        "env_file": (
            text.replace(
                '    command: ["python", "-m", "bridge", "run"',
                '    env_file: [{path: .env, required: true}]\n    command: ["python", "-m", "bridge", "run"',
                1,
            ),
            ".env not found",
        ),
    }
    for why, (variant, message) in broken.items():
        assert variant != text, why
        path = tmp_path / "docker-compose.yml"
        path.write_text(variant)
        with pytest.raises(ComposeError, match=re.escape(message)):
            load(path, LOGIN, PROFILES, project_dir=tmp_path if why == "env_file" else ROOT)
    assert interpolate("$$HOME|${A:-x}|${B-y}|${A:+set}|${B+set}|$A", {"A": "", "B": ""}) == "$HOME|x|||set|"
    with pytest.raises(ComposeError, match="required variable A"):
        interpolate("${A:?give A}", {"A": ""})
    assert interpolate("${A?give A}", {"A": ""}) == ""
    nested = "${URL:-redis://:${PASSWORD:?set it}@redis/0}"  # compose reads a default's variables when it is used
    assert interpolate(nested, {"PASSWORD": "pw"}) == "redis://:pw@redis/0"
    assert interpolate(nested, {"URL": "amqp://rabbit//"}) == "amqp://rabbit//"
    with pytest.raises(ComposeError, match="required variable PASSWORD"):
        interpolate(nested, {})


def test_dockerfile_copies_what_exists() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_the_default_target_is_the_lean_runtime() -> None:
    """``docker build .`` gives the workers' and the bridge's image: the product alone, no extra, no lab source."""
    found = stages(ROOT / "Dockerfile")
    runtime = found["runtime"]
    assert list(found)[-1] == "runtime" and runtime.installs
    assert runtime.extras == set() and not runtime.copies & LAB_SOURCES, runtime
    assert {"bridge", "workers"} <= runtime.copies
    assert found["lab"].extras == {"store", "lab"} and found["lab"].copies >= LAB_SOURCES
    assert found["flower"].extras == {"flower"}


def test_each_compose_service_runs_from_the_leanest_target_that_has_what_its_commands_need() -> None:
    """The workers and the bridge from ``runtime``, Flower from ``flower``, the Store and the stand-ins from
    ``lab``; each service built here names its target, and its image name is that target's."""
    found = stages(ROOT / "Dockerfile")
    targets: dict[str, str] = {}
    for name, service in _compose()["services"].items():
        if "build" not in service:
            assert not str(service["image"]).startswith("agl-celery-bridge"), name
            continue
        target = service["build"]["target"]
        if image_name(service["image"]) in INTERPRETER_IMAGES:  # for its Python 3.12 and agentlightning 1.0
            assert INTERPRETER_IMAGES[image_name(service["image"])] == target, name
            assert name in {"worker-agl-v1", "agl-gateway"}, name
            continue
        assert service["build"]["context"] == "." and IMAGES[image_name(service["image"])] == target, name
        assert target_for(command_argv(service["command"]), found) == target, name
        health = service.get("healthcheck", {}).get("test", [])
        if health[:1] == ["CMD"]:  # the health check runs in the same image
            assert extras_needed(command_argv(health[1:])) <= found[target].extras, name
        targets[name] = target
    assert targets == {
        "store": "lab",
        "webshop": "lab",
        "policy": "lab",
        "worker": "runtime",
        "bridge": "runtime",
        "dispatcher-v1": "runtime",
        "flower": "flower",
        "preflight": "runtime",
        "preflight-v1": "runtime",
        "preflight-rabbitmq": "runtime",
        "preflight-monitoring": "runtime",
    }


def test_target_for_picks_the_leanest_image_that_runs_a_command() -> None:
    found = stages(ROOT / "Dockerfile")
    assert target_for(["celery", "-A", "workers", "worker", "-c", "8"], found) == "runtime"
    assert target_for(["python", "-m", "bridge", "v1"], found) == "runtime"
    assert target_for(["python", "-m", "bridge", "demo"], found) == "lab"
    assert target_for(["python", "-m", "bridge.ops.flower", "--port=5555"], found) == "flower"
    assert target_for(["agl", "store", "--port", "4747"], found) == "lab"
    assert target_for(["python", "-m", "webshop_env.policy"], found) == "lab"
    found["lab"].extras.discard("store")  # a lab image without the Store: nothing runs `agl store`
    with pytest.raises(AssertionError, match="no Dockerfile target installs"):
        target_for(["agl", "store"], found)


def test_grafana_dashboard_uses_exported_series() -> None:
    from bridge.dispatch import metrics as bridge_metrics
    from workers.lifecycle import metrics as worker_metrics

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


# --- Agent Lightning 1.0 (profile agl-v1) and the Dockerfile's build targets ------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def test_every_build_target_is_a_dockerfile_stage_and_the_default_build_is_the_general_image() -> None:
    """Compose's `build.target`s and the image names deploy/kubernetes pulls (`agl-celery-bridge` built without a
    target, `agl-celery-bridge-<stage>` with one) name stages of the Dockerfile; `docker build .` without
    --target (the last stage) builds the general image, not a target's."""
    found = stages(DOCKERFILE)
    assert "worker-agl-v1" in found and list(found)[-1] != "worker-agl-v1"
    services = load(COMPOSE, LOGIN, PROFILES)
    targets = {name: service["build"].get("target") for name, service in services.items() if "build" in service}
    assert targets["worker-agl-v1"] == targets["agl-gateway"] == "worker-agl-v1"
    assert not set(targets.values()) - set(found)
    images = set(re.findall(r"image: (agl-celery-bridge[\w.-]*)", _kubernetes_text()))
    images |= set(re.findall(r"- name: (agl-celery-bridge[\w.-]*)", _kubernetes_text()))
    assert {"agl-celery-bridge", "agl-celery-bridge-worker-agl-v1"} <= images
    for image in images - {"agl-celery-bridge"}:
        assert image.removeprefix("agl-celery-bridge-") in found, image
    stage = found["worker-agl-v1"].text
    assert stage.startswith("FROM ${PYTHON312_BASE_IMAGE} AS")
    default = re.search(r"^ARG PYTHON312_BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), flags=re.M)
    assert default and re.fullmatch(r"python:3\.1[2-9][\w.-]*", default[1]), "1.0 programs need Python >= 3.12"
    assert "ENV" in stage and "AGL_V1_AGENT_PYTHON=/opt/agent/bin/python" in stage
    assert (
        "python -m venv /opt/agent" in stage
        and '/opt/agent/bin/pip install --find-links /tmp/wheels "agentlightning==1.0.0"' in stage
        and "/opt/agent/bin/pip install --no-deps ." in stage  # the project, for the built-in WebShop program
    )
    assert re.search(r"^USER agl$", stage, flags=re.M), "the worker runs as the image's non-root user"


def test_the_1_0_stage_repeats_the_base_stage_line_for_line() -> None:
    """The 1.0 stage cannot build FROM ``base`` (Python 3.12 against 3.11), so it repeats base's setup: the same
    ENV, init, user, WORKDIR, copies and ENTRYPOINT, plus only its own. A change to one that misses the other fails
    here instead of shipping two images that behave differently."""
    found = stages(DOCKERFILE)

    def instructions(stage: str) -> list[str]:
        lines = [" ".join(line.split()) for line in found[stage].text.splitlines()]
        return [line for line in lines if line.split()[0] in ("ENV", "RUN", "WORKDIR", "COPY", "ENTRYPOINT", "USER")]

    def env(stage: str) -> set[str]:
        return {word for line in instructions(stage) if line.startswith("ENV ") for word in line.split()[1:]}

    base, v1 = instructions("base"), instructions("worker-agl-v1")
    assert env("base") and env("base") <= env("worker-agl-v1"), env("base") - env("worker-agl-v1")
    assert env("worker-agl-v1") - env("base") == {"AGL_V1_AGENT_PYTHON=/opt/agent/bin/python"}
    shared = [line for line in base if not line.startswith("ENV ")]
    assert shared and [line for line in v1 if line in shared] == shared, "base's setup, in base's order"


def _kubernetes_text() -> str:
    return "\n".join(path.read_text() for path in sorted((ROOT / "deploy/kubernetes").rglob("*.yaml")))


def test_compose_runs_the_1_0_dispatcher_with_its_key_from_the_environment() -> None:
    """Profile agl-v1: `python -m bridge v1` with its metrics on 9102 (published on loopback, scraped by the
    monitoring profile), the gateway's key only from .env into its environment (never on a command line, not even the
    gateway's own),
    and every 1.0 service on the same gateway URL and queue."""
    key = "a-gateway-key-of-ours"
    services = load(COMPOSE, {**LOGIN, "AGL_V1_KEY": key}, PROFILES)
    dispatcher = services["dispatcher-v1"]
    argv = command_argv(dispatcher["command"])
    assert argv[:4] == ["python", "-m", "bridge", "v1"] and "--key" not in argv
    port = argv[argv.index("--metrics-port") + 1]
    assert port == "9102" and dispatcher["ports"] == [f"127.0.0.1:9102:{port}"]
    assert port in str(dispatcher["healthcheck"]["test"])
    assert dispatcher["depends_on"]["redis"]["condition"] == "service_healthy"
    assert dispatcher["environment"]["AGL_V1_KEY"] == key and "env_file" not in dispatcher
    for name, service in services.items():
        outside = {k: v for k, v in service.items() if k != "environment"}
        assert key not in json.dumps(outside), f"{name} carries the key outside its environment"
    gateway = command_argv(services["agl-gateway"]["command"])
    assert "key=${oc.env:AGL_V1_KEY}" in gateway  # Hydra reads it from the environment
    worker = services["worker-agl-v1"]
    worker_argv = command_argv(worker["command"])
    queue = worker_argv[worker_argv.index("-Q") + 1]
    for name in ("dispatcher-v1", "worker-agl-v1"):
        environment = services[name]["environment"]
        assert environment["AGL_V1_SERVER_URL"] == "http://agl-gateway:8080", name
        assert environment["CELERY_DEFAULT_QUEUE"] == queue == "rollouts-v1", name
    scraped = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scraped for c in job.get("static_configs", []) for t in c["targets"]]
    assert f"dispatcher-v1:{port}" in targets
    assert ["worker-agl-v1"] in [c["names"] for job in scraped for c in job.get("dns_sd_configs", [])]
    outside = load(COMPOSE, {**LOGIN, "AGL_V1_SERVER_URL": "http://gateway.example:8080"}, ("agl-v1",))
    assert outside["dispatcher-v1"]["environment"]["AGL_V1_SERVER_URL"] == "http://gateway.example:8080"


def test_compose_sizes_the_1_0_worker_by_the_documented_rule() -> None:
    """worker-agl-v1's mem_limit holds its -c slots of 1.0 programs, each with its full disk quota, by
    docs/performance.md's rule and figures; the quota figure is the one compose's workers run with."""
    worker = load(COMPOSE, LOGIN, ("agl-v1",))["worker-agl-v1"]
    default = Settings.model_fields["agl_v1_program_disk_mb"].default
    quota = worker["environment"].get("AGL_V1_PROGRAM_DISK_MB") or default
    assert v1_sizing_figures(ROOT / "docs/performance.md")["disk"] == int(quota)
    argv = command_argv(worker["command"])
    slots = int(argv[argv.index("-c") + 1])
    number, unit = re.fullmatch(r"(\d+)([kmg])", worker["mem_limit"]).groups()  # type: ignore[union-attr]
    limit_mib = int(number) * {"k": 1 / 1024, "m": 1, "g": 1024}[unit]
    assert limit_mib >= v1_worker_memory_mib(slots, ROOT / "docs/performance.md")
    assert limit_mib < v1_worker_memory_mib(2 * slots, ROOT / "docs/performance.md")  # and not slots twice over


def test_the_1_0_workers_inits_run_as_root_and_the_worker_as_agl_with_only_what_boxes_need() -> None:
    """docs/agl-v1.md, "The container's inits": the inits hold the container's environment, so they run as root (no
    program reads them) with only what setpriv needs, and the worker as agl with SETUID, SETGID and SYS_ADMIN
    alone, which its programs' boxes need ("Boxes": their uids, their PID namespaces;
    tests/deployed/test_agl_v1_stack.py reads the processes in the running container)."""
    service = load(COMPOSE, LOGIN, ["agl-v1"])["worker-agl-v1"]
    assert service["user"] == "0:0" and service["cap_drop"] == ["ALL"] and service["init"] is True
    assert sorted(service["cap_add"]) == ["KILL", "SETGID", "SETPCAP", "SETUID", "SYS_ADMIN"]  # KILL: tini's signals
    command = service["command"]
    setpriv, worker = command[: command.index("sh")], command[command.index("sh") :]
    assert setpriv[0] == "setpriv" and {"--reuid=agl", "--regid=agl", "--clear-groups", "--no-new-privs"} <= set(
        setpriv
    )
    kept = "-all,+setuid,+setgid,+sys_admin"
    assert {f"--inh-caps={kept}", f"--ambient-caps={kept}", f"--bounding-set={kept}"} <= set(setpriv)
    assert service["environment"].get("AGL_V1_ISOLATION") in (None, "box")
    assert service["environment"].get("AGL_V1_PROGRAM_PID_NAMESPACE") in (None, "true")
    # a name without a value would unset the image's ENV: the programs would run under the worker's interpreter
    assert service["environment"]["AGL_V1_AGENT_PYTHON"] == "/opt/agent/bin/python"
    assert worker[:2] == ["sh", "-c"] and worker[2].startswith("exec celery -A workers worker")
    assert service["environment"]["HOME"] == "/home/agl"


def _requirements_script() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_requirements", ROOT / "deploy" / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dependency_layers_install_what_pip_would_for_each_target() -> None:
    """deploy/requirements.py lists the project's dependencies plus each extra's, following the extras that name
    the project (``lab`` names ``agl-celery-bridge[flower]``), so the layers the Dockerfile installs before the
    source hold what ``pip install ".[extras]"`` resolves; an unknown extra stops the build."""
    script = _requirements_script()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert script.requirements(pyproject, []) == project["dependencies"]
    lab = script.requirements(pyproject, ["store", "lab"])
    optional = project["optional-dependencies"]
    expected = [*optional["store"], *optional["lab"], *optional["flower"]]
    assert set(lab) == set(project["dependencies"]) | {line for line in expected if "agl-celery-bridge" not in line}
    assert len(lab) == len(set(lab)) and not any(line.startswith("agl-celery-bridge") for line in lab)
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        script.requirements(pyproject, ["nope"])
    no_deps = [stage for stage in stages(DOCKERFILE).values() if "pip install --no-deps" in stage.text]
    assert {stage.name for stage in no_deps} == {"product", "lab", "worker-agl-v1"}
    for stage in no_deps:  # the stage that installs the project without its dependencies installed them first
        assert stage.text.index("python requirements.py") < stage.text.index("pip install --no-deps"), stage.name
