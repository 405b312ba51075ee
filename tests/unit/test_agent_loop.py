"""The worker's agent loop: which rollout inputs it accepts, how it reads the LLM's replies into WebShop
actions, and how it keeps the conversation it sends short."""

from __future__ import annotations

import pytest

from bridge.core.infra import InvalidInputError
from workers.agents.inputs import parse_task_input
from workers.agents.prompts import Conversation, parse_action


def test_task_input_names_the_goal_to_reset_to() -> None:
    assert parse_task_input({"instruction": " buy ", "task_id": "t1"}, max_chars=100).reset_request() == {
        "task_id": "t1"
    }
    assert parse_task_input({"instruction": "buy", "goal_id": "7"}, max_chars=100).reset_request() == {"goal_id": 7}
    assert parse_task_input({"instruction": "buy"}, max_chars=100).reset_request() == {"instruction": "buy"}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        "x",
        {"instruction": None},
        {"instruction": 1},
        {"instruction": "ok", "goal_id": True},
        {"instruction": "ok", "goal_id": "a"},
        {"instruction": "ok", "task_id": ""},
        {"instruction": "y" * 101},
    ],
)
def test_malformed_task_input_is_refused_as_an_input_error(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        parse_task_input(bad, max_chars=100)


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
    conversation = Conversation()
    for i in range(4):
        conversation.observe(f"Observation {i}: " + "x" * 2000)
        conversation.answer("Action: search[shirt]")
    users = [m["content"] for m in conversation.messages if m["role"] == "user"]
    assert len(users[-1]) > 2000 and all(len(u) < 500 for u in users[:-2])
