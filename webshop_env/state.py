"""Per-episode state: which page the agent is on and what it has chosen (spec 1, "Sessions").

Kept small on purpose (slots, no rendered text): thousands of idle sessions
must fit in little memory, and every observation is cheap to re-render.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from webshop_env.goals import Goal


class Page(StrEnum):
    """The page kinds of WebShop's text mode; the value is what ``info.page`` reports."""

    SEARCH = "search"  # start page with the search bar
    RESULTS = "results"  # ten search hits per page
    ITEM = "item"  # product page with options and Buy Now
    DESCRIPTION = "description"  # product sub-page
    FEATURES = "features"  # product sub-page (bullet points)
    REVIEWS = "reviews"  # product sub-page (always empty)
    DONE = "done"  # after Buy Now


SUB_PAGES = {"description": Page.DESCRIPTION, "features": Page.FEATURES, "reviews": Page.REVIEWS}


@dataclass(slots=True)
class EpisodeState:
    """Everything one episode needs to render pages and score the purchase."""

    goal: Goal
    page: Page = Page.SEARCH
    query: str = ""
    hits: tuple[str, ...] = ()
    page_num: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    visited: list[str] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    reward: float = 0.0

    def clear_search(self) -> None:
        """Back to Search: forget the query, page, product, options and visited list."""
        self.page = Page.SEARCH
        self.query = ""
        self.hits = ()
        self.page_num = 1
        self.asin = None
        self.options = {}
        self.visited = []
