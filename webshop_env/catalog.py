"""Product catalog: loading the shipped WebShop data and pricing products.

The catalog is the 1,000 real WebShop products (docs/webshop-env.md section 8) exactly as
WebShop's own loader prepared them.  Prices of products sold at a range are
drawn once per product from a generator seeded by the asin, so every server
start (and every ``tasks`` listing) sees the same prices.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger("webshop_env.catalog")

DATA_DIR = Path(__file__).resolve().parent / "data"
DOCUMENTS_FILE = "items_1000_documents.jsonl.gz"
ATTRIBUTES_FILE = "items_ins_v2_1000.json.gz"

# Shown (and used for the price check) when the scrape had no price (spec 3.6).
DEFAULT_PRICE = 100.0
# Seed for everything random about the data (range prices, price_upper).  Fixed so
# that instruction texts listed by ``python -m webshop_env tasks`` match the server.
DATA_SEED = 233


@dataclass(frozen=True, slots=True)
class Product:
    """One catalog product with the fields the pages, search and reward read."""

    asin: str
    index: int  # position in the catalog file; search breaks ties by it
    title: str
    description: str
    bullets: tuple[str, ...]
    pricing: tuple[float, ...]
    options: Mapping[str, tuple[str, ...]]
    attributes: tuple[str, ...]
    category: str
    query: str
    product_category: str
    search_text: str  # the lower-cased indexed field (title, description, bullet 1, options)
    price: float  # the price used by the reward: single price, or a seeded draw in the range
    instruction: str | None = None  # synthetic instruction (items_ins_v2), if any
    instruction_attributes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def display_price(self) -> str:
        """Price text as WebShop shows it (spec 3.6)."""
        return format_price(self.pricing)


def format_float(value: float) -> str:
    """``$`` + the float as Python prints it: ``$35.0``, ``$10.3``, never ``$35.00``."""
    return f"${float(value)!r}"


def format_price(pricing: tuple[float, ...] | list[float]) -> str:
    """Display price: one price, ``$low to $high`` for a range, ``$100.0`` when unknown."""
    if not pricing:
        return format_float(DEFAULT_PRICE)
    if len(pricing) == 1:
        return format_float(pricing[0])
    return f"{format_float(pricing[0])} to {format_float(pricing[1])}"


def sample_price(asin: str, pricing: tuple[float, ...], seed: int = DATA_SEED) -> float:
    """The product's price for the reward: a range gives one seeded uniform draw per asin."""
    if not pricing:
        return DEFAULT_PRICE
    if len(pricing) == 1:
        return float(pricing[0])
    low, high = float(pricing[0]), float(pricing[1])
    return random.Random(f"price:{seed}:{asin}").uniform(low, high)


def _read_documents(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _read_attribute_file(path: Path) -> dict[str, dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        data: dict[str, dict[str, Any]] = json.load(handle)
    return data


def _product_from_document(index: int, doc: dict[str, Any], extra: dict[str, Any], seed: int) -> Product:
    raw = doc["product"]
    pricing = tuple(float(p) for p in raw.get("pricing") or [DEFAULT_PRICE])
    options = {str(name): tuple(str(v) for v in values) for name, values in (raw.get("options") or {}).items()}
    return Product(
        asin=str(raw["asin"]),
        index=index,
        title=str(raw.get("Title") or raw.get("name") or ""),
        description=str(raw.get("Description") or ""),
        bullets=tuple(str(b) for b in raw.get("BulletPoints") or []),
        pricing=pricing,
        options=options,
        attributes=tuple(raw.get("Attributes") or []),
        category=str(raw.get("category") or ""),
        query=str(raw.get("query") or ""),
        product_category=str(raw.get("product_category") or ""),
        search_text=str(doc.get("contents") or ""),
        price=sample_price(str(raw["asin"]), pricing, seed),
        instruction=extra.get("instruction"),
        instruction_attributes=tuple(extra.get("instruction_attributes") or []),
    )


class Catalog:
    """The products in file order plus an asin lookup."""

    def __init__(self, products: list[Product]) -> None:
        self.products = products
        self.by_asin = {p.asin: p for p in products}

    def __len__(self) -> int:
        return len(self.products)

    def get(self, asin: str) -> Product | None:
        """Product by asin (case-insensitive, as clicks are lower-cased)."""
        return self.by_asin.get(asin.upper())


def load_catalog(data_dir: Path = DATA_DIR, seed: int = DATA_SEED) -> Catalog:
    """Read the shipped catalog; ``seed`` only changes the draws of range prices."""
    extras = _read_attribute_file(data_dir / ATTRIBUTES_FILE)
    products = [
        _product_from_document(i, doc, extras.get(doc["id"], {}), seed)
        for i, doc in enumerate(_read_documents(data_dir / DOCUMENTS_FILE))
    ]
    logger.info("loaded %d products from %s", len(products), data_dir)
    return Catalog(products)


@lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The shipped catalog, loaded once per process."""
    return load_catalog()
