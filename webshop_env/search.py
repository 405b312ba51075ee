"""BM25 product search approximating WebShop's Lucene/Pyserini engine (spec section 5).

Upstream indexes one text field per product (title, description, first bullet,
options sentence; the catalog's ``contents`` field is exactly that text) with
Lucene's English analyzer and BM25(k1=0.9, b=0.4).  We reuse ``rank_bm25`` with
Lucene's always-positive idf so that every document sharing a query term is a
hit, as it is in Lucene, and keep the 50 best in score order, ties by catalog
order.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from threading import Lock

import numpy as np
import snowballstemmer
from rank_bm25 import BM25Okapi

from webshop_env.catalog import Catalog

logger = logging.getLogger("webshop_env.search")

MAX_HITS = 50
PAGE_SIZE = 10
BM25_K1 = 0.9
BM25_B = 0.4

# Lucene's EnglishAnalyzer stop set.
STOP_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
    ]
)
_POSSESSIVE = re.compile(r"'s\b")
_NON_ALNUM = re.compile(r"[^0-9a-z]+")


class Analyzer:
    """Lower-case, drop possessive 's, split on non-alphanumerics, drop stop words, Porter-stem."""

    def __init__(self) -> None:
        self._stemmer = snowballstemmer.stemmer("porter")
        self._stems: dict[str, str] = {}

    def __call__(self, text: str) -> list[str]:
        words = _NON_ALNUM.split(_POSSESSIVE.sub("", text.lower()))
        return [self._stem(w) for w in words if w and w not in STOP_WORDS]

    def _stem(self, word: str) -> str:
        stem = self._stems.get(word)
        if stem is None:
            stem = self._stemmer.stemWord(word)
            self._stems[word] = stem
        return stem


class LuceneBM25(BM25Okapi):
    """rank_bm25's Okapi scorer with Lucene's idf, ln(1 + (N - df + 0.5) / (df + 0.5)).

    rank_bm25's own idf goes negative for common terms (floored by epsilon);
    Lucene's never does, which matters for which documents count as hits.
    """

    def _calc_idf(self, nd: dict[str, int]) -> None:
        for word, freq in nd.items():
            self.idf[word] = math.log(1.0 + (self.corpus_size - freq + 0.5) / (freq + 0.5))
        self.average_idf = sum(self.idf.values()) / max(len(self.idf), 1)


class SearchEngine:
    """Top-50 BM25 search over the catalog with an LRU cache of recent queries."""

    def __init__(self, catalog: Catalog, cache_size: int = 4096) -> None:
        self._catalog = catalog
        self._analyzer = Analyzer()
        corpus = [self._analyzer(p.search_text) for p in catalog.products]
        self._bm25 = LuceneBM25(corpus, k1=BM25_K1, b=BM25_B)
        self._postings = self._build_postings(corpus)
        self._asins = [p.asin for p in catalog.products]
        self._cache: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = Lock()

    @staticmethod
    def _build_postings(corpus: Sequence[list[str]]) -> dict[str, np.ndarray]:
        """Term -> ids of the documents containing it, to find the candidate hits fast."""
        postings: dict[str, list[int]] = {}
        for doc_id, terms in enumerate(corpus):
            for term in set(terms):
                postings.setdefault(term, []).append(doc_id)
        return {term: np.asarray(ids, dtype=np.int32) for term, ids in postings.items()}

    def search(self, query: str) -> tuple[str, ...]:
        """Asins of the (at most 50) best hits for ``query``, best first."""
        key = " ".join(query.lower().split(" "))
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        hits = self._rank(key)
        with self._lock:
            self._cache[key] = hits
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return hits

    def _rank(self, query: str) -> tuple[str, ...]:
        terms = [t for t in self._analyzer(query) if t in self._postings]
        if not terms:
            return ()
        candidates = np.unique(np.concatenate([self._postings[t] for t in terms]))
        scores = np.asarray(self._bm25.get_batch_scores(terms, candidates.tolist()))
        # Stable sort on -score keeps catalog order (candidates are ascending) for ties.
        order = np.argsort(-scores, kind="stable")[:MAX_HITS]
        return tuple(self._asins[int(candidates[i])] for i in order)


def page_slice(hits: Sequence[str], page: int) -> Sequence[str]:
    """Hits shown on 1-based results page ``page``: 10(p-1)+1 .. 10p; empty past the end."""
    start = (page - 1) * PAGE_SIZE
    if start < 0:
        return ()
    return hits[start : start + PAGE_SIZE]
