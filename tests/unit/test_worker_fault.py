"""A fault in the worker's own code, outside the episode's guard, fails the attempt once (``infra``).

Before, it escaped the task: the slot was freed, the bridge's reconcile found the attempt stranded and
re-published it, the same fault struck again, and so on until the rollout was handed back as too old, with
nothing in the Store saying why. Real ``Delivery``, ``AttemptRun`` and ``Lease`` on the Redis at ``TEST_REDIS_URL``; the
Store is a loopback server that answers 503, so the failure report is kept in Redis for a Celery retry,
which is where this test reads it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import redis

from bridge.core.coordination import keys
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.core.task import OutcomeStatus
from tests.loopback import LoopbackServer, RecordingStore
from workers.execution import Delivery
from workers.lifecycle.resources import WorkerResources
from workers.protocol import heartbeat
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.protocol.held import HeldAttempt
from workers.protocol.lease import Lease
from workers.protocol.reporting import ReportPending
from workers.telemetry.courier import TraceCourier


@pytest.fixture
def store() -> Iterator[RecordingStore]:
    recorder = RecordingStore()
    yield recorder
    recorder.close()


def _resources(store_url: str, redis_client: redis.Redis, *, gather_max_s: float = 0.0) -> WorkerResources:
    """A worker process's resources against ``store_url`` (no WebShop: these attempts never reach an episode)."""
    settings = load_settings(store_url=store_url, store_retries=0)
    client = StoreClient(store_url, retries=0, timeout_s=2)
    courier = TraceCourier(client, gather_max_s=gather_max_s)
    return WorkerResources(settings, client, redis_client, None, HeartbeatMonitor(client, redis_client), courier, 0)  # type: ignore[arg-type]


def _attempt() -> tuple[str, str, dict[str, object]]:
    """A fresh attempt's task payload: rollout id, attempt id, payload."""
    rid, aid = f"ro-{uuid.uuid4().hex[:8]}", f"at-{uuid.uuid4().hex[:8]}"
    now = time.time()
    payload = {
        "rollout_id": rid,
        "input": {"instruction": "buy a lamp"},
        "start_time": now,
        "status": "preparing",
        "config": {"timeout_seconds": 3},  # the report is retried until then, then kept for a Celery retry
        "attempt": {"rollout_id": rid, "attempt_id": aid, "sequence_id": 1, "start_time": now},
    }
    return rid, aid, payload


def _serving_rollout(
    rid: str, stored: dict[str, object], *, otherwise: int
) -> tuple[LoopbackServer, list[tuple[str, str]]]:
    """A Store that answers GET of rollout ``rid`` with ``stored`` and everything else with ``otherwise``; the
    requests it saw, in order."""
    seen: list[tuple[str, str]] = []

    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        seen.append((method, path))
        if method == "GET" and path == f"/v1/agl/rollouts/{rid}":
            return 200, {"Content-Type": "application/json"}, json.dumps(stored).encode()
        return otherwise, {}, b""

    return LoopbackServer(answer), seen


