"""A 1.0-only deployment needs no Store (docs/agl-v1.md, "Without a Store"): the Store URL is optional, what
serves 0.3 names it when it is missing, and the dispatcher and workers agree on a key scope without it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import redis

from bridge import cli
from bridge.core.coordination import capacity, deployment_scope, keys
from bridge.core.infra import MissingSetting
from bridge.core.settings import load_settings

GATEWAY = "http://gateway:8080"
STORE = "http://store:4747"
MISSING_STORE = "error: invalid configuration: AGENT_LIGHTNING_STORE_URL: is required but not set"


@pytest.fixture
def no_deployment_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """Nothing that names a Store, a gateway or a key scope in the environment (nor a stray .env)."""
    for name in list(os.environ):
        if name.startswith(("AGENT_LIGHTNING", "AGL_V1_", "REDIS_KEY_SCOPE")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(str(tmp_path))


def test_settings_load_without_a_store_and_what_needs_it_names_the_variable(no_deployment_env: None) -> None:
    settings = load_settings()
    assert settings.store_url is None
    with pytest.raises(MissingSetting) as info:
        settings.require_store("the bridge")
    assert info.value.setting == "AGENT_LIGHTNING_STORE_URL"
    assert "AGENT_LIGHTNING_STORE_URL: is required but not set (the bridge works with" in info.value.message
    with pytest.raises(MissingSetting):
        _ = settings.traces_endpoint  # the default span sink is the Store's
    assert load_settings(store_url=STORE + "/").require_store("the bridge") == STORE


def test_the_0_3_bridge_exits_2_naming_the_store_url(
    no_deployment_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err.startswith(MISSING_STORE + " (the bridge (`python -m bridge run`) works with")


def test_the_1_0_dispatcher_needs_its_gateway_not_a_store(
    no_deployment_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["v1"]) == 2
    assert "AGL_V1_SERVER_URL (or --server) must name" in capsys.readouterr().err


def test_status_exits_2_when_nothing_names_the_deployment(
    no_deployment_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "--no-inspect"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(MISSING_STORE) and "AGL_V1_SERVER_URL or REDIS_KEY_SCOPE" in err


def test_status_without_a_store_shows_the_rest() -> None:
    from bridge.ops import status

    settings = load_settings(agl_v1_url=GATEWAY, broker_url="redis://127.0.0.1:9/0")
    part = status.store_part(settings, None)
    assert part["url"] is None and "AGENT_LIGHTNING_STORE_URL is not set" in part["error"]
    assert status.render({"store": part, "broker": _down, "workers": [], "in_flight": 0, "last_errors": []})


_down = {"url": "redis://127.0.0.1:9/0", "ok": False, "error": "down", "queues": {}}


def test_status_says_when_the_gateway_does_not_answer_and_shows_its_counts_when_it_does() -> None:
    from bridge.ops import status

    settings = load_settings(agl_v1_url="http://127.0.0.1:9", broker_url="redis://127.0.0.1:9/0")  # nothing listens
    part = status.gateway_part(settings)
    assert part is not None and not part["ok"] and "127.0.0.1:9" in part["error"]
    report = {"store": status.store_part(settings, None), "broker": _down, "workers": [], "in_flight": 0}
    text = status.render({**report, "gateway": part, "last_errors": []})
    assert "Gateway http://127.0.0.1:9  DOES NOT ANSWER: " in text
    answered = {**part, "ok": True, "queuing": 1000, "running": 2, "oldest_queuing_s": 4.0}
    answered.update(queuing_capped=True, running_capped=False)
    text = status.render({**report, "gateway": answered, "last_errors": []})
    assert "Gateway http://127.0.0.1:9  ok" in text and "queuing 1000+  running 2  oldest queuing 4.0s" in text
    assert status.gateway_part(load_settings(store_url=STORE, agl_v1_url="")) is None  # no gateway: no part


def test_a_store_less_deployment_is_scoped_by_its_gateway_unless_redis_key_scope_names_it() -> None:
    gateway_only = load_settings(agl_v1_url=GATEWAY + "/")
    assert deployment_scope(gateway_only) == keys.gateway_scope(GATEWAY) and deployment_scope(gateway_only)[:3] == "v1-"
    assert deployment_scope(load_settings(agl_v1_url="http://127.0.0.1:8080")) != deployment_scope(gateway_only)
    assert deployment_scope(load_settings(agl_v1_url=GATEWAY, redis_key_scope="team-a")) == "team-a"
    # Beside a Store, the workers serve 0.3 too: the Store's scope, which the 1.0 dispatcher then shares.
    both = load_settings(agl_v1_url=GATEWAY, store_url=STORE)
    assert deployment_scope(both) == keys.store_scope(STORE)


def test_without_a_store_gateway_or_scope_the_scope_names_what_to_set(no_deployment_env: None) -> None:
    with pytest.raises(MissingSetting) as info:
        deployment_scope(load_settings())
    assert info.value.setting == "AGENT_LIGHTNING_STORE_URL"
    assert "AGL_V1_SERVER_URL or REDIS_KEY_SCOPE" in info.value.message


def test_a_worker_exits_2_at_start_when_nothing_names_its_deployment(
    no_deployment_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.lifecycle.steps import startup

    with pytest.raises(SystemExit) as exited:
        startup.start_node(SimpleNamespace(pool_cls="threads", concurrency=4), load_settings())
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(MISSING_STORE)


def test_a_1_0_only_worker_starts_without_reading_a_store_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.lifecycle.steps import startup
    from workers.protocol import clock

    settings = load_settings(agl_v1_url=GATEWAY)
    monkeypatch.setattr(clock, "check_store_clock", lambda _settings: pytest.fail("no Store to read a clock from"))
    startup.start_node(SimpleNamespace(pool_cls="threads", concurrency=4), settings)


def test_a_0_3_rollout_on_a_1_0_only_worker_goes_back_to_the_broker_unstarted_and_keeps_its_in_flight_mark(
    monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    from workers import tasks

    settings = load_settings(agl_v1_url=GATEWAY, redis_key_scope="store-less-unit")
    monkeypatch.setattr(tasks, "get_settings", lambda: settings)
    capacity.mark_inflight(redis_client, "store-less-unit", "rollouts", "a-1")
    try:
        rollout = {"rollout_id": "r-1", "attempt": {"attempt_id": "a-1"}}
        for _ in range(2):
            result = tasks.run_rollout.apply(kwargs={"rollout": rollout, "queue": "rollouts"}, task_id="a-1")
            assert result.state == "REJECTED", result.state
            assert "AGENT_LIGHTNING_STORE_URL is not set" in str(result.result)
        # still the bridge's published attempt: its mark stays until a worker with a Store runs it
        assert capacity.inflight_count(redis_client, "store-less-unit", "rollouts") == 1
        named = [r for r in caplog.records if "hands each such task back" in r.getMessage()]
        assert len(named) == 1 and "AGENT_LIGHTNING_STORE_URL" in named[0].getMessage()  # once per process
    finally:
        capacity.clear_inflight(redis_client, "store-less-unit", "rollouts", "a-1")
