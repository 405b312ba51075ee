"""deploy/kubernetes renders and is valid, offline: every overlay is built with the kustomize subset of
``tests/kustomize.py``, each manifest validated against the Kubernetes schemas bundled by ``kubernetes-validate``
(strict: unknown fields fail) and the ScaledObject against KEDA's vendored CRD schema, made strict the same way.
The manifests are also checked against the project: commands and settings that exist, the autoscalers' target
equal to a worker pod's slots, a grace period above the rollout budget, secrets never in the ConfigMap, and each
container taking from the Secrets only the keys its code reads (read from the source by
``tests/settings_readers.py``, as for docker-compose.yml). A deliberately broken copy of each kind of manifest is
rejected, so the validation is shown to bite.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bridge.core.settings import Settings, env_name, load_settings
from bridge.core.task import hard_time_limit, soft_time_limit
from bridge.dispatch import metrics
from bridge.ops.flower import login_problem
from tests.compose import v1_worker_memory_mib
from tests.images import IMAGES, INTERPRETER_IMAGES, command_argv, image_name, stages, target_for
from tests.kustomize import Manifest, Unsupported, load_documents, merge, render
from tests.settings_readers import ENTRIES, SECRET_SETTINGS, STORE_CLIENT, settings_read
from workers.agents import webshop_program

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/kubernetes"
OVERLAYS = sorted(path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.32"  # validated against this release's API schemas
SETTINGS = {env_name(name) for name in Settings.model_fields}
NON_SETTINGS = {
    "FLOWER_BASIC_AUTH",  # Flower
    "FLOWER_READ_ONLY",
    "HOME",  # the 1.0 workers', set where setpriv leaves root's (overlays/agl-v1)
    "LITELLM_LOCAL_MODEL_COST_MAP",
    "PROMETHEUS_MULTIPROC_DIR",
    "REDIS_PASSWORD",  # the Redis container of components/redis
    "REDISCLI_AUTH",
}
SECRET_NAMES = SECRET_SETTINGS | {"FLOWER_BASIC_AUTH"}
[DESIRED] = [m.name for m in metrics.DESIRED_SLOTS.describe()]  # the series the bridge exports, not a copy


def strict(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema with every object that lists its properties closed to others (the API server's
    strict field validation), unless it preserves unknown fields."""
    if isinstance(schema, dict):
        closed = {key: strict(value) for key, value in schema.items()}
        open_ = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_:
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


KEDA_SCHEMA = strict(json.loads((K8S / "schemas/keda.sh_scaledobject_v1alpha1.json").read_text()))


def validate(manifest: Manifest) -> None:
    """Raise a jsonschema ValidationError (or a schema lookup error) unless ``manifest`` is valid."""
    if manifest["apiVersion"] == "keda.sh/v1alpha1" and manifest["kind"] == "ScaledObject":
        jsonschema.Draft7Validator(KEDA_SCHEMA).validate(manifest)
        spec = manifest["spec"]  # the CRD's one CEL rule, which jsonschema cannot evaluate
        assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), "minReplicaCount > maxReplicaCount"
        return
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {path.name: render(path) for path in OVERLAYS}


