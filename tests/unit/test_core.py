"""Fast unit tests of the pure pieces: settings, action parsing, proxy URLs, input validation, fencing, redaction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bridge.core.models import AttemptedRollout
from bridge.core.redact import redact_text, redact_url
from bridge.core.settings import ConfigError, load_settings
from workers.heartbeat import fence
from workers.inputs import parse_task_input
from workers.llm import proxy_attempt_url
from workers.prompts import Conversation, parse_action

STORE = {"AGENT_LIGHTNING_STORE_URL": "http://127.0.0.1:4747"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for name in list(os.environ):
        if name.startswith(("AGENT_LIGHTNING", "CELERY_", "BRIDGE_", "WEBSHOP_", "OPENAI_", "BROKER_", "ROLLOUT_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(str(tmp_path))  # no stray .env


def test_missing_store_url_names_the_variable(clean_env: None) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "AGENT_LIGHTNING_STORE_URL: is required" in info.value.message


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


def test_entry_points_exit_2_with_one_readable_line(clean_env: None, tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_LIGHTNING")}
    for argv in (
        [sys.executable, "-m", "bridge"],
        [sys.executable, "-m", "celery", "-A", "workers", "worker", "--help"],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=str(tmp_path), check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert "AGENT_LIGHTNING_STORE_URL" in done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("Thought: look\nAction: search[red cotton shirt]", "search[red cotton shirt]"),
        ("Action: click[B09QKP7XQL]", "click[B09QKP7XQL]"),
        ("click[blue] then Action: click[Buy Now]", "click[Buy Now]"),
        ("I will buy now.", "click[Buy Now]"),
        ("ACTION: Search[ wireless headphones ]", "search[wireless headphones]"),
    ],
)
def test_parse_action_takes_the_last_valid_action(reply: str, action: str) -> None:
    assert parse_action(reply).action == action


@pytest.mark.parametrize("reply", ["search[query]", "click[element]", "search[...]", "search[ab]", "hello", "click[]"])
def test_parse_action_rejects_placeholders_with_feedback(reply: str) -> None:
    parsed = parse_action(reply)
    assert parsed.action is None and parsed.problem


def test_conversation_shortens_old_observations_only() -> None:
    conversation = Conversation("buy a shirt")
    for i in range(4):
        conversation.observe(f"Observation {i}: " + "x" * 2000)
        conversation.answer("Action: search[shirt]")
    users = [m["content"] for m in conversation.messages if m["role"] == "user"]
    assert len(users[-1]) > 2000 and all(len(u) < 500 for u in users[:-2])


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076/v1"),
        ("http://127.0.0.1:9/v1/", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076/v1"),
        ("http://127.0.0.1:9", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076"),
        ("http://h:9/api/", "http://h:9/api/rollout/ro-9a85aef652f5/attempt/at-0a07a076"),
    ],
)
def test_proxy_attempt_url_follows_the_protocol(endpoint: str, expected: str) -> None:
    assert proxy_attempt_url(endpoint, "ro-9a85aef652f5", "at-0a07a076") == expected


def test_task_input_validation() -> None:
    assert parse_task_input({"instruction": " buy ", "task_id": "t1"}, max_chars=100).reset_request() == {
        "task_id": "t1"
    }
    assert parse_task_input({"instruction": "buy", "goal_id": "7"}, max_chars=100).reset_request() == {"goal_id": 7}
    assert parse_task_input({"instruction": "buy"}, max_chars=100).reset_request() == {"instruction": "buy"}
    for bad in (
        None,
        [],
        "x",
        {"instruction": None},
        {"instruction": 1},
        {"instruction": "ok", "goal_id": True},
        {"instruction": "ok", "goal_id": "a"},
        {"instruction": "ok", "task_id": ""},
        {"instruction": "y" * 101},
    ):
        with pytest.raises(Exception) as info:
            parse_task_input(bad, max_chars=100)
        assert type(info.value).__name__ == "InvalidInputError"


def _attempted(status: str = "running", attempt_status: str = "running", aid: str = "at-1") -> AttemptedRollout:
    return AttemptedRollout.model_validate(
        {
            "rollout_id": "ro-1",
            "status": status,
            "attempt": {"rollout_id": "ro-1", "attempt_id": aid, "status": attempt_status},
        }
    )


def test_fence_admits_only_the_latest_live_attempt() -> None:
    assert fence(_attempted(), "at-1") is None
    assert fence(_attempted(status="preparing", attempt_status="preparing"), "at-1") is None
    assert "superseded" in (fence(_attempted(aid="at-2"), "at-1") or "")
    assert "cancelled" in (fence(_attempted(status="cancelled"), "at-1") or "")
    assert "unresponsive" in (fence(_attempted(attempt_status="unresponsive"), "at-1") or "")
    assert "succeeded" in (fence(_attempted(status="succeeded", attempt_status="succeeded"), "at-1") or "")


def test_redaction() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    assert redact_url("http://h:1/v1") == "http://h:1/v1"
    assert "sk-123" not in redact_text("failed: api_key=sk-123 at redis://:pw@h:1")
    assert "pw" not in redact_text("at redis://:pw@h:1")


def test_watchdog_may_act_only_near_the_rollouts_own_limits() -> None:
    from bridge.core.models import RolloutConfig
    from workers.heartbeat import watchdog_may_act

    t0 = 1_000_000.0
    assert not watchdog_may_act(RolloutConfig(), t0, t0, t0 + 86_400)  # no limits: the watchdog never acts
    timeout = RolloutConfig(timeout_seconds=60)
    assert not watchdog_may_act(timeout, t0, t0, t0 + 40)
    assert watchdog_may_act(timeout, t0, t0, t0 + 50)  # within the margin (20%, at least 2 s) of 60 s
    unresponsive = RolloutConfig(unresponsive_seconds=30)
    assert watchdog_may_act(unresponsive, t0, t0, t0 + 29)
    assert not watchdog_may_act(unresponsive, t0, t0 + 20, t0 + 29)  # a recent heartbeat keeps it quiet
    assert watchdog_may_act(RolloutConfig(unresponsive_seconds=3), t0, t0, t0 + 1.5)  # 2 s margin at least
