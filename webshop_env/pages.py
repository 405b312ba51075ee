"""Observation text of each page, character for character as WebShop's text mode (spec 3).

A page is a list of text pieces; the observation is the non-empty trimmed
pieces joined with `` [SEP] ``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from webshop_env.catalog import Catalog, Product
from webshop_env.search import page_slice
from webshop_env.state import EpisodeState, Page

SEP = " [SEP] "
DONE_HEAD = ("Thank you for shopping with us!", "Your code:", "None", "(Paste it in your MTurk interface.)")
# Upstream text mode verbatim, including the "instuction" typo.
DONE_TARGET = (
    "attrs",
    "None",
    "category",
    "None",
    "query",
    "None",
    "product category",
    "None",
    "Target",
    "asin",
    "options",
    "attrs",
    "price upper",
    "instuction text",
    "category",
    "product category",
    "query",
    "Goal",
    "None",
    "Reward",
    "Your score (min 0.0, max 1.0)",
)


def join_pieces(pieces: Iterable[str]) -> str:
    """Trim every piece, drop empty ones, join with `` [SEP] ``."""
    return SEP.join(t for t in (p.strip() for p in pieces) if t)


def _header(instruction: str) -> list[str]:
    return ["Instruction:", instruction, "Back to Search"]


def search_page(instruction: str) -> list[str]:
    """Start page: the only one beginning with ``WebShop`` and ending with ``Search``."""
    return ["WebShop", "Instruction:", instruction, "Search"]


def results_page(instruction: str, hits: tuple[str, ...], page: int, catalog: Catalog) -> list[str]:
    """Results: page header, ``< Prev`` from page 2, ``Next >`` always, then asin/title/price triples."""
    pieces = [*_header(instruction), f"Page {page} (Total results: {len(hits)})"]
    if page > 1:
        pieces.append("< Prev")
    pieces.append("Next >")
    for asin in page_slice(hits, page):
        product = catalog.by_asin[asin]
        pieces += [product.asin, product.title, product.display_price]
    return pieces


def item_page(instruction: str, product: Product) -> list[str]:
    """Product page: option groups in catalog order, then title, price, rating and buttons."""
    pieces = [*_header(instruction), "< Prev"]
    for name, values in product.options.items():
        pieces += [name, *values]
    pieces += [product.title, f"Price: {product.display_price}", "Rating: N.A."]
    pieces += ["Description", "Features", "Reviews", "Buy Now"]
    return pieces


def sub_page(instruction: str, product: Product, page: Page) -> list[str]:
    """Description / Features / Reviews (reviews are always empty upstream)."""
    pieces = [*_header(instruction), "< Prev"]
    if page is Page.DESCRIPTION:
        pieces.append(product.description)
    elif page is Page.FEATURES:
        pieces += list(product.bullets)
    return pieces


def done_page(asin: str, options: dict[str, str], reward: float) -> list[str]:
    """The "Thank you for shopping" page with the purchase and the score."""
    return [
        *DONE_HEAD,
        "Purchased",
        "asin",
        asin,
        "options",
        json.dumps(options),
        *DONE_TARGET,
        repr(float(reward)),
        "Reward Details",
        "None",
    ]


def render(state: EpisodeState, catalog: Catalog) -> str:
    """The observation for the state's current page."""
    instruction = state.goal.instruction_text
    product = catalog.by_asin.get(state.asin) if state.asin else None
    if state.page is Page.SEARCH or (product is None and state.page is not Page.RESULTS):
        return join_pieces(search_page(instruction))
    if state.page is Page.RESULTS:
        return join_pieces(results_page(instruction, state.hits, state.page_num, catalog))
    assert product is not None
    if state.page is Page.ITEM:
        return join_pieces(item_page(instruction, product))
    if state.page is Page.DONE:
        return join_pieces(done_page(product.asin, state.options, state.reward))
    return join_pieces(sub_page(instruction, product, state.page))
