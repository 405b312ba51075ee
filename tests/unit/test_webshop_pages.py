"""Observation rendering (docs/webshop-env.md section 3 and the section 12 vectors)."""

from __future__ import annotations

from webshop_env.catalog import default_catalog, format_price
from webshop_env.goals import default_goals
from webshop_env.pages import join_pieces, results_page
from webshop_env.state import EpisodeState, Page

HAIR_TASK = "ws_B09R4RJSFP_8603"


def _hair_state() -> EpisodeState:
    return EpisodeState(goal=default_goals().by_task_id[HAIR_TASK])


def test_join_trims_and_drops_empty_pieces() -> None:
    assert join_pieces([" a ", "", "  ", "b\n"]) == "a [SEP] b"


def test_display_price_is_python_float_text() -> None:
    assert format_price([877.8]) == "$877.8"
    assert format_price([35]) == "$35.0"
    assert format_price([10.3]) == "$10.3"
    assert format_price([16.82, 35.0]) == "$16.82 to $35.0"
    assert format_price([]) == "$100.0"


def test_catalog_display_prices_match_the_data() -> None:
    products = default_catalog().products
    assert default_catalog().get("B06Y3VLDFB").display_price == "$877.8"  # type: ignore[union-attr]
    assert sum(1 for p in products if len(p.pricing) == 2) == 93


def test_results_page_two_with_23_hits() -> None:
    catalog = default_catalog()
    hits = tuple(p.asin for p in catalog.products[:23])
    text = join_pieces(results_page("find x", hits, 2, catalog))
    pieces = text.split(" [SEP] ")
    assert pieces[:6] == [
        "Instruction:",
        "find x",
        "Back to Search",
        "Page 2 (Total results: 23)",
        "< Prev",
        "Next >",
    ]
    assert len(pieces) == 6 + 30
    first = catalog.products[10]
    assert pieces[6:9] == [first.asin, first.title.strip(), first.display_price]


def test_results_page_one_and_past_the_end() -> None:
    catalog = default_catalog()
    hits = tuple(p.asin for p in catalog.products[:50])
    page1 = join_pieces(results_page("x", hits, 1, catalog))
    assert "< Prev" not in page1 and page1.startswith("Instruction: [SEP] x [SEP] Back to Search [SEP] Page 1")
    page6 = join_pieces(results_page("x", hits, 6, catalog))
    assert (
        page6 == "Instruction: [SEP] x [SEP] Back to Search [SEP] Page 6 (Total results: 50) [SEP] < Prev [SEP] Next >"
    )


def test_item_page_matches_spec_example() -> None:
    from webshop_env.env import build_env

    env = build_env()
    state = _hair_state()
    state.page, state.asin = Page.ITEM, "B09R4RJSFP"
    instr = state.goal.instruction_text
    title = default_catalog().get("B09R4RJSFP").title  # type: ignore[union-attr]
    expected = (
        f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] < Prev [SEP] color [SEP] 120ml [SEP] 60ml "
        f"[SEP] {title} [SEP] Price: $100.0 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] "
        "Reviews [SEP] Buy Now"
    )
    assert env.observe(state) == expected
    state.options = {"color": "120ml"}  # selections are not marked
    assert env.observe(state) == expected


def test_search_page_and_sub_pages() -> None:
    from webshop_env.env import build_env

    env = build_env()
    state = _hair_state()
    instr = state.goal.instruction_text
    assert instr.startswith("i need a 120 ml hair mask treatment, and price lower than 1")
    assert env.observe(state) == f"WebShop [SEP] Instruction: [SEP] {instr} [SEP] Search"
    empty = next(p for p in default_catalog().products if not p.description.strip())
    state.asin, state.page = empty.asin, Page.DESCRIPTION
    assert env.observe(state) == f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] < Prev"
    state.page = Page.REVIEWS
    assert env.observe(state) == f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] < Prev"
    state.page = Page.FEATURES
    bullets = [b.strip() for b in empty.bullets if b.strip()]
    assert env.observe(state).split(" [SEP] ")[4:] == bullets
