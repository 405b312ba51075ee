"""``python -m bridge autoscale``: how many workers a reading asks for, and reading it from the bridges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from bridge.dispatch import metrics
from bridge.ops.autoscale import DESIRED, Policy, desired_slots
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


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


def test_workers_of_an_autoscaler_killed_with_sigkill_get_sigterm_not_orphaned(tmp_path: Path) -> None:
    """The autoscaler dies without its stop: each worker it started still gets SIGTERM (its warm shutdown)."""
    marker = tmp_path / "worker"
    worker = (
        "import os, signal, sys, time, pathlib; p = pathlib.Path(sys.argv[1]); "
        "signal.signal(signal.SIGTERM, lambda *_: (p.write_text('term'), sys.exit(0))); "
        "p.write_text(str(os.getpid())); time.sleep(120)"
    )
    argv = [sys.executable, "-m", "bridge", "autoscale", "--metrics-url", "http://127.0.0.1:9/metrics"]
    argv += ["--min-workers", "1", "--interval", "0.2", "--", sys.executable, "-c", worker, str(marker)]
    scaler = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: marker.exists() and marker.read_text().isdigit(), 30, "the autoscaler's worker")
        scaler.kill()
        scaler.wait(timeout=10)
        wait_for(lambda: marker.read_text() == "term", 10, "SIGTERM to the orphaned worker")
    finally:
        scaler.kill()
        scaler.wait()
