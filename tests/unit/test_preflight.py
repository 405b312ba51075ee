"""``python -m bridge preflight`` (bridge/ops/preflight.py), the one-shot check docker-compose.yml runs before a
stack that cannot work: no LLM, no 1.0 gateway, a password that is no operator's own. Each refusal is one line and
exit status 2; the compose side (which services wait for which check) is tests/unit/test_deployment.py's, and
a refused `docker compose up` is tests/deployed/test_first_run.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace

import pytest

from bridge.ops import preflight
from tests.loopback import LoopbackServer

UNRESOLVABLE = "http://policy.invalid:8000/v1"  # .invalid never resolves (RFC 6761)


def checks(**given: object) -> Namespace:
    return Namespace(**{"llm": None, "store": None, "gateway": None, "password": [], "wait_s": 0.0, **given})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "is not set"),
        ("", "is not set"),
        ("change-me", "example's password"),
        ("Guest", "example's password"),
        ("short-one", "12+ characters"),
    ],
)
def test_a_password_that_is_no_operators_own_is_refused(value: str | None, why: str) -> None:
    found = preflight.password_problem("RABBITMQ_PASSWORD", value)
    assert found is not None and why in found and found.startswith("RABBITMQ_PASSWORD")
    assert value is None or value == "" or value not in found  # never echoes the password


def test_a_password_of_ones_own_passes() -> None:
    assert preflight.password_problem("RABBITMQ_PASSWORD", "9f2c41e07d3b8a65") is None
    args = checks(password=["RABBITMQ_PASSWORD", "GRAFANA_ADMIN_PASSWORD"])
    env = {"RABBITMQ_PASSWORD": "9f2c41e07d3b8a65", "GRAFANA_ADMIN_PASSWORD": "change-me"}
    assert "GRAFANA_ADMIN_PASSWORD" in str(preflight.problem(args, env))


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:8080"])
def test_a_loopback_address_is_refused_since_in_a_container_it_is_the_container(url: str) -> None:
    found = preflight.problem(checks(llm=url), {})
    assert found is not None and "loopback" in found and url in found
    assert "loopback" in str(preflight.problem(checks(gateway=url), {}))


def test_an_address_that_resolves_elsewhere_passes() -> None:
    assert preflight.problem(checks(llm="http://10.9.8.7:8000/v1", gateway="http://10.9.8.7:8080"), {}) is None


def test_no_llm_is_refused_unless_the_stores_resources_name_one() -> None:
    found = preflight.problem(checks(llm=UNRESOLVABLE), {})
    assert found is not None and "--profile standin" in found and "OPENAI_API_BASE" in found

    latest: dict[str, object] = {"resources_id": "rs-1", "resources": {}}

    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        assert (method, path) == ("GET", "/v1/agl/resources/latest")
        return 200, {"Content-Type": "application/json"}, json.dumps(latest).encode()

    store = LoopbackServer(answer)
    try:
        assert "--profile standin" in str(preflight.problem(checks(llm=UNRESOLVABLE, store=store.url), {}))
        latest["resources"] = {"main_llm": {"resource_type": "llm", "endpoint": "http://vllm:8000/v1", "model": "m"}}
        assert preflight.problem(checks(llm=UNRESOLVABLE, store=store.url), {}) is None
    finally:
        store.close()
    assert "--profile standin" in str(preflight.problem(checks(llm=UNRESOLVABLE, store="http://127.0.0.1:9"), {}))


def test_no_gateway_is_refused_naming_the_profile_and_the_setting() -> None:
    found = preflight.problem(checks(gateway="http://agl-gateway.invalid:8080"), {})
    assert found is not None and "--profile agl-v1-gateway" in found and "AGL_V1_SERVER_URL" in found


def test_the_command_exits_2_with_one_line_and_0_when_all_hold() -> None:
    argv = [sys.executable, "-m", "bridge", "preflight", "--llm", UNRESOLVABLE, "--wait-s", "0"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused
    assert len(refused.stderr.strip().splitlines()) == 1 and "--profile standin" in refused.stderr
    passed = subprocess.run([*argv[:4], "--gateway", "http://10.9.8.7:8080"], capture_output=True, text=True)
    assert passed.returncode == 0, passed
