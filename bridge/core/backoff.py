"""Exponential backoff with full jitter, the one retry schedule used everywhere."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_delay(attempt: int, base_s: float = 0.5, cap_s: float = 30.0, rng: random.Random | None = None) -> float:
    """Delay before retry number ``attempt`` (0-based): full jitter keeps many clients from retrying in step."""
    ceiling = min(cap_s, base_s * (2**attempt))
    return (rng or random).uniform(ceiling / 2, ceiling)


def retry_until(
    action: Callable[[], T],
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    until: float,
    *,
    base_s: float = 0.5,
    cap_s: float = 5.0,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """``action()`` again after each ``retry_on`` error, with backoff, while the next try starts before ``until``.

    ``until`` is epoch seconds; the last error is raised when no further try fits. At least one try is made.
    ``on_retry(tries_so_far, error)`` runs before each wait.
    """
    tries = 0
    while True:
        try:
            return action()
        except retry_on as exc:
            delay = backoff_delay(tries, base_s=base_s, cap_s=cap_s)
            if time.time() + delay > until:
                raise
            if on_retry is not None:
                on_retry(tries, exc)
            time.sleep(delay)
            tries += 1
