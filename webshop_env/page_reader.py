"""Reading WebShop's text observations back into structure, for the heuristic LLM stand-in.

``webshop_env.pages`` renders a page as ``[SEP]``-joined pieces (docs/webshop-env.md sections 3.1-3.5);
this is the inverse the stand-in needs: which page it is, the results it lists, the options and price of an
item. Kept apart from ``webshop_env.heuristic``'s decision rules so that a change to how pages are
rendered touches only this module. Pure: no I/O, no randomness.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# Option group names seen in the real catalog plus common Amazon variation names. Used only to
# tell group names from values on item pages, where both are plain text pieces.
# fmt: off
KNOWN_OPTION_NAMES = frozenset(
    {
        "color", "size", "style", "flavor name", "fit type", "scent", "flavor", "pattern name",
        "item shape", "number of items", "material", "material type", "size name", "color name",
        "item package quantity", "package quantity", "length", "width", "capacity",
        "configuration", "edition", "design", "pattern", "team name", "shape", "style name",
        "scent name", "item display length", "special size type", "model", "style options",
    }
)
# fmt: on

PRICE_RE = re.compile(r"\$([0-9][0-9,]*(?:\.[0-9]+)?)")
RESULTS_HEADER_RE = re.compile(r"^Page (\d+) \(Total results: (\d+)\)$")
ASIN_RE = re.compile(r"^(?:[Bb][0-9A-Za-z]{9}|[0-9]{9}[0-9Xx])$")

CLICKABLES_MAYBE_CUT = 60  # prompts list at most this many clickables


class Page(StrEnum):
    """Page kinds the heuristic distinguishes (docs/webshop-env.md section 3)."""

    SEARCH = "search"  # "WebShop [SEP] Instruction: ... [SEP] Search"
    RESULTS = "results"  # has "Page p (Total results: n)"
    ITEM = "item"  # ends with "Buy Now"
    SUBPAGE = "subpage"  # description / features / reviews
    DONE = "done"  # "Thank you for shopping ..."
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ResultItem:
    """One product triple of a results page."""

    asin: str
    title: str
    price_low: float
    price_high: float


@dataclass(frozen=True)
class ItemPage:
    """An item page: option groups in page order, title and displayed price."""

    options: list[tuple[str, list[str]]]
    title: str
    price_low: float
    price_high: float


def parse_price(text: str) -> tuple[float, float] | None:
    """Read `$a` or `$a to $b` into (low, high); None when there is no price."""
    found = [float(m.replace(",", "")) for m in PRICE_RE.findall(text)]
    if not found:
        return None
    return min(found), max(found)


def split_pieces(observation: str) -> list[str]:
    """Split an observation into its visible text pieces."""
    return [p.strip() for p in observation.split("[SEP]") if p.strip()]


def instruction_of(pieces: list[str]) -> str:
    """The instruction text: the piece after `Instruction:`."""
    for i, piece in enumerate(pieces[:-1]):
        if piece == "Instruction:":
            return pieces[i + 1]
    return ""


def classify(pieces: list[str]) -> Page:
    """Recognise the page kind from its fixed landmarks."""
    if not pieces:
        return Page.UNKNOWN
    if pieces[0].startswith("Thank you for shopping"):
        return Page.DONE
    if pieces[0] == "WebShop" and pieces[-1] == "Search":
        return Page.SEARCH
    if any(RESULTS_HEADER_RE.match(p) for p in pieces):
        return Page.RESULTS
    if pieces[-1] == "Buy Now":
        return Page.ITEM
    if "< Prev" in pieces and "Back to Search" in pieces:
        return Page.SUBPAGE
    return Page.UNKNOWN


def parse_results(pieces: list[str]) -> tuple[int, list[ResultItem]]:
    """Read the page number and the (ASIN, title, price) triples of a results page."""
    page = 1
    start = 0
    for i, piece in enumerate(pieces):
        header = RESULTS_HEADER_RE.match(piece)
        if header:
            page = int(header.group(1))
            start = i + 1
            break
    body = pieces[start:]
    while body and body[0] in ("< Prev", "Next >"):
        body = body[1:]
    items: list[ResultItem] = []
    i = 0
    while i + 2 < len(body):
        asin, title, price_text = body[i], body[i + 1], body[i + 2]
        price = parse_price(price_text)
        if ASIN_RE.match(asin) and price is not None:
            items.append(ResultItem(asin, title, price[0], price[1]))
            i += 3
        else:
            i += 1
    return page, items


def parse_item(pieces: list[str], clickables: set[str] | None = None) -> ItemPage | None:
    """Read option groups, title and price of an item page (spec 3.3).

    Group names and values are both bare pieces. A piece is a name when it is a known option
    name, or when `clickables` (the env's available actions, if the prompt listed them) says it
    is not clickable; the first piece after `< Prev` is always a name.
    """
    try:
        prev = pieces.index("< Prev")
    except ValueError:
        return None
    price_at = next((i for i in range(prev + 1, len(pieces)) if pieces[i].startswith("Price:")), None)
    if price_at is None or price_at - 1 <= prev:
        return None
    title = pieces[price_at - 1]
    price = parse_price(pieces[price_at]) or (100.0, 100.0)
    groups: list[tuple[str, list[str]]] = []
    for piece in pieces[prev + 1 : price_at - 1]:
        if not groups or _is_option_name(piece, clickables):
            groups.append((piece, []))
        else:
            groups[-1][1].append(piece)
    return ItemPage([g for g in groups if g[1]], title, price[0], price[1])


def _is_option_name(piece: str, clickables: set[str] | None) -> bool:
    """Whether an item-page piece is an option group name rather than a value.

    Clickable pieces are values (a comma inside a value may have split it in a comma-joined
    list). An unclickable piece is a name only if the list looks complete: prompts may cut it
    (the worker sends at most 60), and then only known names count.
    """
    lowered = piece.lower()
    if clickables and (lowered in clickables or all(p in clickables for p in lowered.split(", "))):
        return False
    if lowered in KNOWN_OPTION_NAMES:
        return True
    return bool(clickables) and len(clickables or ()) < CLICKABLES_MAYBE_CUT
