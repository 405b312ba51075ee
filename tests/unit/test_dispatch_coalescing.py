"""The bridge's wait for freed slots to gather: a small share of the episode time, capped, never without data."""

from __future__ import annotations

import pytest

from bridge.dispatch.coalesce import MIN_SAMPLES, SHARE, Coalescer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _steady(coalescer: Coalescer, clock: Clock, every_s: float, count: int = 64) -> None:
    for _ in range(count):
        clock.now += every_s
        coalescer.dispatched()


def test_the_wait_is_a_share_of_the_episode_time_littles_law() -> None:
    clock = Clock()
    coalescer = Coalescer(max_s=5.0, clock=clock)
    _steady(coalescer, clock, every_s=0.05)  # 20 rollouts/s finishing on 8 slots: 0.4 s episodes
    assert coalescer.wait_s(8) == pytest.approx(SHARE * 0.4)


def test_long_episodes_wait_the_cap() -> None:
    clock = Clock()
    coalescer = Coalescer(max_s=0.25, clock=clock)
    _steady(coalescer, clock, every_s=0.1)  # 10 rollouts/s on 128 slots: 12.8 s episodes, 2% = 0.256 s
    assert coalescer.wait_s(128) == 0.25


def test_no_wait_without_enough_dispatches_or_when_off() -> None:
    clock = Clock()
    coalescer = Coalescer(max_s=0.25, clock=clock)
    _steady(coalescer, clock, every_s=0.1, count=MIN_SAMPLES - 1)
    assert coalescer.wait_s(128) == 0.0
    off = Coalescer(max_s=0.0, clock=clock)
    _steady(off, clock, every_s=0.1)
    assert off.wait_s(128) == 0.0


def test_a_stale_rate_reads_as_slow_not_fast() -> None:
    clock = Clock()
    coalescer = Coalescer(max_s=0.25, clock=clock)
    _steady(coalescer, clock, every_s=0.001)  # a burst at start-up (filling free slots)
    assert coalescer.wait_s(8) < 0.001
    clock.now += 60.0  # then nothing for a minute
    assert coalescer.wait_s(8) == pytest.approx(SHARE * 8 / (63 / (60.064 - 1.0 - 0.001)))  # the last second is grace
