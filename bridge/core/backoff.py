"""Exponential backoff with full jitter, the one retry schedule used everywhere."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base_s: float = 0.5, cap_s: float = 30.0, rng: random.Random | None = None) -> float:
    """Delay before retry number ``attempt`` (0-based): full jitter keeps many clients from retrying in step."""
    ceiling = min(cap_s, base_s * (2**attempt))
    return (rng or random).uniform(ceiling / 2, ceiling)
