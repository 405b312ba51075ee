"""Settings: every variable is checked at start, and a bad one is named in one readable message."""

from __future__ import annotations

import os

import pytest
from pydantic import HttpUrl

from bridge import cli
from bridge.core.infra import BridgeError, ConfigError, MissingSetting
from bridge.core.settings import Settings, env_name, load_settings
from bridge.core.task import clamp_to_broker, hard_time_limit, longest_hard_limit_s, longest_timeout_s, v1_time_limits

STORE = {"AGENT_LIGHTNING_STORE_URL": "http://127.0.0.1:4747"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for name in list(os.environ):
        if name.startswith(("AGENT_LIGHTNING", "CELERY_", "BRIDGE_", "WEBSHOP_", "OPENAI_", "BROKER_", "ROLLOUT_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(str(tmp_path))  # no stray .env


def test_a_config_error_is_an_ordinary_exception_naming_its_variable(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE["AGENT_LIGHTNING_STORE_URL"])
    monkeypatch.setenv("MAX_STEPS", "0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert isinstance(info.value, BridgeError) and not isinstance(info.value, (SystemExit, MissingSetting))
    assert info.value.setting == "MAX_STEPS" and str(info.value) == info.value.message


def test_keyword_overrides_take_the_field_or_the_variable_name(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = STORE["AGENT_LIGHTNING_STORE_URL"]
    monkeypatch.setenv("BRIDGE_MAX_QUEUE_WAIT_S", "100")
    assert load_settings(store_url=url).max_queue_wait_s == 100
    assert load_settings(store_url=url, max_queue_wait_s=200).max_queue_wait_s == 200
    assert load_settings(AGENT_LIGHTNING_STORE_URL=url, BRIDGE_MAX_QUEUE_WAIT_S=250).max_queue_wait_s == 250
    assert env_name("max_queue_wait_s") == "BRIDGE_MAX_QUEUE_WAIT_S"


def test_the_cli_turns_a_config_error_into_exit_code_2(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BRIDGE_MAX_BATCH", "0")
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err.startswith("error: invalid configuration: BRIDGE_MAX_BATCH: ")


def test_invalid_values_name_their_variables(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", "not a url")
    monkeypatch.setenv("MAX_STEPS", "0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "AGENT_LIGHTNING_STORE_URL" in info.value.message and "MAX_STEPS" in info.value.message


def test_visibility_timeout_must_cover_the_hard_limit_and_queue_wait(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE["AGENT_LIGHTNING_STORE_URL"])
    monkeypatch.setenv("BROKER_VISIBILITY_TIMEOUT_S", "600")
    monkeypatch.setenv("ROLLOUT_DEFAULT_TIMEOUT_S", "900")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "BROKER_VISIBILITY_TIMEOUT_S" in info.value.message


def test_queue_by_mode_mapping_and_redaction(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", STORE["AGENT_LIGHTNING_STORE_URL"])
    monkeypatch.setenv("QUEUE_BY_MODE", "train=rollouts-train, val=rollouts-eval")
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://:hunter2@127.0.0.1:6379/0")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    settings = load_settings()
    assert settings.queue_for_mode("train") == "rollouts-train"
    assert settings.queue_for_mode("test") == "rollouts"
    assert settings.all_queues() == ["rollouts", "rollouts-eval", "rollouts-train"]
    shown = str(settings.redacted())
    assert "hunter2" not in shown and "sk-secret" not in shown


def test_timeouts_the_broker_cannot_cover_are_clamped_and_others_kept() -> None:
    settings = Settings(store_url=HttpUrl("http://store:4747"))  # visibility 7,200 s, queue wait 300 s
    longest = longest_timeout_s(settings)
    # The hard limit of the longest covered rollout plus its queue wait still fits under the visibility timeout.
    assert hard_time_limit(settings, longest) + settings.max_queue_wait_s < settings.visibility_timeout_s
    assert hard_time_limit(settings, longest + 60) + settings.max_queue_wait_s > settings.visibility_timeout_s
    assert clamp_to_broker(settings, 20_000) == longest
    assert clamp_to_broker(settings, 600) == 600
    assert clamp_to_broker(settings, None) is None
    # A 1.0 attempt's limits sit above its budget (v1_time_limits): the same rule, with whole seconds.
    v1_longest = clamp_to_broker(settings, 20_000, agl_v1=True)
    assert v1_longest == int(v1_longest) and v1_time_limits(settings, v1_longest)[1] <= longest_hard_limit_s(settings)
    assert v1_time_limits(settings, v1_longest + 1)[1] > longest_hard_limit_s(settings)
    assert clamp_to_broker(settings, 600, agl_v1=True) == 600


def test_done_markers_must_outlive_the_brokers_redelivery_window() -> None:
    """A duplicate can come as late as the broker's redelivery timeout; the marker that drops it must last."""
    with pytest.raises(ConfigError, match="DONE_MARKER_TTL_S"):
        load_settings(store_url="http://store:4747", visibility_timeout_s=7200, done_marker_ttl_s=3600)
    assert load_settings(store_url="http://store:4747", done_marker_ttl_s=86_400).done_marker_ttl_s == 86_400
