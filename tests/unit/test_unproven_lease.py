"""A worker that cannot reach Redis writes nothing into its attempt: no final spans, no report, no Store read.

From inside one host a Redis outage (nobody can take the attempt over) looks exactly like this host's own
partition (the other hosts can, and may have). Trusting the unknown lease and reading the Store instead let
a partitioned host report into an attempt another host had taken over once its link came back; one such
late report flips a finished rollout's status (docs/cluster.md). Real ``AttemptRun``, ``Lease`` and
``AttemptTelemetry``; Redis is a port nothing listens on; the Store is a loopback server that records
every request it gets.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import redis

from bridge.core.infra import LeaseUnproven
from bridge.core.settings import load_settings
from bridge.core.store import AttemptStatus, StoreClient
from tests.loopback import RecordingStore
from workers.execution import AttemptRun
from workers.lifecycle.resources import WorkerResources
from workers.protocol.attempt import Attempt, read_payload
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.protocol.reporting import PendingReport, ReportPending
from workers.telemetry.courier import TraceCourier
from workers.telemetry.spans import AttemptTelemetry


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def cut_off() -> Iterator[tuple[AttemptRun, RecordingStore]]:
    recorder = RecordingStore()
    settings = load_settings(store_url=recorder.url, store_retries=0, lease_ttl_s=4, heartbeat_interval_s=1)
    client = redis.Redis(port=_closed_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    store = StoreClient(recorder.url, retries=0, timeout_s=2)
    monitor = HeartbeatMonitor(store, client)
    res = WorkerResources(settings, store, client, None, monitor, TraceCourier(store), 0)  # type: ignore[arg-type]
    now = time.time()
    payload = {
        "rollout_id": "ro-cut",
        "input": {"instruction": "buy a lamp"},
        "start_time": now,
        "status": "preparing",
        "attempt": {"rollout_id": "ro-cut", "attempt_id": "at-cut", "sequence_id": 1, "start_time": now},
    }
    attempt = read_payload(payload, celery_task_id="at-cut", expected_agent=None)
    assert isinstance(attempt, Attempt)
    run = AttemptRun(attempt, res)
    run.lease.valid_until = time.monotonic() + 3.0  # renewed a second ago, before the link went down
    try:
        yield run, recorder
    finally:
        monitor.close()
        store.close()
        recorder.close()


def test_the_final_spans_wait_for_a_proven_lease_and_are_never_sent_on_trust(
    cut_off: tuple[AttemptRun, RecordingStore],
) -> None:
    run, recorder = cut_off
    telemetry = AttemptTelemetry(
        run.res.store, rollout_id=run.attempt.rollout_id, attempt_id=run.attempt.attempt_id, service_name="cut"
    )
    with telemetry.span("webshop.episode"):
        pass
    started = time.monotonic()
    with pytest.raises(LeaseUnproven):
        run.guard.flush_while_ours(telemetry, until=time.time() + 2.0)
    assert time.monotonic() - started >= 0.5  # it retried Redis within the time it was given
    assert telemetry.pending == 1 and recorder.paths == []


def test_the_report_is_kept_back_not_sent_after_a_store_read(cut_off: tuple[AttemptRun, RecordingStore]) -> None:
    run, recorder = cut_off
    report = PendingReport(AttemptStatus.SUCCEEDED, {"reward": 1.0}, deadline=time.time() + 2.0)
    with pytest.raises(ReportPending):
        run.reporter.deliver_kept(report)  # as a retry delivers a report an earlier delivery kept
    assert recorder.paths == []  # not even the fence read: what it says cannot prove the lease
