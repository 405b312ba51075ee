"""Purchase reward (docs/webshop-env.md section 7).

reward = r_type * (N_att + N_opt + r_price) / (|attributes| + |options| + 1)

The fuzzy scorer reproduces ``thefuzz.fuzz.token_set_ratio`` with its default
preprocessing (non-ASCII dropped, then rapidfuzz's ``default_process``, result
rounded to an integer) because the 85 threshold is compared with that rounded
number.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from webshop_env.catalog import DATA_DIR, Product
from webshop_env.goals import Goal, GoalOption
from webshop_env.nouns import extract_nouns, noun_extractor_name

logger = logging.getLogger("webshop_env.reward")

MATCH_THRESHOLD = 85
COLOR_FILE = "color_words.txt"
BREADCRUMB_SEP = "\u203a"  # the right-pointing angle quote joining product_category parts


@lru_cache(maxsize=1)
def color_words(path: Path = DATA_DIR / COLOR_FILE) -> tuple[str, ...]:
    """The colour vocabulary in file order (order matters: first substring hit wins)."""
    return tuple(w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip())


def normalize_color(value: str) -> str:
    """Replace ``value`` by the first colour word occurring anywhere inside it (spec 7.3)."""
    for word in color_words():
        if word in value:
            return word
    return value


def _to_ascii(text: str) -> str:
    return text.encode("ascii", errors="ignore").decode("ascii")


def token_set_ratio(a: str, b: str) -> int:
    """thefuzz-compatible token_set_ratio: ASCII-only, default-processed, rounded."""
    pa, pb = default_process(_to_ascii(a)), default_process(_to_ascii(b))
    if not pa or not pb:
        return 0
    return round(fuzz.token_set_ratio(pa, pb))


def fuzzy_match(a: str, b: str) -> bool:
    """Strictly above the threshold of 85."""
    return token_set_ratio(a, b) > MATCH_THRESHOLD


def goal_option_text(option: GoalOption) -> str:
    """The text a goal option is compared as, after upstream's colour rule.

    Human goals carry bare values: substring colour rule.  Synthetic goals carry
    (name, value) pairs: the rule fires only if an element *is* a colour word
    (tuple membership upstream), and otherwise the scorer sees ``name value``.
    """
    name, value = option
    if name is None:
        return normalize_color(value)
    for word in color_words():
        if word in (name, value):
            return word
    return f"{name} {value}"


def count_attribute_matches(product: Product, attributes: tuple[str, ...]) -> int:
    """N_att: fuzzy match against product attributes, else substring of title/bullets/description."""
    title = product.title.lower()
    bullets = " ".join(product.bullets).lower()
    description = product.description.lower()
    count = 0
    for goal_attr in attributes:
        if any(fuzzy_match(a, goal_attr) for a in product.attributes) or any(
            goal_attr in text for text in (title, bullets, description)
        ):
            count += 1
    return count


def count_option_matches(selected: list[str], goal_options: tuple[GoalOption, ...]) -> int:
    """N_opt: each goal option counts once if any selected value matches it."""
    chosen = [normalize_color(v) for v in selected]
    return sum(1 for g in goal_options if any(fuzzy_match(c, goal_option_text(g)) for c in chosen))


@dataclass(frozen=True, slots=True)
class TypeMatch:
    """The product-type gate's inputs and result (spec 7.5)."""

    r_type: float
    query_match: bool
    category_match: bool
    title_score: float


def _breadcrumb_parts(breadcrumb: str) -> set[str]:
    return {part.strip() for part in breadcrumb.split(BREADCRUMB_SEP)}


def type_match(product: Product, goal: Goal) -> TypeMatch:
    """r_type from query equality, shared breadcrumb parts and shared title nouns."""
    query_match = product.query == goal.query
    category_match = len(_breadcrumb_parts(product.product_category) & _breadcrumb_parts(goal.product_category)) >= 2
    goal_nouns = extract_nouns(goal.name)
    shared = set(extract_nouns(product.title)) & set(goal_nouns)
    title_score = len(shared) / len(goal_nouns) if goal_nouns else 0.2
    return TypeMatch(type_gate(query_match, category_match, title_score), query_match, category_match, title_score)


def type_gate(query_match: bool, category_match: bool, title_score: float) -> float:
    """r_type: 0.5 without any type evidence; title-noun overlap below 0.1 / at 0 overrides all."""
    if title_score == 0.0:
        return 0.0
    if title_score < 0.1:
        return 0.1
    if not (query_match or category_match or title_score > 0.2):
        return 0.5
    return 1.0


def compute_reward(
    product: Product, selected: dict[str, str], goal: Goal, price: float | None = None
) -> tuple[float, dict[str, Any]]:
    """Reward and ``reward_info`` (spec 7.6) for buying ``product`` with ``selected`` options."""
    price = product.price if price is None else price
    n_att, n_opt = len(goal.attributes), len(goal.goal_options)
    denominator = n_att + n_opt + 1
    att_hits = count_attribute_matches(product, goal.attributes)
    opt_hits = count_option_matches(list(selected.values()), goal.goal_options)
    r_price = price <= goal.price_upper
    gate = type_match(product, goal)
    # Same float operation order as upstream: the fraction first, then the type gate.
    reward = (att_hits + opt_hits + float(r_price)) / denominator * gate.r_type
    info: dict[str, Any] = {
        "r_type": gate.r_type,
        "r_att": att_hits / n_att if n_att else 0.0,
        "w_att": n_att / denominator,
    }
    if n_opt:
        info["r_option"] = opt_hits / n_opt
        info["w_option"] = n_opt / denominator
    info.update(
        r_price=r_price,
        w_price=1 / denominator,
        query_match=gate.query_match,
        category_match=gate.category_match,
        title_score=gate.title_score,
        noun_extractor=noun_extractor_name(),
    )
    return reward, info
