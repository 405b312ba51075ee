"""The 1.0 side-by-side benchmark's arithmetic (``bridge_lab.bench.agl_v1.figures``) on the trainer client's rows."""

from __future__ import annotations

from typing import Any

from bridge_lab.bench.agl_v1 import figures


def row(
    state: str, enqueued: float, finished: float, reward: float | None = None, error: str | None = None
) -> dict[str, Any]:
    return {"state": state, "enqueued_at": enqueued, "finished_at": finished, "reward": reward, "error": error}


def test_time_runs_from_the_first_enqueue_to_the_last_finish_and_failures_group_by_their_first_line() -> None:
    done = [
        row("succeeded", 100.0, 104.0, reward=1.0),
        row("succeeded", 100.5, 110.0, reward=0.5),
        row("failed", 101.0, 106.0, error="local controller shutdown"),
        row("failed", 101.0, 107.0, error="the agent exited with code 1:\nTraceback ..."),
        row("failed", 101.0, 108.0, error="local controller shutdown"),
    ]
    got = figures("local", "local", True, done, peak_mb=512.34, cpu_s=None)
    assert (got["seconds"], got["throughput_per_s"]) == (10.0, 0.5)
    assert (got["rollouts"], got["succeeded"], got["failed"]) == (5, 2, 3)
    assert got["mean_reward"] == 0.75  # of the succeeded rollouts only
    assert got["failures"] == "2 x local controller shutdown; 1 x the agent exited with code 1:"
    assert got["peak_rss_mb"] == 512.3 and got["cpu_ms_per_rollout"] is None


def test_cpu_is_per_rollout_and_a_run_without_finish_times_has_no_rate() -> None:
    got = figures("celery", "celery", False, [{"state": "succeeded", "reward": 0.0, "error": None}] * 4, 100.0, 2.0)
    assert got["cpu_ms_per_rollout"] == 500.0 and got["failures"] == "-"
    assert got["seconds"] is None and got["throughput_per_s"] is None
