"""The tools' shared statistics and rollout wait: nearest-rank percentiles, and a bounded poll loop."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest

from bridge_lab import rollouts
from bridge_lab.stats import mean, percentile, rounded


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def test_percentile_is_the_nearest_rank_a_measured_value() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 7, 20, 99, 100, 101, 1000):
        values = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 95, 99, 100):
            assert percentile(values, q) == _nearest_rank(values, q), (n, q)
            assert percentile(values, q) in values


def test_missing_data_is_none_not_zero() -> None:
    assert percentile([], 50) is None and mean([]) is None and rounded(None) is None
    assert mean([1.0, 2.0, 6.0]) == 3.0 and rounded(1.23456, 3) == 1.235


def test_wait_returns_finished_rollouts_in_chunks_and_reports_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollouts, "CHUNK", 2)
    monkeypatch.setattr(rollouts.time, "sleep", lambda _s: None)
    ids = [f"ro-{i}" for i in range(5)]
    rounds: list[list[str]] = []
    seen: list[int] = []

    def poll(batch: list[str]) -> dict[str, str]:
        assert len(batch) <= 2
        rounds.append(batch)
        return {rid: "succeeded" for rid in batch if len(rounds) > 3}  # nothing finishes in the first round

    def progress(finished: Mapping[str, str]) -> None:
        seen.append(len(finished))

    finished = rollouts.wait_for_rollouts(poll, ids, timeout_s=60, on_progress=progress)
    assert finished == dict.fromkeys(ids, "succeeded")
    assert seen[0] == 0 and seen[-1] == 5


def test_wait_gives_up_at_its_deadline() -> None:
    finished = rollouts.wait_for_rollouts(lambda batch: {}, ["ro-1"], timeout_s=0.05, interval_s=0.01)
    assert finished == {}
