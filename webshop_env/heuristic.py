"""Rule-based WebShop decision logic used by the heuristic LLM stand-in. This is not a model.

It reads the current observation (docs/webshop-env.md sections 3.1-3.5), the actions already taken and, when
known, the pages they led to, and returns the next action (section 4). Pages are read by
`webshop_env.page_reader`; this module holds the rules. Everything here is pure: no I/O, no randomness.
`webshop_env.policy` wraps it in HTTP. Strategy and aim: docs/webshop-env.md section 13.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from webshop_env.page_reader import (
    ASIN_RE,
    ItemPage,
    Page,
    ResultItem,
    classify,
    instruction_of,
    parse_item,
    parse_results,
    split_pieces,
)

# Navigation buttons: clicks on these are never option selections.
NAV_CLICKS = frozenset(
    {"back to search", "< prev", "next >", "description", "features", "reviews", "buy now", "search"}
)

LEAD_IN_RE = re.compile(
    r"^\s*(?:(?:hi|hello|hey|please|ok|okay)[\s,!.]+)*"
    r"(?:i\s*(?:'m| am)\s+(?:looking|searching|shopping)\s+for|i\s*(?:'m| am)\s+in\s+need\s+of|"
    r"i\s+(?:would|'d)\s+like(?:\s+to\s+(?:buy|get|find|purchase|order|have))?|"
    r"i\s+(?:want|need|wanna)(?:\s+to\s+(?:buy|get|find|purchase|order|have))?|"
    r"(?:can|could)\s+you\s+(?:please\s+)?(?:find|get|show|search\s+for)(?:\s+me)?|"
    r"help\s+me\s+find|find\s+me|show\s+me|get\s+me|search\s+for|looking\s+for|buy\s+me|"
    r"i\s+(?:am|'m)\s+trying\s+to\s+find)\s*",
    re.IGNORECASE,
)
PRICE_CLAUSE_RE = re.compile(
    r",?\s*and\s+price\s+lower\s+than\s+([0-9][0-9,]*(?:\.[0-9]+)?)\s+dollars\.?", re.IGNORECASE
)
# Synthetic goals append " with <name>: <value>, and <name>: <value>" (spec 6.2).
SYNTHETIC_OPTIONS_RE = re.compile(
    r"\s+with\s+(?:[a-z]+ ){0,2}[a-z]+:\s*[^,]+?(?:,\s*and\s+(?:[a-z]+ ){0,2}[a-z]+:\s*[^,]+?)*$"
)
# "120ml" and "120 ml" must meet: split digits from letters before comparing.
DIGIT_LETTER_RE = re.compile(r"(?<=\d)(?=[a-z])|(?<=[a-z])(?=\d)")

# Words that carry no product or option meaning when comparing texts.
_STOP_WORDS_TEXT = """a an the and or of for with to in on at by from that this these those is are be it its i
    me my we our you your am im i'm need want looking find buy get would like please also some any
    which who what has have having should must can could will just one ones pack count"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())

DEFAULT_MAX_STEPS = 15  # ReAct-style harness cap; the prompt's "Step k of N" overrides it
# Tuned on the val split (bridge_lab/bench/policy_score.py numbers): the search engine's own order is a
# stronger signal than title overlap, so rank drops 0.05 per position; opening up to 5 items to
# find one offering the requested options pays for the extra steps.
MAX_ITEM_VISITS = 5
POSITION_WEIGHT = 0.05


@dataclass(frozen=True)
class Decision:
    """The chosen action with a one-line reason, as the stand-in "thinks" out loud."""

    action: str
    thought: str


@dataclass
class EpisodeMemory:
    """What earlier turns imply about the episode; pages themselves carry no selection marks."""

    actions: list[str] = field(default_factory=list)
    clicked_since_item: list[str] = field(default_factory=list)
    next_clicks_since_search: int = 0
    visited_asins: list[str] = field(default_factory=list)
    # asin -> (item_fit, number of option groups), from the item pages seen after opening it
    item_pages: dict[str, tuple[float, int]] = field(default_factory=dict)

    def best_visited(self, exclude: str | None = None) -> tuple[str, float] | None:
        """The visited item that offered most of the requested options (earliest on ties)."""
        seen = [(fit, -i, asin) for i, (asin, (fit, _n)) in enumerate(self.item_pages.items()) if asin != exclude]
        if not seen:
            return None
        fit, _order, asin = max(seen)
        return asin, fit


