"""What a 1.0 agent program is given (``bridge.core.gateway.rollouts``): the variables 1.0's own ``local`` runner sets,
resolved for our attempt ids, and the attempt names both sides derive."""

from __future__ import annotations

import json

import pytest

from bridge.core.gateway import V1Rollout, agent_environment, attempt_key


def rollout(**config: object) -> V1Rollout:
    return V1Rollout.model_validate(
        {
            "rollout_id": "r1",
            "input": {"q": "What is 2 + 2?", "meta": {"reward": 0.5, "tags": ["a", "b"]}},
            "is_train": False,
            "config": {"timeout_seconds": 30, "local": {"agent_class": "pkg:Agent", **config}},
            "status": {"state": "queuing"},
        }
    )


def test_the_agent_gets_the_proxy_events_and_key_of_its_own_attempt() -> None:
    env = agent_environment(rollout(), "1", agent_url="http://gw:8080/", key="k")
    assert env == {
        "AGL_KEY": "k",
        "AGL_OPENAI_BASE_URL": "http://gw:8080/proxy/rollout/r1/attempt/1/mode/val/openai/v1",
        "AGL_EVENT_URL": "http://gw:8080/api/rollouts/r1/attempt/1/events",
    }


def test_env_map_entries_are_resolved_from_the_input() -> None:
    env_map = {"Q": "input.q", "R": "input.meta.reward", "T": "input.meta.tags.1", "ALL": "input", "LIT": "plain"}
    env = agent_environment(rollout(env_map=env_map), "0", agent_url="http://gw", key=None)
    assert env["Q"] == "What is 2 + 2?"  # a string as is
    assert env["R"] == "0.5" and env["T"] == "b" and env["LIT"] == "plain"
    assert json.loads(env["ALL"])["meta"]["tags"] == ["a", "b"]  # anything else as JSON
    assert env["AGL_KEY"] == ""


def test_a_path_the_input_lacks_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"input\.meta\.missing"):
        agent_environment(rollout(env_map={"X": "input.meta.missing"}), "0", agent_url="http://gw", key=None)


def test_attempts_are_named_alike_on_both_sides() -> None:
    assert attempt_key("r1", "0") == "v1-r1-0"
