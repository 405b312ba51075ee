"""The one retry schedule (``bridge.core.infra.backoff``): jittered exponential waits, a count limit, a deadline,
and a server's hint used as given."""

from __future__ import annotations

import random
import time

import pytest

from bridge.core.infra import Retries, backoff_delay, retry_until


def test_waits_grow_with_full_jitter_up_to_the_cap() -> None:
    rng = random.Random(1)
    for attempt, ceiling in ((0, 0.5), (1, 1.0), (2, 2.0), (6, 10.0)):
        delays = [backoff_delay(attempt, base_s=0.5, cap_s=10.0, rng=rng) for _ in range(200)]
        assert min(delays) >= ceiling / 2 and max(delays) <= ceiling


def test_the_count_limit_and_the_hint() -> None:
    schedule = Retries(limit=2, base_s=0.1, cap_s=0.2)
    first = schedule.next_delay()
    assert first is not None and 0.05 <= first <= 0.1
    assert schedule.next_delay(hint_s=7.0) == 7.0  # the server's Retry-After, as the caller bounded it
    assert schedule.next_delay() is None and schedule.done == 2


def test_no_retry_starts_past_the_deadline() -> None:
    schedule = Retries(limit=None, base_s=1.0, cap_s=1.0, deadline=time.time() + 0.2)
    assert schedule.next_delay() is None and schedule.done == 0
    assert Retries(limit=None, base_s=0.01, cap_s=0.01, deadline=time.time() + 5).next_delay() is not None


def test_retry_until_retries_only_the_named_errors_and_raises_the_last_at_the_deadline() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "done"

    seen: list[int] = []
    assert (
        retry_until(
            flaky, ConnectionError, time.time() + 5, base_s=0.01, cap_s=0.02, on_retry=lambda n, _: seen.append(n)
        )
        == "done"
    )
    assert seen == [0, 1]
    with pytest.raises(ValueError):
        retry_until(lambda: int("x"), ConnectionError, time.time() + 5)
    with pytest.raises(ConnectionError):
        retry_until(
            lambda: (_ for _ in ()).throw(ConnectionError("down")), ConnectionError, time.time() + 0.3, base_s=0.1
        )