# ---------------------------------------------------------------- text helpers


def tokens(text: str) -> list[str]:
    """Lower-case alphanumeric tokens with a light plural strip, so "bags" meets "bag"."""
    out = []
    for tok in DIGIT_LETTER_RE.sub(" ", default_process(text)).split():
        if len(tok) > 3 and tok.endswith("s") and not tok.endswith("ss"):
            tok = tok[:-1]
        out.append(tok)
    return out


def content_tokens(text: str) -> list[str]:
    """Tokens without stop words: the words that say what the product is."""
    return [t for t in tokens(text) if t not in STOP_WORDS]


def price_limit(instruction: str) -> float | None:
    """The instruction's "price lower than X dollars" limit, if it has one."""
    match = PRICE_CLAUSE_RE.search(instruction)
    return float(match.group(1).replace(",", "")) if match else None


def strip_price_clause(instruction: str) -> str:
    """Drop the price clause: it only adds noise words to a BM25 query."""
    return PRICE_CLAUSE_RE.sub("", instruction).strip()


def search_query(instruction: str, keep_synthetic_options: bool = True) -> str:
    """Build the search text: the instruction minus price clause, lead-in and trailing period."""
    text = strip_price_clause(instruction).strip().rstrip(".").strip()
    if not keep_synthetic_options:
        text = SYNTHETIC_OPTIONS_RE.sub("", text).strip()
    stripped = LEAD_IN_RE.sub("", text, count=1).strip()
    text = stripped or text
    text = re.sub(r"^(?:a|an|the|some)\s+", "", text, flags=re.IGNORECASE)
    return text.replace("[", " ").replace("]", " ").strip() or instruction.strip()


def remember(instruction: str, actions: list[str], pages_after: list[str] | None = None) -> EpisodeMemory:
    """Replay earlier actions (and the pages they led to, when known) to rebuild episode state."""
    memory = EpisodeMemory(actions=list(actions))
    after = pages_after or []
    for i, action in enumerate(actions):
        name, arg = action.split("[", 1)
        arg = arg[:-1].strip().lower()
        if name == "search" or arg == "back to search":
            memory.clicked_since_item = []
            memory.next_clicks_since_search = 0
        elif ASIN_RE.match(arg):
            memory.clicked_since_item = []
            memory.visited_asins.append(arg)
            item = parse_item(split_pieces(after[i])) if i < len(after) else None
            if item is not None:
                memory.item_pages[arg] = (item_fit(instruction, item), len(item.options))
        elif arg == "next >":
            memory.next_clicks_since_search += 1
        elif arg not in NAV_CLICKS:
            memory.clicked_since_item.append(arg)
    return memory


# ---------------------------------------------------------------- scoring


def title_score(instruction: str, title: str) -> float:
    """How well a result title matches the instruction: share of instruction words it contains.

    Fuzzy token_set_ratio breaks near-ties so a title that echoes a whole phrase wins.
    """
    want = set(content_tokens(search_query(instruction, keep_synthetic_options=False)))
    if not want:
        return 0.0
    have = set(content_tokens(title))
    overlap = len(want & have) / len(want)
    fuzzy = fuzz.token_set_ratio(instruction, title, processor=default_process) / 100.0
    return overlap + 0.1 * fuzzy


def within_budget(low: float, high: float, limit: float | None) -> float:
    """1 when surely under the limit, 0.5 when a price range straddles it, 0 when over."""
    if limit is None or high <= limit:
        return 1.0
    return 0.5 if low <= limit else 0.0


