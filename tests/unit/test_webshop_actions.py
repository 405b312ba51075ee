"""Action parsing (4.1), available actions (4.2) and the state machine (4.3/4.4)."""

from __future__ import annotations

import pytest

from webshop_env.actions import Action, parse_action
from webshop_env.env import EnvSettings, WebShopEnv, build_env
from webshop_env.goals import default_goals
from webshop_env.state import EpisodeState, Page

HAIR_TASK = "ws_B09R4RJSFP_8603"
HAIR_QUERY = "i need a 120 ml hair mask treatment"


@pytest.fixture(scope="module")
def env() -> WebShopEnv:
    return build_env()


def _state(task_id: str = HAIR_TASK) -> EpisodeState:
    return EpisodeState(goal=default_goals().by_task_id[task_id])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("search[Red Shoes]", Action("search", "red shoes")),
        ("click[Buy Now]", Action("click", "buy now")),
        ("click[B07S7HDC88] trailing", Action("click", "b07s7hdc88")),
        ("click[< Prev]", Action("click", "< prev")),
        ("Click[buy now]", None),
        ("click [buy now]", None),
        ("press[buy now]", None),
        ("search[]", None),
        ("click[a[b]]", None),
        ("buy now", None),
    ],
)
def test_parse_action(text: str, expected: Action | None) -> None:
    assert parse_action(text) == expected


def test_available_actions_per_page(env: WebShopEnv) -> None:
    state = _state()
    assert env.actions_for(state) == {"has_search_bar": True, "clickables": ["search"]}
    env.step(state, f"search[{HAIR_QUERY}]")
    clickables = env.actions_for(state)["clickables"]
    assert clickables[:2] == ["back to search", "next >"] and len(clickables) == 12
    assert all(c == c.lower() for c in clickables)
    env.step(state, "click[next >]")
    assert env.actions_for(state)["clickables"][:3] == ["back to search", "< prev", "next >"]
    env.step(state, "click[< prev]")
    env.step(state, "click[B09R4RJSFP]")
    assert env.actions_for(state)["clickables"] == [
        "back to search",
        "< prev",
        "description",
        "features",
        "reviews",
        "buy now",
        "120ml",
        "60ml",
    ]
    env.step(state, "click[reviews]")
    assert env.actions_for(state)["clickables"] == ["back to search", "< prev"]


def test_hair_mask_vector_scores_one(env: WebShopEnv) -> None:
    state = _state()
    for action in (f"search[{HAIR_QUERY}]", "click[B09R4RJSFP]", "click[120ml]"):
        assert env.step(state, action).info["valid"]
    result = env.step(state, "click[Buy Now]")
    assert result.done and result.reward == 1.0
    assert "Your score (min 0.0, max 1.0) [SEP] 1.0 [SEP]" in result.observation
    assert '[SEP] options [SEP] {"color": "120ml"} [SEP]' in result.observation
    assert result.info["purchased_asin"] == "B09R4RJSFP" and result.info["price"] == 100.0
    after = env.step(state, "search[anything]")
    assert after.done and after.reward == 0.0 and not after.info["valid"]
    assert after.info["error"] == "episode finished" and after.observation == result.observation


def test_wrong_option_scores_two_thirds(env: WebShopEnv) -> None:
    state = _state()
    for action in (f"search[{HAIR_QUERY}]", "click[b09r4rjsfp]", "click[120ml]", "click[60ml]"):
        env.step(state, action)
    assert state.options == {"color": "60ml"}  # a later click replaces the group's choice
    result = env.step(state, "click[buy now]")
    assert result.reward == 2 / 3
    assert "[SEP] 0.6666666666666666 [SEP]" in result.observation


@pytest.mark.parametrize("action", ["click[Buy Now]", "click[Buy]", "click[item 1]", "search[ ]", "foo[bar]"])
def test_invalid_actions_on_results_are_silent_no_ops(env: WebShopEnv, action: str) -> None:
    state = _state()
    before = env.step(state, f"search[{HAIR_QUERY}]").observation
    result = env.step(state, action)
    assert (result.observation, result.reward, result.done, result.info["valid"]) == (
        before,
        0.0,
        False,
        False,
    )


def test_click_search_on_search_page_is_ignored(env: WebShopEnv) -> None:
    state = _state()
    before = env.observe(state)
    result = env.step(state, "click[search]")
    assert result.observation == before and not result.info["valid"] and not result.done


def test_navigation_keeps_or_clears_selection(env: WebShopEnv) -> None:
    state = _state()
    env.step(state, f"search[{HAIR_QUERY}]")
    env.step(state, "click[B09R4RJSFP]")
    env.step(state, "click[120ml]")
    env.step(state, "click[Description]")
    assert state.page is Page.DESCRIPTION and state.options == {"color": "120ml"}
    env.step(state, "click[< Prev]")
    assert state.page is Page.ITEM and state.options == {"color": "120ml"}
    env.step(state, "click[< Prev]")
    assert state.page is Page.RESULTS and state.options == {} and state.page_num == 1
    env.step(state, "click[B09R4RJSFP]")
    env.step(state, "search[hair mask]")  # search works from any page and clears the product
    assert state.page is Page.RESULTS and state.asin is None
    env.step(state, "click[Back to Search]")
    assert state.page is Page.SEARCH and state.visited == [] and state.query == ""


def test_strict_search_and_step_cap() -> None:
    base = build_env()
    strict = WebShopEnv(base.catalog, base.engine, base.goals, EnvSettings(strict_search=True, max_steps=3))
    state = _state()
    assert strict.step(state, "search[hair mask]").info["valid"]
    assert not strict.step(state, "search[hair mask]").info["valid"]
    capped = strict.step(state, "click[next >]")
    assert capped.done and capped.reward == 0.0 and capped.info["truncated"]