def test_an_unexpected_error_is_reported_as_a_failed_attempt_not_left_to_reconcile(
    redis_client: redis.Redis, store: RecordingStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    res = _resources(store.url, redis_client)
    rid, aid, payload = _attempt()

    def broken(*_: object, **__: object) -> None:
        raise NameError("name 'span_flush_interval' is not defined")  # the bug that showed it

    monkeypatch.setattr(HeldAttempt, "start_renewing", broken)  # the worker's own code, outside the episode
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(ReportPending):
            Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
        kept = json.loads(redis_client.get(keys.pending_report(aid)) or "{}")
        assert kept["status"] == "failed"
        assert kept["metadata"]["failure_class"] == "infra"
        assert "NameError" in kept["metadata"]["error"] and "span_flush_interval" in kept["metadata"]["error"]
        assert any("unexpected error in the worker" in r.getMessage() for r in caplog.records)
        assert any(rid in path for path in store.paths)  # it did try to report (its fence read comes first)
    finally:
        for key in redis_client.scan_iter(f"*{aid}*"):
            redis_client.delete(key)
        res.monitor.close()
        res.store.close()


def test_an_attempt_whose_watch_cannot_start_leaves_nothing_counted_or_watched(
    redis_client: redis.Redis, store: RecordingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E.g. the heartbeat threads cannot start: the attempt fails once, its telemetry is closed (the process's
    courier no longer counts it as running, which would make other attempts wait for it) and no watch stays
    registered (one would keep renewing a lease nobody holds)."""
    res = _resources(store.url, redis_client, gather_max_s=0.25)
    _, aid, payload = _attempt()

    class Unstartable(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(heartbeat, "threading", SimpleNamespace(Thread=Unstartable))  # the monitor's threads only
    try:
        with pytest.raises(ReportPending):
            Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
        assert res.courier.running == 0
        assert res.monitor.watches() == []
        kept = json.loads(redis_client.get(keys.pending_report(aid)) or "{}")
        assert kept["status"] == "failed" and "can't start new thread" in kept["metadata"]["error"]
    finally:
        for key in redis_client.scan_iter(f"*{aid}*"):
            redis_client.delete(key)
        res.store.close()


def test_a_duplicate_that_comes_after_the_attempts_markers_expired_stops_at_the_fence(
    redis_client: redis.Redis,
) -> None:
    """DONE_MARKER_TTL_S may be shortened to bound Redis's memory: a delivery of a reported attempt that comes
    after its done, started and owner markers expired looks like a first start, but its dequeue is old, so it
    reads the rollout from the Store, whose attempt is no longer running, and writes nothing."""
    rid, aid, payload = _attempt()
    payload["start_time"] = payload["attempt"]["start_time"] = time.time() - 3 * 24 * 3600  # type: ignore[index]
    stored = {**payload, "status": "succeeded"}
    stored["attempt"] = {**payload["attempt"], "status": "succeeded", "end_time": time.time() - 3 * 24 * 3600}  # type: ignore[dict-item]
    server, seen = _serving_rollout(rid, stored, otherwise=500)
    res = _resources(server.url, redis_client)
    try:
        assert redis_client.exists(keys.done(aid), keys.started(aid), keys.owner(aid)) == 0  # all expired
        outcome = Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
        assert outcome.status is OutcomeStatus.SKIPPED and outcome.detail == "not running: rollout is succeeded"
        assert seen == [("GET", f"/v1/agl/rollouts/{rid}")]  # no spans, no report
    finally:
        for key in redis_client.scan_iter(f"*{aid}*"):
            redis_client.delete(key)
        res.store.close()
        server.close()


def test_the_lease_stays_held_through_a_store_read_before_the_run_slower_than_its_ttl(
    redis_client: redis.Redis,
) -> None:
    """A delivery that must read the rollout before it runs (a takeover, or a dequeue too old to trust) held its
    lease unrenewed until the run began: a Store answer slower than LEASE_TTL_S let it lapse, and a duplicate
    delivery could claim the attempt meanwhile. Now the lease is renewed from the claim on."""
    rid, aid, payload = _attempt()
    payload["start_time"] = payload["attempt"]["start_time"] = time.time() - 3600  # type: ignore[index]
    stored = {**payload, "status": "succeeded"}
    stored["attempt"] = {**payload["attempt"], "status": "succeeded", "end_time": time.time()}  # type: ignore[dict-item]
    held_during_read: list[bool] = []

    def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        if method == "GET" and path == f"/v1/agl/rollouts/{rid}":
            time.sleep(3 * 1.5)  # three lease TTLs
            held_during_read.append(redis_client.exists(keys.lease(aid)) == 1)
            return 200, {"Content-Type": "application/json"}, json.dumps(stored).encode()
        return 500, {}, b""

    server = LoopbackServer(answer)
    settings = load_settings(store_url=server.url, store_retries=0, lease_ttl_s=1.5, heartbeat_interval_s=0.5)
    client = StoreClient(server.url, retries=0, timeout_s=10)
    monitor = HeartbeatMonitor(client, redis_client)
    res = WorkerResources(settings, client, redis_client, None, monitor, TraceCourier(client), 0)  # type: ignore[arg-type]
    try:
        outcome = Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
        assert outcome.status is OutcomeStatus.SKIPPED and outcome.detail == "not running: rollout is succeeded"
        assert held_during_read == [True]
        assert monitor.watches() == [] and redis_client.exists(keys.lease(aid)) == 0  # released at the end
    finally:
        for key in redis_client.scan_iter(f"*{aid}*"):
            redis_client.delete(key)
        monitor.close()
        client.close()
        server.close()


def test_a_takeover_never_runs_an_attempt_again_whose_agent_began_even_while_the_store_shows_it_preparing(
    redis_client: redis.Redis,
) -> None:
    """The redeliver race: an executor's agent began, then its process stalled past LEASE_TTL_S with its first span
    batch still queued at a busy Store. A redelivery took the lapsed lease, read the attempt ``preparing`` and ran the
    episode again in place; the stalled batch landed after, and the attempt held two executions and the wrong reward.
    Now the takeover fails the attempt (``infra``) without running anything, whatever the Store shows."""
    rid, aid, payload = _attempt()
    stored = {**payload, "config": {"timeout_seconds": 600}}  # the Store shows the attempt preparing, no span yet
    server, seen = _serving_rollout(rid, stored, otherwise=503)
    res = _resources(server.url, redis_client)
    try:
        stalled = Lease(redis_client, aid, 5)
        assert stalled.claim(60).acquired and stalled.mark_ran()  # its agent began ...
        redis_client.delete(keys.lease(aid))  # ... and its lease lapsed while it stalled
        with pytest.raises(ReportPending):  # the Store answers 503 to the report: kept for a Celery retry
            Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
        kept = json.loads(redis_client.get(keys.pending_report(aid)) or "{}")
        assert kept["status"] == "failed" and kept["metadata"]["failure_class"] == "infra", kept
        assert "not re-run in place" in kept["metadata"]["error"], kept
        reads = [path for method, path in seen if method == "GET"]
        assert reads and all(path == f"/v1/agl/rollouts/{rid}" for path in reads)  # no resources read: nothing ran
    finally:
        for key in redis_client.scan_iter(f"*{aid}*"):
            redis_client.delete(key)
        res.monitor.close()
        res.store.close()
        server.close()