def rank_results(instruction: str, items: list[ResultItem], exclude: set[str]) -> list[tuple[float, ResultItem]]:
    """Order results by title match, budget and (slightly) the search engine's own order."""
    limit = price_limit(instruction)
    ranked = []
    for position, item in enumerate(items):
        if item.asin.lower() in exclude:
            continue
        budget = within_budget(item.price_low, item.price_high, limit)
        score = title_score(instruction, item.title) - POSITION_WEIGHT * position - (1.0 - budget)
        ranked.append((score, item))
    ranked.sort(key=lambda pair: -pair[0])
    return ranked


def option_score(value: str, instruction_text: str, instruction_tokens: set[str]) -> float:
    """How strongly the instruction asks for an option value (0..~1.2).

    Share of the value's meaningful words present in the instruction, plus a bonus for the value
    appearing as a phrase. Specific matches ("x-large" asked, both "large" and "x-large" offered)
    win the tie through the matched-word count.
    """
    value_tokens = [t for t in tokens(value) if t not in STOP_WORDS or t.isdigit()]
    if not value_tokens:
        return 0.0
    matched = [t for t in value_tokens if t in instruction_tokens]
    if not matched:
        return 0.0
    score = len(matched) / len(value_tokens) + 0.01 * len(matched)
    phrase = default_process(value)
    if phrase and re.search(r"(?<![a-z0-9])" + re.escape(phrase) + r"(?![a-z0-9])", instruction_text):
        score += 0.2
    return score


def requested_options(instruction: str) -> dict[str, str]:
    """The "with <name>: <value>, and <name>: <value>" pairs of a synthetic instruction (spec 6.2)."""
    match = SYNTHETIC_OPTIONS_RE.search(strip_price_clause(instruction).rstrip("."))
    if not match:
        return {}
    body = re.sub(r"^\s*with\s+", "", match.group(0))
    pairs = {}
    for part in re.split(r",\s*and\s+", body):
        name, _, value = part.partition(":")
        if value.strip():
            pairs[name.strip().lower()] = value.strip().lower()
    return pairs


def pick_requested(wanted: str, values: list[str]) -> str | None:
    """The group value that is the requested one: exact, else the closest fuzzy match above 85."""
    lowered = [v.lower() for v in values]
    if wanted in lowered:
        return values[lowered.index(wanted)]
    scored = [(fuzz.ratio(wanted, v, processor=default_process), v) for v in values]
    best_score, best = max(scored)
    return best if best_score > 85 else None


def choose_options(instruction: str, item: ItemPage) -> list[str]:
    """Pick one value per option group: the requested or best-matching value, else the first.

    A wrong selection costs nothing against no selection (the reward counts goal options met by
    any selected value), so every group gets a value.
    """
    requested = requested_options(instruction)
    text = default_process(strip_price_clause(instruction))
    instruction_tokens = set(tokens(text))
    chosen = []
    for name, values in item.options:
        exact = pick_requested(requested[name.lower()], values) if name.lower() in requested else None
        if exact is not None:
            chosen.append(exact)
            continue
        scored = [(option_score(v, text, instruction_tokens), -i, v) for i, v in enumerate(values)]
        best = max(scored)
        chosen.append(best[2] if best[0] >= 0.5 else values[0])
    return chosen


def item_fit(instruction: str, item: ItemPage) -> float:
    """Share of the instruction's explicitly requested option values this item offers.

    Only synthetic instructions name their options; for others every item fits (1.0).
    """
    requested = requested_options(instruction)
    if not requested:
        return 1.0
    groups = {name.lower(): values for name, values in item.options}
    found = sum(1 for name, wanted in requested.items() if name in groups and pick_requested(wanted, groups[name]))
    return found / len(requested)


# ---------------------------------------------------------------- decisions


