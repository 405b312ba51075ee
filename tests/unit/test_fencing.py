"""Fencing: a worker acts only for the rollout's latest live attempt, and knows when the Store's watchdog
may have ended it behind its back."""

from __future__ import annotations

from bridge.core.store import AttemptedRollout, RolloutConfig
from workers.protocol.fencing import fence
from workers.protocol.heartbeat import watchdog_may_act


def _attempted(status: str = "running", attempt_status: str = "running", aid: str = "at-1") -> AttemptedRollout:
    return AttemptedRollout.model_validate(
        {
            "rollout_id": "ro-1",
            "status": status,
            "attempt": {"rollout_id": "ro-1", "attempt_id": aid, "status": attempt_status},
        }
    )


def test_fence_admits_only_the_latest_live_attempt() -> None:
    assert fence(_attempted(), "at-1") is None
    assert fence(_attempted(status="preparing", attempt_status="preparing"), "at-1") is None
    assert "superseded" in (fence(_attempted(aid="at-2"), "at-1") or "")
    assert "cancelled" in (fence(_attempted(status="cancelled"), "at-1") or "")
    assert "unresponsive" in (fence(_attempted(attempt_status="unresponsive"), "at-1") or "")
    assert "succeeded" in (fence(_attempted(status="succeeded", attempt_status="succeeded"), "at-1") or "")


def test_watchdog_may_act_only_near_the_rollouts_own_limits() -> None:
    t0 = 1_000_000.0
    assert not watchdog_may_act(RolloutConfig(), t0, t0, t0 + 86_400)  # no limits: the watchdog never acts
    timeout = RolloutConfig(timeout_seconds=60)
    assert not watchdog_may_act(timeout, t0, t0, t0 + 40)
    assert watchdog_may_act(timeout, t0, t0, t0 + 50)  # within the margin (20%, at least 2 s) of 60 s
    unresponsive = RolloutConfig(unresponsive_seconds=30)
    assert watchdog_may_act(unresponsive, t0, t0, t0 + 29)
    assert not watchdog_may_act(unresponsive, t0, t0 + 20, t0 + 29)  # a recent heartbeat keeps it quiet
    assert watchdog_may_act(RolloutConfig(unresponsive_seconds=3), t0, t0, t0 + 1.5)  # 2 s margin at least
