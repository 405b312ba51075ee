"""OPENAI_API_KEY goes only where the operator allows: OPENAI_API_BASE's host and port and LLM_KEY_HOSTS.

An LLM endpoint named by the Store's resources elsewhere gets no key from the worker (its own key passes as
is), for the WebShop loop (``workers.agents.llm.resolve_target``) and for LitAgents (``litagent.keyed_resources``);
a failed call then says the key was withheld, from which host, and which setting allows more.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import httpx
import openai
import pytest

from bridge.core.infra import ConfigError, LLMError
from bridge.core.settings import Settings, load_settings
from bridge.core.store import AttemptedRollout, ResourcesUpdate, StoreClient
from tests.prerequisites import require
from workers.agents import llm as llm_mod

KEY = "sk-live-HOME-ONLY"


def _settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "store_url": "http://127.0.0.1:1",
        "openai_api_key": KEY,
        "openai_api_base": "https://llm.home.example/v1",
    }
    return load_settings(**{**values, **overrides})


def _resources(endpoint: str, resource_type: str = "llm", api_key: str | None = None) -> ResourcesUpdate:
    main = {"resource_type": resource_type, "endpoint": endpoint, "model": "m", "api_key": api_key}
    return ResourcesUpdate.model_validate({"resources_id": "rs-1", "resources": {"main_llm": main}})


ROLLOUT = AttemptedRollout.model_validate(
    {"rollout_id": "ro-1", "input": {}, "attempt": {"rollout_id": "ro-1", "attempt_id": "at-1"}}
)


@pytest.mark.parametrize(
    ("endpoint", "hosts", "gets_key"),
    [
        ("https://llm.home.example/v1", "", True),  # OPENAI_API_BASE itself
        ("https://LLM.home.example:443/other/v1", "", True),  # same host, the scheme's default port
        ("http://llm.home.example/v1", "", False),  # same host, another port (80)
        ("https://evil.example/v1", "", False),
        ("https://evil.example/v1", "evil.example", True),  # a host without a port: any port
        ("http://vllm.internal:8000/v1", "vllm.internal:8000", True),
        ("http://vllm.internal:8001/v1", "vllm.internal:8000", False),
        ("http://[::1]:8000/v1", "[::1]:8000", True),
        ("not a url", "", False),
    ],
)
def test_the_key_goes_to_allowed_hosts_only(endpoint: str, hosts: str, gets_key: bool) -> None:
    key, why = llm_mod.llm_api_key(endpoint, None, _settings(llm_key_hosts=hosts))
    assert (key == KEY) is gets_key and (key is None) is not gets_key
    assert bool(why) is not gets_key


def test_a_resource_keeps_its_own_key_and_no_key_means_nothing_is_withheld() -> None:
    assert llm_mod.llm_api_key("https://evil.example/v1", "sk-theirs", _settings()) == ("sk-theirs", "")
    assert llm_mod.llm_api_key("https://evil.example/v1", None, _settings(openai_api_key=None)) == (None, "")


def test_the_store_s_llm_elsewhere_gets_no_key_and_its_failure_says_why() -> None:
    settings = _settings()
    target = llm_mod.resolve_target(_resources("https://evil.example:8443/v1"), ROLLOUT, settings)
    assert target.api_key == "EMPTY" and "evil.example:8443" in target.key_withheld
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("authorization", ""))
        return httpx.Response(401, json={"error": {"message": "no key"}})

    client = openai.OpenAI(
        base_url=target.base_url,
        api_key=target.api_key,
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    with pytest.raises(LLMError) as info:
        llm_mod.chat(client, target, [{"role": "user", "content": "hi"}], retries=0, max_backoff_s=0.1)
    assert sent == ["Bearer EMPTY"]
    message = str(info.value)
    assert "withheld" in message and "evil.example:8443" in message and "LLM_KEY_HOSTS" in message
    assert KEY not in message


def test_allowed_and_keyed_resources_are_unchanged_and_proxies_are_judged_by_their_host() -> None:
    settings = _settings(llm_key_hosts="proxy.internal")
    home = llm_mod.resolve_target(_resources("https://llm.home.example/v1"), ROLLOUT, settings)
    assert (home.api_key, home.key_withheld) == (KEY, "")
    proxy = llm_mod.resolve_target(_resources("http://proxy.internal:4000/v1", "proxy_llm"), ROLLOUT, settings)
    assert proxy.api_key == KEY and "/rollout/ro-1/attempt/at-1" in proxy.base_url
    own = llm_mod.resolve_target(_resources("https://evil.example/v1", api_key="sk-theirs"), ROLLOUT, settings)
    assert (own.api_key, own.key_withheld) == ("sk-theirs", "")
    fallback = llm_mod.resolve_target(None, ROLLOUT, settings)
    assert (fallback.api_key, fallback.source) == (KEY, "settings")


def test_llm_key_hosts_is_parsed_and_checked() -> None:
    assert _settings(llm_key_hosts=" A.example , b.example:8000,[::1]:9 ").llm_key_hosts == [
        "a.example",
        "b.example:8000",
        "[::1]:9",
    ]
    for bad in ("https://a.example", "a.example:0", "a.example:99999", "user@a.example", "a.example/v1"):
        with pytest.raises(ConfigError, match="LLM_KEY_HOSTS"):
            _settings(llm_key_hosts=bad)


@pytest.mark.cost(8)  # importing agentlightning
def test_a_litagent_gets_the_key_only_at_allowed_hosts_and_its_failure_says_why() -> None:
    require(None if importlib.util.find_spec("agentlightning") else "agentlightning is not installed (.[store])")
    from agentlightning import LLM, PromptTemplate

    from workers.agents import litagent
    from workers.protocol.failures import AgentError

    resources: dict[str, Any] = {
        "main_llm": LLM(endpoint="https://evil.example/v1", model="m"),
        "home": LLM(endpoint="https://llm.home.example/v1", model="m"),
        "own": LLM(endpoint="https://evil.example/v1", model="m", api_key="sk-theirs"),
        "prompt": PromptTemplate(template="Q: {q}", engine="f-string"),
    }
    keyed, why = litagent.keyed_resources(resources, _settings())
    # "EMPTY", not None: the openai SDK would otherwise read OPENAI_API_KEY from the environment.
    assert keyed["main_llm"].api_key == "EMPTY" and keyed["home"].api_key == KEY
    assert keyed["own"].api_key == "sk-theirs" and keyed["prompt"] is resources["prompt"]
    assert resources["main_llm"].api_key is None  # the caller's objects are not changed
    assert "evil.example:443" in why and "'main_llm'" in why and "LLM_KEY_HOSTS" in why
    with pytest.raises(AgentError, match=r"raised PermissionError: 401 .*withheld from host evil\.example:443"):
        _run_refused_agent(resources)
    unkeyed, nothing = litagent.keyed_resources(resources, _settings(openai_api_key=None))
    assert unkeyed["main_llm"].api_key is None and nothing == ""


def _run_refused_agent(resources: dict[str, Any]) -> None:
    """Run a LitAgent whose LLM refuses it (it raises as an SDK does on a 401) with ``resources``, as a worker runs
    one (``litagent.run_agent``)."""
    from agentlightning import LitAgent

    from workers.agents import litagent
    from workers.agents.capture import AttemptCapture
    from workers.agents.loading import ConfiguredAgent
    from workers.telemetry.spans import AttemptTelemetry

    class Refused(LitAgent[Any]):
        def rollout(self, task: Any, resources: Any, rollout: Any) -> float:
            raise PermissionError("401 invalid api key")

    settings = _settings()
    store = StoreClient("http://127.0.0.1:9", retries=0)
    telemetry = AttemptTelemetry(store, rollout_id="ro-k", attempt_id="at-k", service_name="unit", export=False)
    payload = {
        "rollout_id": "ro-k",
        "input": {},
        "start_time": 1.0,
        "status": "running",
        "attempt": {"rollout_id": "ro-k", "attempt_id": "at-k", "sequence_id": 1, "start_time": 1.0},
    }
    try:
        capture = AttemptCapture(telemetry, settings, lambda: None, None, lambda model: None)
        litagent.run_agent(ConfiguredAgent("tests:Refused", Refused()), payload, resources, capture, "w")
    finally:
        telemetry.close()
        store.close()
