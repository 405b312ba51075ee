"""Exponential backoff with full jitter, the one retry schedule used everywhere."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_DOUBLINGS = 60  # 2**60 times any sane base is past any cap, and far from a float's range


def backoff_delay(attempt: int, base_s: float = 0.5, cap_s: float = 30.0, rng: random.Random | None = None) -> float:
    """Delay before retry number ``attempt`` (0-based): full jitter keeps many clients from retrying in step. Any
    ``attempt`` is safe: past ``MAX_DOUBLINGS`` the ceiling is the cap (an unbounded 2**n overflows a float)."""
    ceiling = min(cap_s, base_s * (2 ** min(max(attempt, 0), MAX_DOUBLINGS)))
    return (rng or random).uniform(ceiling / 2, ceiling)


class Retries:
    """The retry schedule of one operation: how many tries were made, and the wait before the next one.

    ``limit`` retries at most (None: no count limit), none that would start after ``deadline`` (epoch s);
    each wait is the server's hint when it gave one (the caller bounds it), else ``backoff_delay`` up to
    ``cap_s``. Each call site keeps its own judgement of which errors are worth a retry.
    """

    def __init__(self, *, limit: int | None, base_s: float, cap_s: float, deadline: float | None = None) -> None:
        self.limit, self.base_s, self.cap_s, self.deadline = limit, base_s, cap_s, deadline
        self.done = 0  # retries scheduled so far

    def next_delay(self, hint_s: float | None = None) -> float | None:
        """The wait before the next try, counted as scheduled; None when no further try is allowed."""
        if self.limit is not None and self.done >= self.limit:
            return None
        delay = hint_s if hint_s is not None else backoff_delay(self.done, self.base_s, self.cap_s)
        if self.deadline is not None and time.time() + delay > self.deadline:
            return None
        self.done += 1
        return delay


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
    retries = Retries(limit=None, base_s=base_s, cap_s=cap_s, deadline=until)
    while True:
        try:
            return action()
        except retry_on as exc:
            tries = retries.done
            delay = retries.next_delay()
            if delay is None:
                raise
            if on_retry is not None:
                on_retry(tries, exc)
            time.sleep(delay)
