"""``python -m bridge autoscale``: how many workers a reading asks for, and reading it from the bridges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from bridge.dispatch import metrics
from bridge.ops.autoscale import DESIRED, Policy, desired_slots


def policy(**overrides: float) -> Policy:
    values = {"slots_per_worker": 8, "min_workers": 0, "max_workers": 4, "scale_down_after_s": 60.0, **overrides}
    return Policy(
        int(values["slots_per_worker"]),
        int(values["min_workers"]),
        int(values["max_workers"]),
        values["scale_down_after_s"],
    )


def test_up_at_once_to_ceil_desired_over_slots_within_the_bounds() -> None:
    p = policy()
    assert p.target(0, 0, now=0) == 0
    assert p.target(1, 0, now=0) == 1
    assert p.target(17, 1, now=1) == 3  # ceil(17 / 8)
    assert p.target(200, 3, now=2) == 4  # max_workers
    assert policy(min_workers=1).target(0, 0, now=0) == 1


def test_down_one_worker_per_window_once_the_lower_target_held() -> None:
    p = policy(scale_down_after_s=60)
    assert p.target(0, 4, now=0) == 4  # the window starts
    assert p.target(0, 4, now=59) == 4
    assert p.target(0, 4, now=60) == 3  # one step down
    assert p.target(0, 3, now=61) == 3  # the next step waits a whole window again
    assert p.target(0, 3, now=120) == 2


def test_a_burst_within_the_window_resets_it() -> None:
    p = policy(scale_down_after_s=60)
    assert p.target(0, 4, now=0) == 4
    assert p.target(32, 4, now=30) == 4  # back up: the window is forgotten
    assert p.target(0, 4, now=70) == 4  # a new window from 70
    assert p.target(0, 4, now=130) == 3


def test_without_a_reading_it_keeps_what_runs() -> None:
    p = policy(min_workers=1, max_workers=4)
    assert p.target(None, 3, now=0) == 3
    assert p.target(None, 0, now=0) == 1  # still within the bounds
    assert p.target(None, 9, now=0) == 4


def test_it_reads_the_bridges_series_for_its_queue_and_nothing_else() -> None:
    assert [m.name for m in metrics.DESIRED_SLOTS.describe()] == [DESIRED]  # the name the bridge exports
    registry = CollectorRegistry()
    gauge = Gauge(DESIRED, "desired", ["queue"], registry=registry)
    gauge.labels(queue="rollouts").set(12)
    gauge.labels(queue="rollouts-val").set(40)
    text = generate_latest(registry).decode()
    assert desired_slots(text, "rollouts") == 12
    assert desired_slots(text, "rollouts-val") == 40
    assert desired_slots(text, "other") is None
    assert desired_slots("# a standby exports no per-queue series\n", "rollouts") is None
