"""BM25 search (docs/webshop-env.md section 5)."""

from __future__ import annotations

import pytest

from webshop_env.catalog import default_catalog
from webshop_env.search import Analyzer, SearchEngine, page_slice


@pytest.fixture(scope="module")
def engine() -> SearchEngine:
    return SearchEngine(default_catalog())


def test_analyzer_lowercases_drops_stop_words_and_stems() -> None:
    assert Analyzer()("The Running Shoes for Men's x-large") == ["run", "shoe", "men", "x", "larg"]


@pytest.mark.parametrize(("query", "asin"), [("60x40x40cm", "B09NTCCVGX"), ("black1901", "B07S7HDC88")])
def test_option_words_find_their_product(engine: SearchEngine, query: str, asin: str) -> None:
    assert engine.search(query)[0] == asin


def test_hits_capped_at_fifty_and_paginated(engine: SearchEngine) -> None:
    hits = engine.search("hair")
    assert len(hits) == 50 and len(set(hits)) == 50
    assert list(page_slice(hits, 1)) == list(hits[:10])
    assert list(page_slice(hits, 5)) == list(hits[40:50])
    assert list(page_slice(hits, 6)) == []


def test_target_found_for_its_instruction(engine: SearchEngine) -> None:
    assert "B09R4RJSFP" in engine.search("i need a 120 ml hair mask treatment")[:10]


def test_no_hits_for_stop_words_only_and_cache_is_consistent(engine: SearchEngine) -> None:
    assert engine.search("the and of") == ()
    assert engine.search("Hair  Mask") == engine.search("hair  mask")


def test_ties_break_by_catalog_order(engine: SearchEngine) -> None:
    catalog = default_catalog()
    hits = engine.search("heather charcoal")
    scores = engine.bm25.get_batch_scores(engine.analyzer("heather charcoal"), [catalog.by_asin[a].index for a in hits])
    for (a, sa), (b, sb) in zip(zip(hits, scores, strict=True), zip(hits[1:], scores[1:], strict=True), strict=False):
        assert sa > sb or (sa == sb and catalog.by_asin[a].index < catalog.by_asin[b].index)


def test_precomputed_scores_equal_rank_bm25_exactly(engine: SearchEngine) -> None:
    """The fast scorer must reproduce rank_bm25 bit for bit, or hit order could change."""
    queries = [
        "i need a 120 ml hair mask treatment",
        "heather charcoal heather",  # a repeated term counts twice, as in rank_bm25
        "men's running shoes x-large black",
        "gluten free snack bar pack of 12 under 30 dollars",
        "60x40x40cm",
    ]
    for query in queries:
        terms = [t for t in engine.analyzer(query) if t in engine.postings]
        docs = sorted({int(d) for t in terms for d in engine.postings[t]})
        expected = engine.bm25.get_batch_scores(terms, docs)
        assert engine.scores(terms)[docs].tolist() == expected
        assert len(docs) >= len(engine.search(query))
