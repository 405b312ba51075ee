"""A task of a line the worker is not configured for goes back to the broker (``workers.protocol.unserved``): the
first at once, a streak of them ever later up to a bound, so a misconfigured node never spins on the broker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers.protocol import unserved
from workers.protocol.unserved import CAP_S, RESET_S, Refusals


def test_a_streak_of_hand_backs_waits_longer_each_time_up_to_the_cap_and_a_quiet_spell_ends_it() -> None:
    refusals = Refusals()
    waits = [refusals.wait_before(float(t)) for t in range(40)]
    assert waits[0] == 0.0  # the first goes back at once
    assert waits[1:4] == [0.1, 0.2, 0.4]
    assert max(waits) == CAP_S and waits[-1] == CAP_S  # bounded however long the streak
    assert refusals.streak <= unserved.MAX_STREAK
    assert refusals.wait_before(40.0 + RESET_S + 1) == 0.0  # quiet long enough: a new streak


def test_a_1_0_task_on_a_worker_without_a_gateway_is_rejected_for_requeue_before_anything_is_touched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from workers.v1 import task

    settings = SimpleNamespace(agl_v1_url="")

    def no_redis() -> None:
        raise AssertionError("a task it cannot serve touches nothing")

    monkeypatch.setattr(task, "get_coordination", lambda: (settings, SimpleNamespace(__getattr__=no_redis)))
    monkeypatch.setattr(unserved.time, "sleep", lambda _s: None)
    for _ in range(3):
        result = task.run_v1_rollout.apply(kwargs={"rollout": {}, "attempt_id": "0", "queue": "rollouts"})
        assert result.state == "REJECTED"
        assert "AGL_V1_SERVER_URL is not set" in str(result.result)
    assert sum("hands each such task back" in r.getMessage() for r in caplog.records) == 1
