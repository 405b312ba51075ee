"""The heuristic LLM stand-in's WebShop rules: what it reads from the conversation and which action it picks.

Its HTTP server, started as a real process, is tested in tests/integration/test_llm_stand_in_server.py.
"""

from __future__ import annotations

from webshop_env.heuristic import decide, price_limit, search_query
from webshop_env.page_reader import Page, classify, parse_item, split_pieces
from webshop_env.policy import extract_observation, read_conversation

INSTRUCTION = "i need a 120 ml hair mask treatment, and price lower than 130.00 dollars"
SEARCH_PAGE = f"WebShop [SEP] Instruction: [SEP] {INSTRUCTION} [SEP] Search"
RESULTS_PAGE = (
    f"Instruction: [SEP] {INSTRUCTION} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > "
    "[SEP] B000AAAAAA [SEP] Cotton Socks for Men, 6 Pairs [SEP] $12.5 "
    "[SEP] B079HGJ5MH [SEP] Linange Milk and Keratin Hair Mask Treatment 500ml [SEP] $149.95 "
    "[SEP] B09R4RJSFP [SEP] Magical Hair Treatment Mask Deep Conditioner Hair Care Essence (60ML) "
    "[SEP] $100.0"
)
ITEM_PAGE = (
    f"Instruction: [SEP] {INSTRUCTION} [SEP] Back to Search [SEP] < Prev [SEP] color [SEP] 60ml [SEP] 120ml "
    "[SEP] Magical Hair Treatment Mask Deep Conditioner Hair Care Essence (60ML) [SEP] Price: $100.0 "
    "[SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
)
SHIRT = "i want a blue slim fit men's shirt in x-large, and price lower than 40.00 dollars"
SHIRT_PAGE = (
    f"Instruction: [SEP] {SHIRT} [SEP] Back to Search [SEP] < Prev [SEP] color [SEP] red [SEP] navy blue "
    "[SEP] size [SEP] small [SEP] large [SEP] x-large [SEP] Slim Fit Shirt [SEP] Price: $19.99 to $25.0 "
    "[SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
)


def test_search_page_searches_instruction_without_price_clause() -> None:
    decision = decide(SEARCH_PAGE, [])
    assert decision.action == "search[120 ml hair mask treatment]"


def test_search_query_drops_lead_in_and_optionally_synthetic_options() -> None:
    text = "Find me slim fit shirts with color: blue, and size: x-large, and price lower than 20.00 dollars"
    assert search_query(text) == "slim fit shirts with color: blue, and size: x-large"
    assert search_query(text, keep_synthetic_options=False) == "slim fit shirts"
    assert price_limit(text) == 20.0


def test_results_page_clicks_best_title_within_price_limit() -> None:
    decision = decide(RESULTS_PAGE, ["search[120 ml hair mask treatment]"])
    # B079HGJ5MH matches as well but costs more than 130 dollars.
    assert decision.action == "click[B09R4RJSFP]"


def test_results_page_without_products_tries_next_page_once() -> None:
    empty = (
        f"Instruction: [SEP] {INSTRUCTION} [SEP] Back to Search [SEP] Page 6 (Total results: 50) "
        "[SEP] < Prev [SEP] Next >"
    )
    assert decide(empty, ["search[x]"]).action == "click[Next >]"
    assert decide(empty, ["search[x]", "click[Next >]"]).action.startswith("search[")


def test_item_page_selects_matching_option_then_buys() -> None:
    actions = ["search[hair mask]", "click[B09R4RJSFP]"]
    assert decide(ITEM_PAGE, actions).action == "click[120ml]"
    assert decide(ITEM_PAGE, [*actions, "click[120ml]"]).action == "click[Buy Now]"


def test_item_page_picks_one_value_per_group_preferring_specific_match() -> None:
    item = parse_item(split_pieces(SHIRT_PAGE))
    assert item is not None
    assert [name for name, _ in item.options] == ["color", "size"]
    actions = ["search[shirt]", "click[B0AAAAAAAA]"]
    assert decide(SHIRT_PAGE, actions).action == "click[navy blue]"
    assert decide(SHIRT_PAGE, [*actions, "click[navy blue]"]).action == "click[x-large]"
    assert decide(SHIRT_PAGE, [*actions, "click[navy blue]", "click[x-large]"]).action == "click[Buy Now]"


def test_option_clicks_before_a_new_item_do_not_count() -> None:
    actions = ["search[x]", "click[B0BBBBBBBB]", "click[120ml]", "click[< Prev]", "click[B09R4RJSFP]"]
    assert decide(ITEM_PAGE, actions).action == "click[120ml]"


SYNTH = "Find me slim fit shirts with color: navy blue, and size: x-large, and price lower than 40.00 dollars"
SYNTH_RESULTS = (
    f"Instruction: [SEP] {SYNTH} [SEP] Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > "
    "[SEP] B0AAAAAAAA [SEP] Slim Fit Shirt [SEP] $19.99 [SEP] B0BBBBBBBB [SEP] Slim Fit Shirt Navy [SEP] $25.0"
)


