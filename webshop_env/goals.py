"""Goals (tasks): human tasks with real targets plus synthetic goals (docs/webshop-env.md section 6).

The goal list is the 13 human tasks whose target is in the 1,000-product catalog
(file order) followed by the 6,910 synthetic goals (catalog order, option
combinations in alphabetical option-name order), shuffled once with a
``random.Random(233)`` like upstream.  ``goal_id`` indexes that list; splits are
test = goals 0-499, val = 500-1,499, train = the rest.  Task ids are stable
handles: human tasks keep ``ws_<ASIN>_<n>``, synthetic ones are
``syn_<ASIN>_<k>`` with k the option combination's index.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from webshop_env.catalog import DATA_DIR, DATA_SEED, Catalog, Product, default_catalog

logger = logging.getLogger("webshop_env.goals")

HUMAN_TASKS_FILE = "human_tasks.json"
SHUFFLE_SEED = 233
PRICE_THRESHOLDS = tuple(range(10, 1000, 10))
NO_PRICE_LIMIT = 1_000_000.0
SPLITS = {"test": (0, 500), "val": (500, 1500), "train": (1500, None)}

# A goal option: (option name, value) for synthetic goals, (None, value) for human ones.
GoalOption = tuple[str | None, str]


@dataclass(frozen=True, slots=True)
class Goal:
    """What the agent must buy, and what the reward compares the purchase with."""

    task_id: str
    asin: str
    name: str
    query: str
    category: str
    product_category: str
    instruction: str  # the instruction as written, without the price clause
    instruction_text: str  # what the agent sees: instruction + options + price clause
    attributes: tuple[str, ...]
    goal_options: tuple[GoalOption, ...]
    price_upper: float
    weight: float = 1.0
    scored: bool = True


def price_upper_and_clause(price: float, rng: random.Random) -> tuple[float, str]:
    """Spec 6.3: two of the first four thresholds above the price, keep the larger."""
    above = [t for t in PRICE_THRESHOLDS if t > price][:4]
    if len(above) < 2:
        return NO_PRICE_LIMIT, ""
    upper = float(max(rng.sample(above, 2)))
    return upper, f", and price lower than {upper:.2f} dollars"


def _goal_rng(task_id: str, seed: int) -> random.Random:
    return random.Random(f"upper:{seed}:{task_id}")


def _goal_for(
    product: Product,
    task_id: str,
    instruction: str,
    attributes: tuple[str, ...],
    goal_options: tuple[GoalOption, ...],
    seed: int,
) -> Goal:
    """A goal to buy ``product``: human and synthetic goals differ only in their words and options;
    the price limit is drawn per task id, so a goal reads the same on every load."""
    upper, clause = price_upper_and_clause(product.price, _goal_rng(task_id, seed))
    return Goal(
        task_id=task_id,
        asin=product.asin,
        name=product.title,
        query=product.query,
        category=product.category,
        product_category=product.product_category,
        instruction=instruction,
        instruction_text=instruction + clause,
        attributes=attributes,
        goal_options=goal_options,
        price_upper=upper,
    )


def _human_goal(record: dict[str, Any], product: Product, seed: int) -> Goal:
    instruction = str(record["instruction"]).strip().strip(".")
    target = record.get("target_attributes") or {}
    return _goal_for(
        product,
        str(record["task_id"]),
        instruction,
        tuple(target.get("attributes") or ()),
        tuple((None, str(v)) for v in target.get("options") or ()),
        seed,
    )


def _synthetic_goals(product: Product, seed: int) -> list[Goal]:
    """One goal per combination of the product's option values (spec 6.2); weights set later."""
    assert product.instruction is not None
    names = sorted(product.options)
    goals = []
    for k, values in enumerate(itertools.product(*(product.options[n] for n in names))):
        pairs = tuple(zip(names, values, strict=True))
        options_text = ", and ".join(f"{n}: {v}" for n, v in pairs)
        text = product.instruction + (f" with {options_text}" if pairs else "")
        task_id = f"syn_{product.asin}_{k}"
        goals.append(_goal_for(product, task_id, text, product.instruction_attributes, pairs, seed))
    return goals


