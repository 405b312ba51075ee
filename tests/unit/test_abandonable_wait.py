"""Under ``-P threads`` the task thread waits for its agent thread without polling, and still gives up on time.

``stuck.run_abandonable`` used to wake every 0.1 s for the whole episode to look at the watch: about 140
wakes per 14 s rollout on every slot, CPU spent for nothing while the agent waited on its LLM. It now
sleeps until the agent returns, the watch is stopped, or a deadline (plus the grace) comes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bridge.core.infra import Superseded
from workers.lifecycle import state, stuck
from workers.protocol.heartbeat import AttemptWatch
from workers.protocol.lease import Lease


class _CountingWatch(AttemptWatch):
    """An AttemptWatch that counts how often anything looks at its stop verdict."""

    looks = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "stop_reason":
            object.__setattr__(self, "looks", object.__getattribute__(self, "looks") + 1)
        return object.__getattribute__(self, name)


def _watch(deadline_in_s: float) -> _CountingWatch:
    lease = Lease(redis.Redis(host="127.0.0.1", port=9), "at-wait", 5)  # never used: no Redis is needed
    return _CountingWatch("ro-wait", "at-wait", lease, None, 1.0, 60.0, deadline=time.time() + deadline_in_s)


@pytest.fixture
def no_restart(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    restarts: list[str] = []
    monkeypatch.setattr(stuck, "restart_worker", restarts.append)
    monkeypatch.setattr(state.node.pool, "max_stuck", 1000)
    monkeypatch.setattr(stuck, "ABANDON_GRACE_S", 0.2)
    yield restarts
    assert restarts == []


def test_the_task_thread_sleeps_while_its_agent_runs() -> None:
    watch = _watch(deadline_in_s=60)
    watch.looks = 0

    def agent() -> str:
        time.sleep(1.5)
        return "episode done"

    assert stuck.run_abandonable(agent, watch) == "episode done"
    # Looked once before sleeping; the return woke it. Polling every 0.1 s looked about 15 times.
    assert watch.looks <= 2, watch.looks
    assert watch.on_stop == []  # its wake-up is not left on the watch


def test_a_stop_verdict_wakes_the_waiting_thread(no_restart: list[str]) -> None:
    watch = _watch(deadline_in_s=60)
    release = threading.Event()
    threading.Timer(0.3, watch.stop, ("the rollout was cancelled",)).start()
    started = time.monotonic()
    try:
        with pytest.raises(Superseded, match="cancelled"):
            stuck.run_abandonable(release.wait, watch)
    finally:
        release.set()
    # Given up the grace after the stop, not at the next backstop wake (WAKE_MAX_S, 5 s).
    assert time.monotonic() - started < stuck.WAKE_MAX_S - 1, time.monotonic() - started
    assert watch.on_stop == []


def test_a_passed_deadline_abandons_the_agent(no_restart: list[str]) -> None:
    watch = _watch(deadline_in_s=0.3)
    release = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(stuck.AgentAbandoned):
            stuck.run_abandonable(release.wait, watch)
    finally:
        release.set()
    assert 0.3 + 0.2 <= time.monotonic() - started < stuck.WAKE_MAX_S - 1
    assert watch.stop_reason is not None  # stopped, so a late LLM call of the abandoned agent stops at once
