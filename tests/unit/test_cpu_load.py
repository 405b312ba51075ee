"""``--cpu-load N`` (tests/cpu_load.py): the busy loops the suite is run beside to check it on a busy machine."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil
import pytest

from tests import cpu_load


def test_cpu_load_starts_that_many_busy_loops_that_burn_cpu_and_stops_them() -> None:
    config = SimpleNamespace(getoption=lambda name: 2)
    cpu_load.start(config)  # type: ignore[arg-type]
    try:
        loops = [psutil.Process(loop.proc.pid) for loop in cpu_load._loops if loop.proc is not None]
        assert cpu_load.running() == 2 and len(loops) == 2
        before = [sum(p.cpu_times()[:2]) for p in loops]
        time.sleep(1.0)
        burnt = [sum(p.cpu_times()[:2]) - b for p, b in zip(loops, before, strict=True)]
        assert all(seconds > 0.02 for seconds in burnt), burnt  # a share of a core (small when busy), no sleep
    finally:
        cpu_load.stop()
    assert cpu_load.running() == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in loops)


def test_an_xdist_worker_starts_no_loops_of_its_own() -> None:
    config = SimpleNamespace(getoption=lambda name: 3, workerinput={})
    cpu_load.start(config)  # type: ignore[arg-type]
    assert cpu_load.running() == 0


def test_a_negative_count_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError):
        cpu_load.start(SimpleNamespace(getoption=lambda name: -1))  # type: ignore[arg-type]