def _with_attribute_weights(goals: list[Goal]) -> list[Goal]:
    """Weight = mean over the goal's attributes of 1 / (goals containing that attribute)."""
    counts = Counter(a for g in goals for a in g.attributes)
    weighted = []
    for g in goals:
        weight = sum(1.0 / counts[a] for a in g.attributes) / len(g.attributes) if g.attributes else 1.0
        weighted.append(dataclasses.replace(g, weight=weight))
    return weighted


def read_human_tasks(data_dir: Path = DATA_DIR) -> list[dict[str, Any]]:
    """The human tasks (``webshop_tasks.json`` records) whose target is a real catalog product."""
    with (data_dir / HUMAN_TASKS_FILE).open(encoding="utf-8") as handle:
        records: list[dict[str, Any]] = json.load(handle)
    return records


def build_goals(catalog: Catalog, human_tasks: Iterable[dict[str, Any]], seed: int = DATA_SEED) -> list[Goal]:
    """The shuffled goal list that ``goal_id`` indexes."""
    human = [
        _human_goal(r, catalog.by_asin[r["asin"]], seed)
        for r in human_tasks
        if r["asin"] in catalog.by_asin and (r.get("target_attributes") or {}).get("attributes")
    ]
    synthetic = _with_attribute_weights(
        [g for p in catalog.products if p.instruction for g in _synthetic_goals(p, seed)]
    )
    goals = human + synthetic
    random.Random(SHUFFLE_SEED).shuffle(goals)
    logger.info("built %d goals (%d human, %d synthetic)", len(goals), len(human), len(synthetic))
    return goals


def normalize_instruction(text: str) -> str:
    """Key for matching a reset ``instruction`` to a task: trimmed, lower case, no trailing periods."""
    return text.strip().lower().rstrip(".").strip()


class GoalSet:
    """The goal list with lookups by task id and by instruction text."""

    def __init__(self, goals: list[Goal]) -> None:
        self.goals = goals
        self.by_task_id = {g.task_id: g for g in goals}
        self.index_of = {g.task_id: i for i, g in enumerate(goals)}
        self.by_instruction: dict[str, Goal] = {}
        for g in goals:  # full texts win over bare instructions; first goal wins a tie
            self.by_instruction.setdefault(normalize_instruction(g.instruction_text), g)
        for g in goals:
            self.by_instruction.setdefault(normalize_instruction(g.instruction), g)
        self.weights = [g.weight for g in goals]

    def __len__(self) -> int:
        return len(self.goals)

    def match_instruction(self, text: str) -> Goal | None:
        """The task whose instruction equals ``text`` (spec 1, rule 3), if any."""
        return self.by_instruction.get(normalize_instruction(text))

    def random_goal(self, rng: random.Random) -> Goal:
        """A goal drawn with probability proportional to its weight (spec 6.4)."""
        return rng.choices(self.goals, weights=self.weights, k=1)[0]

    def split(self, name: str) -> list[Goal]:
        """Goals of one split, in goal-list order."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {sorted(SPLITS)}")
        start, end = SPLITS[name]
        return self.goals[start:end]


@lru_cache(maxsize=1)
def default_goals() -> GoalSet:
    """Goals over the shipped catalog, built once per process."""
    return GoalSet(build_goals(default_catalog(), read_human_tasks()))


def load_tasks(split: str = "test", limit: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Task list for harnesses: ``{"task_id", "instruction", "goal_id", "split"}`` dicts.

    ``seed`` 0 keeps goal-list order (so ``limit`` N gives the split's first N
    goals); any other seed shuffles the split with ``random.Random(seed)``
    before ``limit`` applies.  ``instruction`` is the full text, price clause
    included, exactly as the server shows it.
    """
    goal_set = default_goals()
    goals = goal_set.split(split)
    if seed:
        goals = list(goals)
        random.Random(seed).shuffle(goals)
    if limit is not None:
        goals = goals[: max(limit, 0)]
    return [
        {
            "task_id": g.task_id,
            "instruction": g.instruction_text,
            "goal_id": goal_set.index_of[g.task_id],
            "split": split,
        }
        for g in goals
    ]
