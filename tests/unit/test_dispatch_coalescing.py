"""The bridge's wait for freed slots to gather, and its back-off between empty polls: a small share of the
episode time, capped, never without data."""

from __future__ import annotations

import pytest

from bridge.core.coordination import coordination_redis
from bridge.core.infra import backoff_delay
from bridge.core.settings import load_settings
from bridge.dispatch.v03.coalesce import MIN_SAMPLES, SHARE, Coalescer
from bridge.dispatch.v03.dispatcher import V03Dispatcher


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


def test_empty_polls_may_wait_the_same_share_of_the_episode_measured_at_capacity() -> None:
    clock = Clock()
    coalescer = Coalescer(max_s=1.5, clock=clock)
    assert coalescer.idle_poll_s() == 0.0  # never at capacity: no estimate, the poll settings alone
    _steady(coalescer, clock, every_s=0.25)  # 4 rollouts/s finishing on 128 slots: 32 s episodes
    coalescer.wait_s(128)
    assert coalescer.idle_poll_s() == pytest.approx(SHARE * 32)
    clock.now += 120.0  # the last wave's tail: no dispatches, no wait at capacity; the estimate holds
    assert coalescer.idle_poll_s() == pytest.approx(SHARE * 32)
    _steady(coalescer, clock, every_s=0.01)  # the next batch has 1.28 s episodes
    coalescer.wait_s(128)
    assert coalescer.idle_poll_s() == pytest.approx(SHARE * 1.28)


def test_the_idle_poll_wait_is_capped_and_off_with_coalescing() -> None:
    clock = Clock()
    capped, off = Coalescer(max_s=0.5, clock=clock), Coalescer(max_s=0.0, clock=clock)
    for coalescer in (capped, off):
        _steady(coalescer, clock, every_s=0.5)  # 64 s episodes on 128 slots
        coalescer.wait_s(128)
    assert capped.idle_poll_s() == 0.5
    assert off.idle_poll_s() == 0.0


def _polls(dispatcher: V03Dispatcher, count: int) -> list[float]:
    return [dispatcher.next_poll(found_work=False) for _ in range(count)]


@pytest.mark.parametrize("every_s, longest", [(0.25, SHARE * 32), (0.01, 0.2)])
def test_the_bridge_backs_off_empty_polls_to_the_longer_of_poll_max_and_the_episode_share(
    every_s: float, longest: float
) -> None:
    settings = load_settings(store_url="http://127.0.0.1:1", broker_url="redis://127.0.0.1:1/0")
    dispatcher = V03Dispatcher(settings, None, coordination_redis(settings), None)  # type: ignore[arg-type]
    assert max(_polls(dispatcher, 20)) <= settings.poll_max_s  # no estimate yet
    clock = Clock()
    coalescer = Coalescer(settings.coalesce_max_s, clock=clock)
    dispatcher = V03Dispatcher(settings, None, coordination_redis(settings), None, coalescer=coalescer)  # type: ignore[arg-type]
    _steady(coalescer, clock, every_s=every_s)
    coalescer.wait_s(128)
    assert dispatcher.next_poll(found_work=True) <= settings.poll_min_s  # a dequeue found work
    waits = _polls(dispatcher, 20)
    assert waits[0] <= 2 * settings.poll_min_s  # the back-off still starts short after work was found
    assert max(waits) <= longest
    assert min(waits[-10:]) >= longest / 2  # jittered between half the ceiling and the ceiling


def test_an_idle_bridge_polls_within_its_bounds_however_long_it_stays_idle() -> None:
    """Days of empty polls (a bridge between training steps) never overflow the back-off: 2**n of an unbounded count
    passed a float's range after about 1,000 empty polls."""
    settings = load_settings(store_url="http://127.0.0.1:1", broker_url="redis://127.0.0.1:1/0")
    dispatcher = V03Dispatcher(settings, None, coordination_redis(settings), None)  # type: ignore[arg-type]
    waits = _polls(dispatcher, 20_000)
    assert settings.poll_min_s <= min(waits) and max(waits) <= settings.poll_max_s
    assert backoff_delay(10**6, base_s=0.5, cap_s=10.0) <= 10.0  # the one retry schedule: any count is safe
