"""BM25 product search approximating WebShop's Lucene/Pyserini engine (docs/webshop-env.md section 5).

One text field per product (the catalog's ``contents``), Lucene's English analysis and BM25(k1=0.9, b=0.4)
with Lucene's always-positive idf, so every document sharing a query term is a hit; the 50 best in score
order, ties by catalog order. ``rank_bm25`` defines the score, but each (term, document) weight is computed
once at start-up with its very formula and kept as postings, summed in the same order as its
``get_batch_scores``, so the scores are bit-for-bit identical (tests check this).
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
        self._weights = self._term_weights(self._bm25, self._postings)
        self._asins = [p.asin for p in catalog.products]
        self._cache: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = Lock()

    @property
    def analyzer(self) -> Analyzer:
        """How a text becomes terms: the products' search text and the queries alike."""
        return self._analyzer

    @property
    def bm25(self) -> LuceneBM25:
        """The reference scorer (``rank_bm25``'s, with Lucene's idf) the precomputed weights reproduce bit for bit."""
        return self._bm25

    @property
    def postings(self) -> dict[str, np.ndarray]:
        """Each term's products, by catalog index."""
        return self._postings

    @staticmethod
    def _build_postings(corpus: Sequence[list[str]]) -> dict[str, np.ndarray]:
        """Term -> ids of the documents containing it, to find the candidate hits fast."""
        postings: dict[str, list[int]] = {}
        for doc_id, terms in enumerate(corpus):
            for term in set(terms):
                postings.setdefault(term, []).append(doc_id)
        return {term: np.asarray(ids, dtype=np.int32) for term, ids in postings.items()}

    @staticmethod
    def _term_weights(bm25: LuceneBM25, postings: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Term -> its BM25 weight in each document of its postings, by rank_bm25's own formula.

        The expression mirrors ``BM25Okapi.get_batch_scores`` (float64 throughout,
        element-wise, so evaluating all (term, document) pairs in one go gives each
        pair the same value), which is what keeps the scores identical to it.
        """
        terms = list(postings)
        ids = np.concatenate([postings[t] for t in terms])
        q_freq = np.array([bm25.doc_freqs[int(i)][t] for t in terms for i in postings[t]])
        doc_len = np.array(bm25.doc_len)[ids]
        idf = np.repeat([bm25.idf.get(t) or 0 for t in terms], [len(postings[t]) for t in terms])
        k1, b, avgdl = bm25.k1, bm25.b, bm25.avgdl
        weights = idf * (q_freq * (k1 + 1) / (q_freq + k1 * (1 - b + b * doc_len / avgdl)))
        ends = np.cumsum([len(postings[t]) for t in terms])
        return dict(zip(terms, np.split(weights, ends[:-1]), strict=True))

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
        scores = self.scores(terms)[candidates]
        # Stable sort on -score keeps catalog order (candidates are ascending) for ties.
        order = np.argsort(-scores, kind="stable")[:MAX_HITS]
        return tuple(self._asins[int(candidates[i])] for i in order)

    def scores(self, terms: Sequence[str]) -> np.ndarray:
        """BM25 score of every catalog document for analyzed ``terms`` (repeats count again).

        Terms are added in query order, as ``get_batch_scores`` does; a document
        without a term gets nothing added, where rank_bm25 adds an exact 0.0.
        """
        total = np.zeros(len(self._asins))
        for term in terms:
            ids = self._postings.get(term)
            if ids is not None:
                total[ids] += self._weights[term]
        return total


def page_slice(hits: Sequence[str], page: int) -> Sequence[str]:
    """Hits shown on 1-based results page ``page``: 10(p-1)+1 .. 10p; empty past the end."""
    start = (page - 1) * PAGE_SIZE
    if start < 0:
        return ()
    return hits[start : start + PAGE_SIZE]
