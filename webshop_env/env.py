"""The WebShop text-mode state machine (spec 4.3/4.4): one step of one episode.

Nothing here knows about HTTP or sessions; ``WebShopEnv`` takes an
``EpisodeState`` and an action string and mutates the state in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from webshop_env.actions import Action, available_actions, clickables, parse_action
from webshop_env.catalog import Catalog, Product, default_catalog
from webshop_env.goals import Goal, GoalSet, default_goals
from webshop_env.pages import render
from webshop_env.reward import compute_reward
from webshop_env.search import SearchEngine
from webshop_env.state import SUB_PAGES, EpisodeState, Page

logger = logging.getLogger("webshop_env.env")

FINISHED_ERROR = "episode finished"


@dataclass(slots=True)
class StepResult:
    """What /step returns besides the session id."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """Behaviour switches; the defaults follow upstream text mode."""

    strict_search: bool = False  # ignore search[...] where the page has no search bar
    max_steps: int | None = None  # optional cap; upstream has none
    expose_goal: bool = False  # debug only: put the target asin/attributes in info


def free_form_goal(instruction: str) -> Goal:
    """An unscored goal for an instruction that matches no task (spec 1, rule 3)."""
    text = instruction.strip()
    return Goal(
        task_id="",
        asin="",
        name="",
        query="",
        category="",
        product_category="",
        instruction=text,
        instruction_text=text,
        attributes=(),
        goal_options=(),
        price_upper=0.0,
        scored=False,
    )


class WebShopEnv:
    """Catalog, search engine and goals, plus the rules that move an episode along."""

    def __init__(self, catalog: Catalog, engine: SearchEngine, goals: GoalSet, settings: EnvSettings) -> None:
        self.catalog = catalog
        self.engine = engine
        self.goals = goals
        self.settings = settings

    # -- observation and info -------------------------------------------------------------
    def observe(self, state: EpisodeState) -> str:
        """Current page text."""
        return render(state, self.catalog)

    def _product(self, state: EpisodeState) -> Product | None:
        return self.catalog.by_asin.get(state.asin) if state.asin else None

    def actions_for(self, state: EpisodeState) -> dict[str, Any]:
        """Available actions of the current page."""
        product = self._product(state)
        return available_actions(state, dict(product.options) if product else None)

    def reset_info(self, state: EpisodeState) -> dict[str, Any]:
        """``info`` of a reset: task handle, full instruction, scored flag, actions; no target."""
        goal = state.goal
        info: dict[str, Any] = {"instruction": goal.instruction_text, "scored": goal.scored}
        if goal.task_id:
            info["task_id"] = goal.task_id
            info["goal_index"] = self.goals.index_of.get(goal.task_id)
        info["available_actions"] = self.actions_for(state)
        if self.settings.expose_goal and goal.scored:
            info["goal"] = {
                "asin": goal.asin,
                "attributes": list(goal.attributes),
                "goal_options": [list(o) for o in goal.goal_options],
                "price_upper": goal.price_upper,
            }
        return info

    def _step_info(self, state: EpisodeState, valid: bool) -> dict[str, Any]:
        return {
            "valid": valid,
            "page": state.page.value,
            "available_actions": self.actions_for(state),
            "steps": state.steps,
        }

    # -- stepping -------------------------------------------------------------------------
    def step(self, state: EpisodeState, action_text: str) -> StepResult:
        """Apply one action; invalid actions leave the state unchanged (spec 4.4)."""
        if state.done:
            info = self._step_info(state, False)
            info["error"] = FINISHED_ERROR
            return StepResult(self.observe(state), 0.0, True, info)
        state.steps += 1
        action = parse_action(action_text.strip())
        valid = action is not None and self._apply(state, action)
        reward: float = 0.0
        extra: dict[str, Any] = {}
        if state.page is Page.DONE:
            reward, extra = self._purchase(state)
        elif self.settings.max_steps is not None and state.steps >= self.settings.max_steps:
            state.done = True
            extra = {"truncated": True}
        info = self._step_info(state, valid)
        info.update(extra)
        return StepResult(self.observe(state), reward, state.done, info)

    def _apply(self, state: EpisodeState, action: Action) -> bool:
        if action.name == "search":
            return self._search(state, action.arg)
        if action.arg == "search" or action.arg not in clickables(state, self._options_of(state)):
            return False
        return self._click(state, action.arg)

    def _options_of(self, state: EpisodeState) -> dict[str, tuple[str, ...]] | None:
        product = self._product(state)
        return dict(product.options) if product else None

    def _search(self, state: EpisodeState, query: str) -> bool:
        if not query.strip():
            return False
        if self.settings.strict_search and state.page is not Page.SEARCH:
            return False
        state.query = query
        state.hits = self.engine.search(query)
        state.page, state.page_num, state.asin, state.options = Page.RESULTS, 1, None, {}
        return True

    def _click(self, state: EpisodeState, target: str) -> bool:
        if target == "back to search":
            state.clear_search()
            return True
        if state.page is Page.RESULTS:
            return self._click_on_results(state, target)
        if state.page is Page.ITEM:
            return self._click_on_item(state, target)
        if target == "< prev":  # a sub-page: back to the product, selection kept
            state.page = Page.ITEM
            return True
        return False

    def _click_on_results(self, state: EpisodeState, target: str) -> bool:
        if target == "next >":
            state.page_num += 1
        elif target == "< prev":
            state.page_num -= 1
        else:
            product = self.catalog.get(target)
            if product is None:
                return False
            state.page, state.asin, state.options = Page.ITEM, product.asin, {}
            state.visited.append(product.asin)
        return True

    def _click_on_item(self, state: EpisodeState, target: str) -> bool:
        product = self._product(state)
        assert product is not None
        if target == "< prev":  # back to results: the search is re-run and the selection cleared
            state.hits = self.engine.search(state.query)
            state.page, state.asin, state.options = Page.RESULTS, None, {}
        elif target in SUB_PAGES:
            state.page = SUB_PAGES[target]
        elif target == "buy now":
            state.page = Page.DONE
        else:
            groups = [name for name, values in product.options.items() if target in values]
            if not groups:
                return False
            state.options[groups[-1]] = target  # a value in two groups selects the later group
        return True

    def _purchase(self, state: EpisodeState) -> tuple[float, dict[str, Any]]:
        """Score the purchase and end the episode."""
        product = self._product(state)
        assert product is not None
        state.done = True
        extra: dict[str, Any] = {
            "purchased_asin": product.asin,
            "purchased_options": dict(state.options),
            "price": product.price,
            "scored": state.goal.scored,
        }
        if state.goal.scored:
            reward, reward_info = compute_reward(product, state.options, state.goal)
            extra["reward_info"] = reward_info
        else:
            reward = 0.0
            extra["reward_info"] = None
        state.reward = reward
        logger.debug("purchase %s for task %s: reward %s", product.asin, state.goal.task_id, reward)
        return reward, extra


def build_env(settings: EnvSettings | None = None) -> WebShopEnv:
    """Environment over the shipped data: catalog, a fresh search index and the goal list."""
    catalog = default_catalog()
    return WebShopEnv(catalog, SearchEngine(catalog), default_goals(), settings or EnvSettings())