def synth_item(colors: str, sizes: str = "large [SEP] x-large") -> str:
    return (
        f"Instruction: [SEP] {SYNTH} [SEP] Back to Search [SEP] < Prev [SEP] color [SEP] {colors} "
        f"[SEP] size [SEP] {sizes} [SEP] Slim Fit Shirt [SEP] Price: $19.99 "
        "[SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
    )


def test_item_lacking_requested_option_is_left_for_the_next_result() -> None:
    lacking = synth_item("red [SEP] white")
    actions = ["search[slim fit shirts]", "click[B0AAAAAAAA]"]
    assert decide(lacking, actions).action == "click[< Prev]"
    actions.append("click[< Prev]")
    assert decide(SYNTH_RESULTS, actions).action == "click[B0BBBBBBBB]"
    actions.append("click[B0BBBBBBBB]")
    assert decide(synth_item("navy blue [SEP] red"), actions).action == "click[navy blue]"


def test_without_budget_the_best_item_seen_is_bought() -> None:
    lacking = synth_item("red [SEP] white", sizes="large")
    partial = synth_item("navy blue [SEP] red", sizes="small [SEP] large")  # has the colour only
    actions = ["search[slim fit shirts]", "click[B0BBBBBBBB]", "click[< Prev]", "click[B0AAAAAAAA]"]
    pages = [SYNTH_RESULTS, partial, SYNTH_RESULTS, lacking]
    # 5 steps left: enough to go back to the better item and buy it, not to explore further.
    decision = decide(lacking, actions, pages_after=pages, max_steps=9)
    assert decision.action == "click[< Prev]"
    actions.append("click[< Prev]")
    pages.append(SYNTH_RESULTS)
    assert decide(SYNTH_RESULTS, actions, pages_after=pages, max_steps=9).action == "click[B0BBBBBBBB]"
    # On the last step anything left is bought at once.
    assert decide(lacking, actions[:4], max_steps=5).action == "click[Buy Now]"


def test_subpage_goes_back_and_unknown_text_is_safe() -> None:
    sub = f"Instruction: [SEP] {INSTRUCTION} [SEP] Back to Search [SEP] < Prev [SEP] Great mask."
    assert classify(split_pieces(sub)) is Page.SUBPAGE
    assert decide(sub, []).action == "click[< Prev]"
    assert decide("", []).action == "click[Buy Now]"


def test_observation_is_found_inside_a_longer_user_message() -> None:
    message = f"Step 3 of 15\nTask: shop\nObservation: {RESULTS_PAGE}\nValid actions: click[next >]"
    assert extract_observation(message) == RESULTS_PAGE
    assert extract_observation(f"Observation:\n{SEARCH_PAGE}") == SEARCH_PAGE


def test_conversation_reading_collects_previous_actions() -> None:
    messages = [
        {"role": "system", "content": "You shop. Reply with Action: search[...] or click[...]"},
        {"role": "user", "content": f"Observation: {SEARCH_PAGE}"},
        {"role": "assistant", "content": "Thought: search\nAction: search[hair mask]"},
        {"role": "user", "content": f"Observation: {RESULTS_PAGE}"},
        {"role": "assistant", "content": "Action: click[B09R4RJSFP]"},
        {"role": "user", "content": [{"type": "text", "text": f"Invalid action\nObservation: {ITEM_PAGE}"}]},
    ]
    conversation = read_conversation(messages)
    assert conversation.observation == ITEM_PAGE
    assert conversation.previous_actions == ["search[hair mask]", "click[B09R4RJSFP]"]
    assert conversation.pages_after == [RESULTS_PAGE, ITEM_PAGE]
    assert conversation.max_steps == 15


def test_clickable_line_tells_unknown_option_names_from_values() -> None:
    page = ITEM_PAGE.replace("[SEP] color [SEP]", "[SEP] capacity volume [SEP]")
    clickable = "back to search, < prev, description, features, reviews, buy now, 60ml, 120ml"
    messages = [{"role": "user", "content": f"Step 3 of 15.\nObservation: {page}\nClickable: {clickable}"}]
    conversation = read_conversation(messages)
    assert conversation.clickables is not None
    item = parse_item(split_pieces(page), conversation.clickables)
    assert item is not None and item.options == [("capacity volume", ["60ml", "120ml"])]


def test_conversation_reading_takes_step_cap_and_skips_feedback_only_turns() -> None:
    messages = [
        {"role": "system", "content": "system"},
        {"role": "user", "content": f"Step 1 of 20\nObservation: {SEARCH_PAGE}"},
        {"role": "assistant", "content": "Action: click[nothing]"},
        {"role": "user", "content": "Invalid action"},
    ]
    conversation = read_conversation(messages)
    assert conversation.observation == SEARCH_PAGE
    assert conversation.max_steps == 20
    assert conversation.pages_after == [""]