def find(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def container(manifests: list[Manifest], name: str) -> Manifest:
    return dict(find(manifests, "Deployment", name)["spec"]["template"]["spec"]["containers"][0])


def test_every_overlay_renders_to_valid_manifests(rendered: dict[str, list[Manifest]]) -> None:
    assert {"example", "external-broker", "agl-v1"} <= set(rendered)
    for overlay, manifests in rendered.items():
        assert manifests, overlay
        for manifest in manifests:
            validate(manifest)
            assert manifest["metadata"]["namespace"] == "agl", (overlay, manifest["metadata"])


def test_a_misspelled_field_is_rejected(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["example"]
    worker = copy.deepcopy(find(manifests, "Deployment", "agl-worker"))
    pod = worker["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(jsonschema.ValidationError, match="terminationGracePeriodSecond"):
        validate(worker)
    wrong_type = copy.deepcopy(find(manifests, "Deployment", "agl-bridge"))
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(wrong_type)
    scaled = copy.deepcopy(find(manifests, "ScaledObject", "agl-worker"))
    scaled["spec"]["maxReplicaCounts"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="maxReplicaCounts"):
        validate(scaled)
    scaled = copy.deepcopy(find(manifests, "ScaledObject", "agl-worker"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 128  # trigger metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    hpa = copy.deepcopy(find(rendered["external-broker"], "HorizontalPodAutoscaler", "agl-worker"))
    hpa["spec"]["metrics"][0]["external"]["target"]["averageValu"] = "128"
    with pytest.raises(jsonschema.ValidationError, match="averageValu"):
        validate(hpa)


def test_the_renderer_merges_like_kustomize_and_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    target = {"spec": {"containers": [{"name": "a", "image": "x", "args": ["1"]}, {"name": "b"}], "drop": 1}}
    patch = {"spec": {"containers": [{"name": "a", "args": ["2"]}, {"name": "c"}], "drop": None}}
    assert merge(target, patch) == {
        "spec": {"containers": [{"name": "a", "image": "x", "args": ["2"]}, {"name": "b"}, {"name": "c"}]}
    }
    (tmp_path / "kustomization.yaml").write_text("kind: Kustomization\nresources: []\nconfigMapGenerator: []\n")
    with pytest.raises(Unsupported, match="configMapGenerator"):
        render(tmp_path)


def test_keda_and_hpa_are_never_both_active(rendered: dict[str, list[Manifest]]) -> None:
    kinds = {overlay: {m["kind"] for m in manifests} for overlay, manifests in rendered.items()}
    for overlay, present in kinds.items():
        assert len({"ScaledObject", "HorizontalPodAutoscaler"} & present) == 1, (overlay, present)
    assert "ScaledObject" in kinds["example"] and "HorizontalPodAutoscaler" in kinds["external-broker"]


def test_autoscalers_target_one_worker_pods_slots_on_the_desired_slots_series(
    rendered: dict[str, list[Manifest]],
) -> None:
    worker = container(rendered["example"], "agl-worker")
    argv = worker["command"] + worker["args"]
    slots = int(argv[argv.index("-c") + 1])
    assert argv[argv.index("-P") + 1] == "threads" and argv[argv.index("-Q") + 1] == "rollouts"
    scaled = find(rendered["example"], "ScaledObject", "agl-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "agl-worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert int(trigger["metadata"]["threshold"]) == slots
    assert f'{DESIRED}{{queue="rollouts"}}' in trigger["metadata"]["query"]
    hpa = find(rendered["external-broker"], "HorizontalPodAutoscaler", "agl-worker")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": DESIRED, "selector": {"matchLabels": {"queue": "rollouts"}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": str(slots)}
    (rule,) = yaml.safe_load((K8S / "components/hpa/prometheus-adapter-rules.yaml").read_text())["externalRules"]
    assert rule["name"]["as"] == DESIRED and rule["seriesQuery"].startswith(DESIRED + "{")
    # replicas = ceil(desired / slots per pod): 129 desired slots need 2 pods of 128
    assert math.ceil((slots + 1) / slots) == 2


def test_worker_grace_period_outlasts_the_drain_and_probes_read_its_advert(
    rendered: dict[str, list[Manifest]],
) -> None:
    manifests = rendered["example"]
    config = find(manifests, "ConfigMap", "agl-config")["data"]
    pod = find(manifests, "Deployment", "agl-worker")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    if "WORKER_SHUTDOWN_GRACE_S" in config:  # a bounded drain: the worker is gone within it
        assert grace >= float(config["WORKER_SHUTDOWN_GRACE_S"]) + 5
    else:  # the drain waits for every episode: the rollout budget bounds it
        budget = float(config.get("ROLLOUT_DEFAULT_TIMEOUT_S", Settings.model_fields["default_timeout_s"].default))
        settings = Settings.model_construct(default_timeout_s=budget)
        assert grace >= budget + 60 > hard_time_limit(settings, None) > soft_time_limit(settings, None)
    worker = container(manifests, "agl-worker")
    argv = worker["command"] + worker["args"]
    assert argv[:2] == ["tini", "--"], argv  # an init as PID 1: it reaps agent programs' orphans
    argv = argv[2:]
    assert argv[:4] == ["celery", "-A", "workers", "worker"] and argv[argv.index("-n") + 1] == "worker@%h"
    probe = worker["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["python", "-m", "workers.lifecycle.health"] and importlib.util.find_spec(probe[2])
    assert probe[probe.index("-Q") + 1] == argv[argv.index("-Q") + 1]
    assert worker["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert worker["ports"] == [{"name": "metrics", "containerPort": int(config["WORKER_METRICS_PORT"])}]


def test_bridge_runs_leader_and_standby_and_is_scraped(rendered: dict[str, list[Manifest]]) -> None:
    for manifests in rendered.values():
        bridge = find(manifests, "Deployment", "agl-bridge")
        assert bridge["spec"]["replicas"] == 2
        template = bridge["spec"]["template"]
        argv = template["spec"]["containers"][0]["command"]
        assert argv[:4] == ["python", "-m", "bridge", "run"]
        port = argv[argv.index("--metrics-port") + 1]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == port
        assert template["spec"]["containers"][0]["ports"][0]["containerPort"] == int(port)


def _env_names(manifests: list[Manifest]) -> set[str]:
    """Every variable a container gets: its ``env`` and the keys of the ConfigMaps and Secrets it loads whole."""
    names: set[str] = set()
    loaded: set[tuple[str, str]] = set()
    for manifest in manifests:
        if manifest["kind"] in {"Deployment", "StatefulSet"}:
            for item in manifest["spec"]["template"]["spec"]["containers"]:
                names |= {env["name"] for env in item.get("env", [])}
                for source in item.get("envFrom", []):
                    loaded |= {("ConfigMap", source["configMapRef"]["name"])} if "configMapRef" in source else set()
                    loaded |= {("Secret", source["secretRef"]["name"])} if "secretRef" in source else set()
    for manifest in manifests:
        if (manifest["kind"], manifest["metadata"]["name"]) in loaded:
            names |= set(manifest.get("data") or {}) | set(manifest.get("stringData") or {})
    return names


def test_configuration_uses_settings_and_keeps_secrets_out_of_config_maps(
    rendered: dict[str, list[Manifest]],
) -> None:
    for overlay, manifests in rendered.items():
        unknown = _env_names(manifests) - SETTINGS - NON_SETTINGS
        assert not unknown, (overlay, unknown)
        for config in (m for m in manifests if m["kind"] == "ConfigMap"):
            assert not set(config["data"]) & SECRET_NAMES, (overlay, config["metadata"]["name"])
        flower = container(manifests, "agl-flower")
        (auth,) = [env for env in flower["env"] if env["name"] == "FLOWER_BASIC_AUTH"]
        secret = find(manifests, "Secret", auth["valueFrom"]["secretKeyRef"]["name"])
        assert ":" in secret["stringData"]["FLOWER_BASIC_AUTH"]
        assert "FLOWER_BASIC_AUTH" not in find(manifests, "Secret", "agl-secrets")["stringData"]


def test_commands_exist_in_the_project(rendered: dict[str, list[Manifest]]) -> None:
    for manifests in rendered.values():
        for manifest in manifests:
            if manifest["kind"] not in {"Deployment", "StatefulSet"}:
                continue
            for item in manifest["spec"]["template"]["spec"]["containers"]:
                argv = item.get("command") or item.get("args")
                if item["image"].startswith("redis:"):
                    continue
                argv = command_argv(argv)  # the image's init, where a command replaces its ENTRYPOINT, and setpriv
                assert argv[0] in {"python", "celery"}, argv
                if argv[0] == "python":
                    assert argv[1] == "-m" and importlib.util.find_spec(argv[2]), argv
                else:
                    assert argv[1:3] == ["-A", "workers"] and argv[3] in {"worker", "flower"}, shlex.join(argv)


def test_each_container_runs_the_leanest_image_that_has_what_its_command_needs(
    rendered: dict[str, list[Manifest]],
) -> None:
    """The workers and the bridge run the Dockerfile's ``runtime`` target (the product alone), Flower its
    ``flower`` target and the WebShop server its ``lab`` target, each under that target's image name
    (``tests/images.py``), renamed by the overlay to the registry's."""
    found = stages(ROOT / "Dockerfile")
    for overlay, manifests in rendered.items():
        images: dict[str, str] = {}
        for manifest in manifests:
            if manifest["kind"] not in {"Deployment", "StatefulSet"}:
                continue
            for item in manifest["spec"]["template"]["spec"]["containers"]:
                if item["image"].startswith("redis:"):
                    continue
                assert item["image"].startswith("registry.example.com/"), (overlay, item["image"])
                if image_name(item["image"]) in INTERPRETER_IMAGES:  # the 1.0 workers: Python 3.12, agentlightning 1.0
                    assert manifest["metadata"]["name"] == "agl-worker" and overlay == "agl-v1", (overlay, item)
                    images["agl-worker"] = INTERPRETER_IMAGES[image_name(item["image"])]
                    continue
                target = IMAGES[image_name(item["image"])]
                assert target_for(command_argv(item.get("command") or item.get("args")), found) == target, item
                images[manifest["metadata"]["name"]] = target
        worker = "worker-agl-v1" if overlay == "agl-v1" else "runtime"
        assert images["agl-worker"] == worker and images["agl-bridge"] == "runtime", (overlay, images)
        assert (images["agl-flower"], images["agl-webshop"]) == ("flower", "lab"), (overlay, images)


def test_every_yaml_file_is_rendered_or_documented() -> None:
    """Each manifest file belongs to a kustomization (the adapter rules are a config file, said so)."""
    listed: set[Path] = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = load_documents(kustomization)[0]
        listed |= {(kustomization.parent / e).resolve() for e in spec.get("resources", [])}
        listed |= {(kustomization.parent / e["path"]).resolve() for e in spec.get("patches", [])}
    files = {path.resolve() for path in K8S.rglob("*.yaml") if path.name != "kustomization.yaml"}
    assert files - listed == {(K8S / "components/hpa/prometheus-adapter-rules.yaml").resolve()}


@pytest.mark.parametrize("overlay", [path.name for path in OVERLAYS])
def test_the_pods_settings_load(
    overlay: str, rendered: dict[str, list[Manifest]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the ConfigMap and agl-secrets give the bridge and the workers passes the settings' own checks."""
    monkeypatch.chdir(tmp_path)  # no .env
    for name in SETTINGS | NON_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    manifests = rendered[overlay]
    env = {**find(manifests, "ConfigMap", "agl-config")["data"]}
    env.update(find(manifests, "Secret", "agl-secrets")["stringData"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.default_queue == "rollouts" and settings.worker_metrics_port == 9101


def test_the_autoscalers_comments_state_the_workers_grace_period(rendered: dict[str, list[Manifest]]) -> None:
    """The drain the autoscalers' scale-down comments describe is the workers' real grace period."""
    workers = find(rendered["example"], "Deployment", "agl-worker")
    grace = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    for name in ("components/hpa/hpa.yaml", "components/keda/scaledobject.yaml"):
        stated = re.findall(r"grace period \((\d+) s", (K8S / name).read_text())
        assert stated == [str(grace)], f"{name} states a grace period of {stated}, the workers have {grace} s"


@pytest.mark.parametrize(
    ("base_overlay", "scraped"),
    [("example", ["agl-bridge", "agl-worker"]), ("agl-v1", ["agl-bridge", "agl-dispatcher-v1", "agl-worker"])],
)
def test_the_optional_pod_monitor_scrapes_the_bridge_and_worker_pods(
    base_overlay: str, scraped: list[str], rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """components/podmonitor, added to an overlay, selects the bridge (and 1.0 dispatcher) and worker pods and
    scrapes the port they name ``metrics`` at /metrics (kube-prometheus-stack ignores the ``prometheus.io/*``
    annotations)."""
    overlay = tmp_path / "monitored"
    overlay.mkdir()
    base, component = (
        os.path.relpath(K8S / "overlays" / base_overlay, overlay),
        os.path.relpath(K8S / "components/podmonitor", overlay),
    )
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: agl\n"
        f"resources: [{base}]\ncomponents: [{component}]\n"
    )
    manifests = render(overlay)
    (monitor,) = [m for m in manifests if m["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == "agl"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    selected = []
    for deployment in (m for m in manifests if m["kind"] == "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matches = all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()) and all(
            labels.get(e["key"]) in e["values"] for e in spec["selector"]["matchExpressions"]
        )
        if matches:
            selected.append(deployment["metadata"]["name"])
            ports = {
                p.get("name") for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
            }
            assert endpoint["port"] in ports, f"{deployment['metadata']['name']} has no port {endpoint['port']!r}"
    assert sorted(selected) == scraped
    assert not any(m["kind"] == "PodMonitor" for overlay_manifests in rendered.values() for m in overlay_manifests)


# --- safe defaults: each check returns its findings, so a broken copy can show that it bites ---------------


def _workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in {"Deployment", "StatefulSet"}]


def _selects(selector: Manifest, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) selects ``labels``."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for rule in selector.get("matchExpressions") or []:
        key, op, values = rule["key"], rule["operator"], rule.get("values") or []
        if not {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]:
            return False
    return True


def parse_quantity(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity (``2Gi``, ``512Mi``, ``1G``, ``1000``)."""
    number, suffix = re.fullmatch(r"(\d+)([KMGT]i?)?", quantity).groups()  # type: ignore[union-attr]
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    scale = 1 if not suffix else (1024 if suffix.endswith("i") else 1000) ** powers[suffix[0]]
    return int(number) * scale


def _secret_value(manifests: list[Manifest], ref: Manifest) -> str:
    return str(find(manifests, "Secret", ref["name"])["stringData"][ref["key"]])


def redis_findings(manifests: list[Manifest]) -> list[str]:
    """An in-cluster Redis must want a password from a Secret that every client URL carries, bound its memory
    below the container's limit and never evict (a lease or done marker evicted lets a rollout run twice)."""
    found: list[str] = []
    urls = find(manifests, "Secret", "agl-secrets")["stringData"]
    for name in ("CELERY_BROKER_URL", "REDIS_URL"):
        if not urlsplit(urls[name]).password:
            found.append(f"{name} carries no password")
    for redis_set in [m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == "agl-redis"]:
        (redis,) = redis_set["spec"]["template"]["spec"]["containers"]
        args, env = redis["args"], {e["name"]: e for e in redis.get("env", [])}
        option = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
        if option.get("--requirepass") != "$(REDIS_PASSWORD)" or "secretKeyRef" not in env.get(
            "REDIS_PASSWORD", {}
        ).get("valueFrom", {}):
            found.append("Redis takes no password from a Secret")
            continue
        password = _secret_value(manifests, env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"])
        for name in ("CELERY_BROKER_URL", "REDIS_URL"):
            url = urlsplit(urls[name])
            if url.hostname == "agl-redis" and unquote(url.password or "") != password:
                found.append(f"{name} does not carry Redis's password")
        if env.get("REDISCLI_AUTH", {}).get("valueFrom") != env["REDIS_PASSWORD"]["valueFrom"]:
            found.append("the probes' redis-cli has no password")
        if option.get("--maxmemory-policy") != "noeviction":
            found.append(f"maxmemory-policy {option.get('--maxmemory-policy')!r}, not noeviction")
        limit = parse_quantity(redis["resources"]["limits"]["memory"])
        maxmemory = option.get("--maxmemory", "0").lower()
        number, unit = re.fullmatch(r"(\d+)(b|kb|mb|gb)?", maxmemory).groups()  # type: ignore[union-attr]
        bytes_ = int(number) * {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}[unit or "b"]
        if not 0 < bytes_ <= 0.8 * limit:
            found.append(f"--maxmemory {maxmemory} is not within 80% of the memory limit {limit}")
    return found


def network_findings(manifests: list[Manifest]) -> list[str]:
    """An in-cluster Redis admits only the bridge, the workers and Flower, on its port."""
    redis_sets = [m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == "agl-redis"]
    if not redis_sets:
        return []
    redis_labels = redis_sets[0]["spec"]["template"]["metadata"]["labels"]
    policies = [
        m for m in manifests if m["kind"] == "NetworkPolicy" and _selects(m["spec"]["podSelector"], redis_labels)
    ]
    if not policies:
        return ["no NetworkPolicy selects Redis"]
    admitted: set[str] = set()
    for policy in policies:
        if "Ingress" not in policy["spec"].get("policyTypes", ["Ingress"]):
            continue
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("from"):
                return [f"{policy['metadata']['name']} admits every source"]
            if [p.get("port") for p in rule.get("ports", [])] not in (["redis"], [6379]):
                return [f"{policy['metadata']['name']} admits ports other than Redis's"]
            for peer in rule["from"]:
                if set(peer) != {"podSelector"}:
                    return [f"{policy['metadata']['name']} admits {sorted(peer)}"]
                admitted |= {
                    m["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                    for m in _workloads(manifests)
                    if _selects(peer["podSelector"], m["spec"]["template"]["metadata"]["labels"])
                }
    clients = {
        m["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for m in _workloads(manifests)
    }
    expected = clients & REDIS_CLIENTS
    return [] if admitted == expected else [f"Redis admits {sorted(admitted)}, not {sorted(expected)}"]


REDIS_CLIENTS = {"bridge", "dispatcher-v1", "worker", "flower"}  # the components that use the broker or Redis


def filesystem_findings(manifests: list[Manifest]) -> list[str]:
    """Every container's root filesystem is read-only, with /tmp writable on an emptyDir."""
    found: list[str] = []
    for workload in _workloads(manifests):
        pod = workload["spec"]["template"]["spec"]
        empty = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for item in pod["containers"]:
            where = f"{workload['metadata']['name']}/{item['name']}"
            if (item.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
                found.append(f"{where}: root filesystem writable")
            tmp = [m["name"] for m in item.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            if tmp != [n for n in tmp if n in empty] or not tmp:
                found.append(f"{where}: /tmp is not an emptyDir")
    return found


def disruption_findings(manifests: list[Manifest]) -> list[str]:
    """A node drain takes worker pods one at a time, each draining its episodes first."""
    labels = find(manifests, "Deployment", "agl-worker")["spec"]["template"]["metadata"]["labels"]
    budgets = [m for m in manifests if m["kind"] == "PodDisruptionBudget" and _selects(m["spec"]["selector"], labels)]
    if len(budgets) != 1:
        return [f"{len(budgets)} PodDisruptionBudgets select the workers"]
    return [] if budgets[0]["spec"].get("maxUnavailable") == 1 else ["the workers' budget is not maxUnavailable 1"]


def flower_findings(manifests: list[Manifest]) -> list[str]:
    """Flower runs read-only (no task sent by name, no revoke, no pool control) behind the login check."""
    flower = container(manifests, "agl-flower")
    env = {e["name"]: e for e in flower.get("env", [])}
    found = []
    if flower["command"][:3] != ["python", "-m", "bridge.ops.flower"]:
        found.append("Flower starts without the login check")
    if str(env.get("FLOWER_READ_ONLY", {}).get("value", "")).lower() != "true":
        found.append("Flower's API can send tasks (FLOWER_READ_ONLY is not true)")
    if "FLOWER_UNAUTHENTICATED_API" in env:
        found.append("Flower's API is open without a login")
    return found


# --- Secrets: each container takes from them only the keys its code reads -----------------------------------

COMMANDS = {  # Deployment of ours -> what its container runs (ENTRIES of tests/settings_readers.py)
    "agl-bridge": "bridge",
    "agl-dispatcher-v1": "dispatcher-v1",
    "agl-worker": "worker",
    "agl-flower": "flower",
    "agl-webshop": "webshop",
}
NOT_NEEDED: dict[str, dict[str, str]] = {  # command -> secret setting its modules read but its pod needs not: why
    "dispatcher-v1": dict.fromkeys(
        SECRET_SETTINGS & set(STORE_CLIENT), "it makes no Store request (its Store URL names the Redis key scope)"
    ),
    "flower": dict.fromkeys(SECRET_SETTINGS & set(STORE_CLIENT), "Flower makes no Store request"),
}
V1_ONLY = {"AGL_V1_KEY": "the 1.0 line's: an overlay without AGL_V1_SERVER_URL runs no 1.0 rollout"}
OTHER_SECRETS = {"agl-flower": {"FLOWER_BASIC_AUTH"}, "agl-redis": {"password"}}  # read by Flower, Redis themselves
HOLDERS = {  # key of the Secrets -> the workloads whose containers may get it, in some overlay
    "CELERY_BROKER_URL": {"agl-bridge", "agl-dispatcher-v1", "agl-worker", "agl-flower"},
    "REDIS_URL": {"agl-bridge", "agl-dispatcher-v1", "agl-worker", "agl-flower"},
    "AGENT_LIGHTNING_STORE_TOKEN": {"agl-bridge", "agl-worker"},
    "OPENAI_API_KEY": {"agl-worker"},
    "WEBSHOP_TOKEN": {"agl-worker"},
    "AGL_V1_KEY": {"agl-dispatcher-v1", "agl-worker"},
    "FLOWER_BASIC_AUTH": {"agl-flower"},
    "password": {"agl-redis"},
}


def listed_secret_keys(manifests: list[Manifest]) -> dict[str, set[str]]:
    """Secret -> its keys: those the overlay sets, and those overlays/example/secrets.yaml lists as comments for
    the operator to add (``# NAME: value``), which a Secret of that name may also hold."""
    keys = {
        m["metadata"]["name"]: set(m.get("stringData") or {}) | set(m.get("data") or {})
        for m in manifests
        if m["kind"] == "Secret"
    }
    for document in re.split(r"^---$", (K8S / "overlays/example/secrets.yaml").read_text(), flags=re.M):
        name = yaml.safe_load(document)["metadata"]["name"]
        if name in keys:
            keys[name] |= set(re.findall(r"^\s+#\s*([A-Z][A-Z0-9_]*):", document, flags=re.M))
    return keys


def secrets_given(pod: Manifest, item: Manifest, listed: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """(the keys of the Secrets that reach container ``item``, those of them its code finds: variables, and key
    files its command names); a whole Secret (``envFrom``) brings every key ``listed`` for it."""
    given: set[str] = set()
    provided: set[str] = set()
    for source in item.get("envFrom", []):
        if "secretRef" in source:
            given |= listed.get(source["secretRef"]["name"], set())
            provided |= listed.get(source["secretRef"]["name"], set())
    for env in item.get("env", []):
        if "secretKeyRef" in env.get("valueFrom", {}):
            given.add(env["valueFrom"]["secretKeyRef"]["key"])
            provided.add(env["name"])
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    argv = json.dumps([item.get("command"), item.get("args")])
    for mount in item.get("volumeMounts", []):
        if mount["name"] in volumes:
            secret = volumes[mount["name"]]
            items = secret.get("items") or [{"key": k, "path": k} for k in listed.get(secret["secretName"], set())]
            given |= {i["key"] for i in items}
            provided |= {i["key"] for i in items if f"{mount['mountPath']}/{i['path']}" in argv}
    return given, provided


def secrets_wanted(workload: Manifest, config: dict[str, str]) -> set[str] | None:
    """The keys of the Secrets ``workload``'s container reads: the secret settings its command's modules read
    (tests/settings_readers.py) but those ``NOT_NEEDED``, and what Flower and Redis read themselves; None for a
    workload this file does not know."""
    name = workload["metadata"]["name"]
    wanted = set(OTHER_SECRETS.get(name, set()))
    if name not in COMMANDS:
        return wanted if name in OTHER_SECRETS else None
    command = COMMANDS[name]
    wanted |= settings_read(ENTRIES[command]) & SECRET_SETTINGS
    wanted -= set(NOT_NEEDED.get(command, {}))
    return wanted if "AGL_V1_SERVER_URL" in config else wanted - set(V1_ONLY)


def secret_findings(manifests: list[Manifest]) -> list[str]:
    """Each container takes single keys of the Secrets (``secretKeyRef``, a mounted key file; never a whole Secret
    with ``envFrom``): those ``secrets_wanted``, and nothing else. A key the overlay's Secret may lack is
    ``optional: true``, so that a pod starts without it."""
    found: list[str] = []
    listed = listed_secret_keys(manifests)
    config = find(manifests, "ConfigMap", "agl-config")["data"]
    for workload in _workloads(manifests):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        wanted = secrets_wanted(workload, config)
        if wanted is None:
            found.append(f"{name}: not in COMMANDS, so what it reads is unknown")
            continue
        for item in pod["containers"]:
            where = f"{name}/{item['name']}"
            found += [
                f"{where} loads the Secret {s['secretRef']['name']} whole"
                for s in item.get("envFrom", [])
                if "secretRef" in s
            ]
            for env in item.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                if ref["key"] not in listed.get(ref["name"], set()):
                    found.append(f"{where}: {env['name']} from {ref['name']}/{ref['key']}, a key no Secret lists")
                elif ref["key"] not in find(manifests, "Secret", ref["name"]).get("stringData", {}) and not ref.get(
                    "optional"
                ):
                    found.append(f"{where}: {env['name']} is not optional, and {ref['name']} may lack it")
            given, provided = secrets_given(pod, item, listed)
            if name in COMMANDS and wanted - provided:
                found.append(f"{where} reads {sorted(wanted - provided)}, which it is not given")
            if given - wanted:
                found.append(f"{where} gets {sorted(given - wanted)}, which it never reads")
    return found


CHECKS = [redis_findings, network_findings, filesystem_findings, disruption_findings, flower_findings, secret_findings]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_every_overlay_has_the_safe_defaults(check: Any, rendered: dict[str, list[Manifest]]) -> None:
    for overlay, manifests in rendered.items():
        assert check(manifests) == [], overlay
    assert any(m["kind"] == "NetworkPolicy" for m in rendered["example"])  # the overlay with in-cluster Redis


def _mutated(manifests: list[Manifest], kind: str, name: str, change: Any) -> list[Manifest]:
    copied = copy.deepcopy(manifests)
    change(find(copied, kind, name))
    return copied


def test_the_safe_default_checks_bite(rendered: dict[str, list[Manifest]]) -> None:
    m = rendered["example"]

    def redis_container(s: Manifest) -> Manifest:
        return dict(s["spec"]["template"]["spec"]["containers"][0])

    def set_arg(option: str, value: str) -> Any:
        def change(s: Manifest) -> None:
            args = redis_container(s)["args"]
            args[args.index(option) + 1] = value

        return change

    assert redis_findings(_mutated(m, "StatefulSet", "agl-redis", set_arg("--maxmemory-policy", "allkeys-lru")))
    assert redis_findings(_mutated(m, "StatefulSet", "agl-redis", set_arg("--maxmemory", "4gb")))
    assert redis_findings(_mutated(m, "StatefulSet", "agl-redis", set_arg("--requirepass", "")))
    assert redis_findings(
        _mutated(m, "Secret", "agl-secrets", lambda s: s["stringData"].update(REDIS_URL="redis://agl-redis:6379/0"))
    )
    assert redis_findings(_mutated(m, "Secret", "agl-redis", lambda s: s["stringData"].update(password="other")))
    open_to_all = _mutated(
        m, "NetworkPolicy", "agl-redis", lambda p: p["spec"]["ingress"][0]["from"][0].update(podSelector={})
    )
    assert network_findings(open_to_all) == [
        "Redis admits ['bridge', 'flower', 'redis', 'webshop', 'worker'], not ['bridge', 'flower', 'worker']"
    ]
    v1 = rendered["agl-v1"]
    shut_out = _mutated(
        v1,
        "NetworkPolicy",
        "agl-redis",
        lambda p: p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][1].update(
            values=["bridge", "worker", "flower"]
        ),
    )
    assert network_findings(shut_out) == [
        "Redis admits ['bridge', 'flower', 'worker'], not ['bridge', 'dispatcher-v1', 'flower', 'worker']"
    ]
    assert network_findings([x for x in m if x["kind"] != "NetworkPolicy"]) == ["no NetworkPolicy selects Redis"]

    def writable(d: Manifest) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop("readOnlyRootFilesystem")

    assert filesystem_findings(_mutated(m, "Deployment", "agl-bridge", writable)) == [
        "agl-bridge/bridge: root filesystem writable"
    ]
    assert disruption_findings([x for x in m if x["kind"] != "PodDisruptionBudget" or "worker" not in str(x)])

    def writable_api(d: Manifest) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "FLOWER_READ_ONLY", "value": "false"})
        d["spec"]["template"]["spec"]["containers"][0]["env"] = [
            e for e in d["spec"]["template"]["spec"]["containers"][0]["env"] if e.get("value") != "true"
        ]

    assert flower_findings(_mutated(m, "Deployment", "agl-flower", writable_api))


def test_the_example_flower_login_is_refused_until_replaced(rendered: dict[str, list[Manifest]]) -> None:
    """The overlays' placeholder login is what `python -m bridge.ops.flower` refuses (tests/unit/test_flower.py)."""
    for overlay, manifests in rendered.items():
        login = find(manifests, "Secret", "agl-flower-auth")["stringData"]["FLOWER_BASIC_AUTH"]
        assert login_problem({"FLOWER_BASIC_AUTH": login}), overlay


# --- Agent Lightning 1.0: overlays/agl-v1 and components/agl-v1 --------------------------------------------------


def test_each_overlays_autoscaler_targets_its_worker_pods_slots(rendered: dict[str, list[Manifest]]) -> None:
    """Wherever an overlay changes the workers' -c, its autoscaler's per-pod target follows."""
    for overlay, manifests in rendered.items():
        worker = container(manifests, "agl-worker")
        argv = worker["command"] + worker["args"]
        slots = argv[argv.index("-c") + 1]
        for scaled in (m for m in manifests if m["kind"] == "ScaledObject"):
            assert [t["metadata"]["threshold"] for t in scaled["spec"]["triggers"]] == [slots], overlay
        for hpa in (m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"):
            assert [m["external"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]] == [slots], overlay


def test_the_1_0_dispatcher_runs_leader_and_standby_with_its_key_from_a_secret(
    rendered: dict[str, list[Manifest]],
) -> None:
    """Two replicas behind a budget of one, scraped on the port its command names, the gateway's key a file of
    the Secret agl-v1-key (never an argument or variable of its own; the workers read the same Secret), and the
    gateway's URL in the ConfigMap both read."""
    manifests = rendered["agl-v1"]
    deployment = find(manifests, "Deployment", "agl-dispatcher-v1")
    assert deployment["spec"]["replicas"] == 2
    template = deployment["spec"]["template"]
    pod = template["spec"]
    (dispatcher,) = pod["containers"]
    argv = dispatcher["command"]
    assert argv[:4] == ["python", "-m", "bridge", "v1"] and "--key" not in argv and "args" not in dispatcher
    port = argv[argv.index("--metrics-port") + 1]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == port
    assert dispatcher["ports"] == [{"name": "metrics", "containerPort": int(port)}]
    assert dispatcher["readinessProbe"]["httpGet"]["port"] == dispatcher["livenessProbe"]["httpGet"]["port"]
    key_file = Path(argv[argv.index("--key-file") + 1])
    (mount,) = [m for m in dispatcher["volumeMounts"] if key_file.is_relative_to(m["mountPath"])]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (item,) = volume["secret"]["items"]
    assert key_file == Path(mount["mountPath"]) / item["path"]
    assert volume["secret"]["defaultMode"] & 0o007 == 0, "the key file is not world-readable"
    key = _secret_value(manifests, {"name": volume["secret"]["secretName"], "key": item["key"]})
    assert "AGL_V1_KEY" not in {e["name"] for e in dispatcher.get("env", [])}
    assert not [s for s in dispatcher.get("envFrom", []) if "secretRef" in s], "it loads no Secret whole"
    worker = container(manifests, "agl-worker")
    (worker_key,) = [e for e in worker["env"] if e["name"] == "AGL_V1_KEY"]
    assert worker_key["valueFrom"]["secretKeyRef"] == {"name": volume["secret"]["secretName"], "key": item["key"]}
    for workload in _workloads(manifests):
        for item_ in workload["spec"]["template"]["spec"]["containers"]:
            assert key not in json.dumps([item_.get("command"), item_.get("args")]), workload["metadata"]["name"]
    labels = template["metadata"]["labels"]
    (budget,) = [m for m in manifests if m["kind"] == "PodDisruptionBudget" and _selects(m["spec"]["selector"], labels)]
    assert budget["spec"] == {"minAvailable": 1, "selector": budget["spec"]["selector"]}
    bridge_labels = find(manifests, "Deployment", "agl-bridge")["spec"]["template"]["metadata"]["labels"]
    assert not _selects(deployment["spec"]["selector"], bridge_labels), "two Deployments would own one pod"
    config = find(manifests, "ConfigMap", "agl-config")["data"]
    assert config["AGL_V1_SERVER_URL"].startswith("http")
    assert set(webshop_program.PASS_ENV.split(",")) >= set(config["AGL_V1_PASS_ENV"].split(","))


def test_the_1_0_workers_run_the_1_0_image_sized_by_the_documented_rule(rendered: dict[str, list[Manifest]]) -> None:
    """overlays/agl-v1's workers: the worker-agl-v1 image, and a memory limit that holds -c programs by the rule
    and figures of docs/performance.md, as the manifest's comment states it."""
    worker = container(rendered["agl-v1"], "agl-worker")
    assert worker["image"].rsplit(":", 1)[0].endswith("/agl-celery-bridge-worker-agl-v1")
    argv = worker["command"] + worker["args"]
    slots = int(argv[argv.index("-c") + 1])
    limit_mib = parse_quantity(worker["resources"]["limits"]["memory"]) / 1024**2
    needed = v1_worker_memory_mib(slots, ROOT / "docs/performance.md")
    assert needed <= limit_mib < v1_worker_memory_mib(2 * slots, ROOT / "docs/performance.md")
    stated = re.search(r"= (\d+) MiB -> (\S+) for -c (\d+)", (K8S / "overlays/agl-v1/workers.yaml").read_text())
    assert stated is not None and stated.groups() == (
        str(math.ceil(needed)),
        worker["resources"]["limits"]["memory"],
        str(slots),
    )
    assert parse_quantity(worker["resources"]["requests"]["memory"]) <= parse_quantity(
        worker["resources"]["limits"]["memory"]
    )
    base = container(rendered["example"], "agl-worker")
    assert base["image"].rsplit(":", 1)[0].endswith("/agl-celery-bridge")


# --- Secrets: where each key goes -------------------------------------------------------------------------------


def test_the_secrets_each_command_needs_are_read_from_the_source(rendered: dict[str, list[Manifest]]) -> None:
    """What ``secret_findings`` wants of each command, from its code: the broker for every dispatcher and worker,
    the Store's token where a Store request is made, the LLM's and WebShop's credentials in the workers only.
    ``HOLDERS`` names every key the Secrets list."""
    wanted = {
        command: settings_read(ENTRIES[command]) & SECRET_SETTINGS - set(NOT_NEEDED.get(command, {}))
        for command in set(COMMANDS.values())
    }
    broker = {"CELERY_BROKER_URL", "REDIS_URL"}
    assert wanted["bridge"] == broker | {"AGENT_LIGHTNING_STORE_TOKEN"}
    assert wanted["dispatcher-v1"] == broker | {"AGL_V1_KEY"}
    assert wanted["worker"] == SECRET_SETTINGS
    assert wanted["flower"] == broker and wanted["webshop"] == set()
    listed = [set().union(*listed_secret_keys(manifests).values()) for manifests in rendered.values()]
    assert set().union(*listed) == set(HOLDERS)


@pytest.mark.parametrize("key", sorted(HOLDERS))
def test_a_secret_key_reaches_only_the_containers_that_need_it(key: str, rendered: dict[str, list[Manifest]]) -> None:
    """Across the overlays, with every key the example lists present in its Secret, a key of the Secrets reaches
    the workloads of ``HOLDERS`` and no other."""
    holders: set[str] = set()
    listed_anywhere: set[str] = set()
    for manifests in rendered.values():
        listed = listed_secret_keys(manifests)
        listed_anywhere |= set().union(*listed.values())
        for workload in _workloads(manifests):
            pod = workload["spec"]["template"]["spec"]
            if any(key in secrets_given(pod, item, listed)[0] for item in pod["containers"]):
                holders.add(workload["metadata"]["name"])
    assert key in listed_anywhere, f"no Secret lists {key}"
    assert holders == HOLDERS[key], key


def test_the_secret_check_bites(rendered: dict[str, list[Manifest]]) -> None:
    """A whole Secret, a key a container does not read, one it reads but is not given, and a key the Secret may
    lack that is not optional are each found."""
    m = rendered["example"]

    def whole(d: Manifest) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["envFrom"].append({"secretRef": {"name": "agl-secrets"}})

    found = secret_findings(_mutated(m, "Deployment", "agl-bridge", whole))
    assert "agl-bridge/bridge loads the Secret agl-secrets whole" in found
    assert "agl-bridge/bridge gets ['OPENAI_API_KEY', 'WEBSHOP_TOKEN'], which it never reads" in found

    def env_of(d: Manifest) -> list[Manifest]:
        return list(d["spec"]["template"]["spec"]["containers"][0]["env"])

    def drop_llm_key(d: Manifest) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["env"] = [e for e in env_of(d) if e["name"] != "OPENAI_API_KEY"]

    assert secret_findings(_mutated(m, "Deployment", "agl-worker", drop_llm_key)) == [
        "agl-worker/worker reads ['OPENAI_API_KEY'], which it is not given"
    ]

    def required_llm_key(d: Manifest) -> None:
        for e in env_of(d):
            if e["name"] == "OPENAI_API_KEY":
                e["valueFrom"]["secretKeyRef"].pop("optional")

    assert secret_findings(_mutated(m, "Deployment", "agl-worker", required_llm_key)) == [
        "agl-worker/worker: OPENAI_API_KEY is not optional, and agl-secrets may lack it"
    ]

    def flower_with_token(d: Manifest) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {
                "name": "AGENT_LIGHTNING_STORE_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": "agl-secrets", "key": "AGENT_LIGHTNING_STORE_TOKEN", "optional": True}
                },
            }
        )

    assert secret_findings(_mutated(m, "Deployment", "agl-flower", flower_with_token)) == [
        "agl-flower/flower gets ['AGENT_LIGHTNING_STORE_TOKEN'], which it never reads"
    ]

    def key_file_elsewhere(d: Manifest) -> None:  # the key is mounted, but not where --key-file reads it
        d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][-1]["mountPath"] = "/etc/elsewhere"

    assert secret_findings(_mutated(rendered["agl-v1"], "Deployment", "agl-dispatcher-v1", key_file_elsewhere)) == [
        "agl-dispatcher-v1/dispatcher reads ['AGL_V1_KEY'], which it is not given"
    ]


def test_the_1_0_workers_run_their_init_as_root_and_the_worker_with_only_what_boxes_need(
    rendered: dict[str, list[Manifest]],
) -> None:
    """overlays/agl-v1 runs the 1.0 workers as docker-compose.yml does (docs/agl-v1.md, "Boxes"): tini as root with
    five capabilities and no more, the worker through setpriv as uid 1000 keeping SETUID, SETGID and SYS_ADMIN only."""
    pod = find(rendered["agl-v1"], "Deployment", "agl-worker")["spec"]["template"]["spec"]
    worker = container(rendered["agl-v1"], "agl-worker")
    assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["seccompProfile"]["type"] == (
        "RuntimeDefault"
    )
    capabilities = worker["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"] and sorted(capabilities["add"]) == [
        "KILL",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_ADMIN",
    ]
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    assert "privileged" not in worker["securityContext"]
    command = worker["command"]
    assert command[:3] == ["tini", "--", "setpriv"] and {"--reuid=1000", "--no-new-privs"} <= set(command)
    kept = "-all,+setuid,+setgid,+sys_admin"
    assert {f"--inh-caps={kept}", f"--ambient-caps={kept}", f"--bounding-set={kept}"} <= set(command)
    assert command_argv(command)[:4] == ["celery", "-A", "workers", "worker"]
    for name in ("example", "external-broker"):  # the 0.3 workers run no programs: uid 1000, nothing added
        other = container(rendered[name], "agl-worker")
        assert "add" not in other["securityContext"]["capabilities"]
