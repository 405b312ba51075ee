"""Action parsing (spec 4.1) and the clickables of each page (spec 4.2)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from webshop_env.search import page_slice
from webshop_env.state import EpisodeState, Page

# Greedy: the name runs to the last "[" that still leaves "<text>]"; text after the last "]" is ignored.
_ACTION = re.compile(r"(.+)\[(.+)\]")
ACTION_NAMES = ("search", "click")
ITEM_BUTTONS = ("back to search", "< prev", "description", "features", "reviews", "buy now")
NAV_BUTTONS = ("back to search", "< prev")


@dataclass(frozen=True, slots=True)
class Action:
    """A parsed action: ``search`` or ``click`` with its lower-cased argument."""

    name: str
    arg: str


def parse_action(text: str) -> Action | None:
    """``name[argument]`` -> Action, or None when the text is not a search/click action."""
    match = _ACTION.match(text)
    if match is None:
        return None
    name, arg = match.group(1), match.group(2)
    if name not in ACTION_NAMES:
        return None
    return Action(name, arg.lower())


def clickables(state: EpisodeState, option_values: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """Lower-case clickable texts of the current page, in page order."""
    if state.page is Page.SEARCH:
        return ["search"]
    if state.page is Page.RESULTS:
        buttons = ["back to search", *(["< prev"] if state.page_num > 1 else []), "next >"]
        return buttons + [a.lower() for a in page_slice(state.hits, state.page_num)]
    if state.page is Page.ITEM:
        values = dict.fromkeys(v for vs in (option_values or {}).values() for v in vs)
        return [*ITEM_BUTTONS, *values]
    if state.page is Page.DONE:
        return []
    return list(NAV_BUTTONS)


def available_actions(state: EpisodeState, option_values: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:
    """AgentBench-shaped ``{"has_search_bar", "clickables"}``."""
    return {"has_search_bar": state.page is Page.SEARCH, "clickables": clickables(state, option_values)}