def decide(
    observation: str,
    previous_actions: list[str],
    clickables: set[str] | None = None,
    pages_after: list[str] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> Decision:
    """Choose the next WebShop action.

    `pages_after[i]` is the observation that followed `previous_actions[i]` (optional: it lets the
    heuristic compare items it has already opened); `max_steps` is the harness's step cap, which
    bounds how much exploring is affordable.
    """
    pieces = split_pieces(observation)
    page = classify(pieces)
    instruction = instruction_of(pieces)
    memory = remember(instruction, previous_actions, pages_after)
    remaining = max_steps - len(previous_actions)
    if page is Page.SEARCH:
        query = search_query(instruction)
        return Decision(f"search[{query}]", "Search page: search for the instruction without its price.")
    if page is Page.RESULTS:
        return decide_results(instruction, pieces, memory, remaining)
    if page is Page.ITEM:
        return decide_item(instruction, pieces, memory, clickables, remaining)
    if page is Page.SUBPAGE:
        return Decision("click[< Prev]", "Sub-page: go back to the product page.")
    if page is Page.DONE:
        return Decision("click[Buy Now]", "The episode is finished; nothing left to do.")
    if instruction:
        return Decision(f"search[{search_query(instruction)}]", "Unrecognised page: search again.")
    return Decision("click[Buy Now]", "Unrecognised observation: try to finish.")


def may_explore(memory: EpisodeMemory, remaining: int, groups: int) -> bool:
    """Whether there are steps left to open one more item and still come back to the best one.

    Opening another costs `< Prev` + click; returning costs the same again; then up to `groups`
    option clicks and Buy Now. The item page and the results page must agree, or they would
    bounce, so both call this with the option-group count of the item just seen.
    """
    return len(memory.visited_asins) < MAX_ITEM_VISITS and remaining >= groups + 4


def decide_results(instruction: str, pieces: list[str], memory: EpisodeMemory, remaining: int) -> Decision:
    """Open the best affordable unvisited match, or go back to the best item already seen."""
    _page, items = parse_results(pieces)
    last = memory.visited_asins[-1] if memory.visited_asins else None
    last_groups = memory.item_pages.get(last, (1.0, 0))[1] if last else 0
    best_seen = memory.best_visited()
    on_page = {item.asin.lower(): item.asin for item in items}
    if best_seen and best_seen[0] in on_page and not may_explore(memory, remaining, last_groups):
        asin = on_page[best_seen[0]]
        return Decision(f"click[{asin}]", "No budget to look further: back to the best item seen.")
    ranked = rank_results(instruction, items, exclude=set(memory.visited_asins))
    if not ranked:
        ranked = rank_results(instruction, items, exclude=set())
    if not ranked:
        if memory.next_clicks_since_search == 0 and remaining > 4:
            return Decision("click[Next >]", "No products listed here: try the next page.")
        return Decision(f"search[{search_query(instruction, False)}]", "No results: search with fewer words.")
    best_score, best = ranked[0]
    if best_score < 0.0 and memory.next_clicks_since_search == 0 and not memory.visited_asins:
        return Decision("click[Next >]", "Nothing on this page is within budget: try the next page.")
    return Decision(f"click[{best.asin}]", f"Best match within budget: {best.title[:80]}")


def decide_item(
    instruction: str, pieces: list[str], memory: EpisodeMemory, clickables: set[str] | None, remaining: int
) -> Decision:
    """Leave an item lacking requested options while budget allows; else select options, buy."""
    item = parse_item(pieces, clickables)
    if item is None or remaining <= 1:
        return Decision("click[Buy Now]", "Buy the product now.")
    clicked = set(memory.clicked_since_item)
    if not clicked:
        fit = item_fit(instruction, item)
        current = memory.visited_asins[-1] if memory.visited_asins else None
        better = memory.best_visited(exclude=current)
        if fit < 1.0 and may_explore(memory, remaining - 1, len(item.options)):
            return Decision("click[< Prev]", "This item lacks a requested option: back to the results.")
        if better and better[1] > fit and remaining >= len(item.options) + 3:
            return Decision("click[< Prev]", "An earlier item matched better: go back to it.")
    for value in choose_options(instruction, item):
        if value.lower() not in clicked:
            return Decision(f"click[{value}]", f"Select the option '{value}'.")
    return Decision("click[Buy Now]", "All options chosen: buy.")
