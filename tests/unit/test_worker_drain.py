"""The bounded drain (``workers.lifecycle.drain``, ``WORKER_SHUTDOWN_GRACE_S``): when episodes stop, how a stopped
attempt goes back to the Store, and how each process learns of its node's drain.

The integration test (``tests/integration/test_worker_drain.py``) runs prefork, where the attempts run in pool
children that read the drain from Redis; the threads pool's differences are covered here: the main process
knows the stop time without Redis, and an agent that does not return is abandoned (``workers.lifecycle.stuck``) rather
than interrupted, without the stuck-thread restart a draining worker must not do.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from bridge.core.infra import Superseded
from bridge.core.store import RolloutConfig, StoreClient
from workers.lifecycle import drain, state, stuck
from workers.lifecycle.drain import DrainClock, Handover, handover
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.lease import Lease


def test_a_failed_report_when_the_store_retries_it_else_a_hand_back() -> None:
    retried = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    assert handover(retried, 1) is Handover.FAIL
    assert handover(retried, 2) is Handover.REQUEUE  # the last attempt: a failed report would end the rollout
    assert handover(RolloutConfig(), 1) is Handover.REQUEUE  # max_attempts 1, the Store's default
    assert handover(RolloutConfig(max_attempts=3, retry_condition=["timeout"]), 1) is Handover.REQUEUE


def test_episodes_stop_a_margin_before_the_grace_ends() -> None:
    assert drain.stop_after(30) == 30 - drain.MARGIN_S
    assert drain.stop_after(drain.MIN_GRACE_S) == drain.MIN_GRACE_S - drain.MARGIN_S > 0
    assert "grace 9 s" in drain.shutdown_reason(9.0)


def test_a_pool_child_reads_its_node_s_stop_time_from_redis(redis_client: redis.Redis) -> None:
    scope, node = f"t-{uuid.uuid4().hex[:6]}", "worker1@host"
    main, child = DrainClock(), DrainClock(node=node)
    assert not child.refresh(redis_client, scope, time.time())
    stop_at = main.begin(redis_client, scope, node, 9.0)
    assert main.draining and not main.due(redis_client, scope, time.time())
    assert child.refresh(redis_client, scope, time.time() + 1)  # the next read, CHECK_EVERY_S later
    assert child.stop_at == pytest.approx(stop_at) and child.grace_s == 9.0
    assert child.due(redis_client, scope, stop_at + 0.01)


def test_a_drain_left_by_an_earlier_process_of_the_node_name_is_not_this_one_s(redis_client: redis.Redis) -> None:
    """A restarted container keeps its host name, so ``worker@%h`` comes back while its predecessor's drain record
    lives on: the new process reads only a drain its own main process began."""
    scope, node = f"t-{uuid.uuid4().hex[:6]}", "worker1@host"
    DrainClock(incarnation="before-the-restart").begin(redis_client, scope, node, 9.0)
    after = DrainClock(node=node, incarnation="after-the-restart")
    assert not after.refresh(redis_client, scope, time.time()) and not after.draining
    assert not after.due(redis_client, scope, time.time() + 3600)
    ours = DrainClock(incarnation="after-the-restart")
    stop_at = ours.begin(redis_client, scope, node, 9.0)
    child = DrainClock(node=node, incarnation="after-the-restart")  # a pool child of the new process
    assert child.refresh(redis_client, scope, time.time()) and child.stop_at == pytest.approx(stop_at)


@pytest.fixture
def draining(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """This process drains, its stop time passed; records the interrupts instead of sending SIGUSR1."""
    interrupts: list[str] = []
    monkeypatch.setattr(state.process, "drain_clock", DrainClock(node="n@h", stop_at=time.time() - 1, grace_s=9.0))
    monkeypatch.setattr(drain, "interrupt_main_thread", lambda: interrupts.append("SIGUSR1"))
    monkeypatch.setattr(drain, "INTERRUPT_AFTER_S", 0.0)
    yield interrupts


def _watch(redis_client: redis.Redis, *, interruptible: bool = False) -> AttemptWatch:
    lease = Lease(redis_client, f"at-drain-{uuid.uuid4().hex[:6]}", 5)
    return AttemptWatch("ro-1", lease.lease_id, lease, None, 1.0, 60.0, interruptible=interruptible)


def test_the_heartbeat_stops_running_attempts_and_interrupts_prefork_agents_once(
    redis_client: redis.Redis, draining: list[str]
) -> None:
    monitor = HeartbeatMonitor(StoreClient("http://127.0.0.1:9", retries=0), redis_client, None, "scope")
    threaded, prefork, reporting = (
        _watch(redis_client),
        _watch(redis_client, interruptible=True),
        _watch(redis_client),
    )
    reporting.reporting = True  # finished within the grace: its report goes out as usual
    monitor.stop_for_drain([threaded, prefork, reporting])
    monitor.stop_for_drain([threaded, prefork, reporting])
    assert threaded.shutdown and prefork.shutdown and not reporting.shutdown
    assert "grace 9 s" in (threaded.stop_reason or "")
    assert draining == ["SIGUSR1"]  # the prefork one, once
    with pytest.raises(Superseded):
        threaded.check()


def test_without_the_setting_the_heartbeat_ignores_a_drain(redis_client: redis.Redis, draining: list[str]) -> None:
    monitor = HeartbeatMonitor(StoreClient("http://127.0.0.1:9", retries=0), redis_client)
    watch = _watch(redis_client)
    monitor.stop_for_drain([watch])
    assert watch.stop_reason is None and not watch.shutdown


def test_threads_an_agent_that_does_not_return_is_abandoned_without_a_restart(
    redis_client: redis.Redis, draining: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stuck, "ABANDON_GRACE_S", 0.1)
    monkeypatch.setattr(state.node.pool, "max_stuck", 1)
    restarts: list[str] = []
    monkeypatch.setattr(stuck, "restart_worker", restarts.append)
    watch = _watch(redis_client)
    release = threading.Event()
    watch.shut_down(drain.shutdown_reason(9.0))
    try:
        with pytest.raises(Superseded):
            stuck.run_abandonable(release.wait, watch)
    finally:
        release.set()
    assert watch.shutdown and restarts == []  # a draining worker exits; it never re-executes itself
