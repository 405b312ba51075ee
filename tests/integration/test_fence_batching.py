"""Fence reads batched across the cluster: one Store read per heartbeat interval for all running attempts.

Eight long episodes run in one ``-P threads -c 8`` worker process (its attempts read in one request), or in
eight ``-P prefork`` processes (their attempts read by whichever process takes the fence board's round,
``workers.protocol.fence_board``). While they run, the Store serves one ``GET /rollouts?rollout_id_in=…`` per interval
for the whole worker and no ``GET /rollouts/{id}``; then one
rollout is cancelled, one gets a newer attempt and one attempt is marked ``timeout`` (what the Store's
watchdog writes, docs/store-protocol.md 6.3), and each executor stops within one interval, unreported,
while the five others finish ``succeeded``. Real worker, bridge, Store and stand-ins; the request counts
are the Store's own Prometheus counters (the stack's own Store runs with ``--tracker prometheus``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bridge.core.store import API
from bridge_lab.bench.metrics import store_requests
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, slow_episode_stack, split_tasks, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(110)]

SLOTS = 8
INTERVAL_S = 2.0  # HEARTBEAT_INTERVAL_S of the worker
LLM_LATENCY_MS = 5000.0  # episodes of several LLM calls: far longer than the measured window and the changes
WINDOW_INTERVALS = 3
BATCH_READ = f"GET {API}/rollouts"
SINGLE_READ = f"GET {API}/rollouts/{{rollout_id}}"
DETECTION_SLACK_S = 1.5  # the thread's tick, the read itself and this test's log polling on a loaded machine


@pytest.fixture(
    params=[
        pytest.param("threads", marks=pytest.mark.nightly("prefork, whose bound is the tighter, runs every time")),
        "prefork",
    ]
)
def worker_stack(clean_store: LocalStack, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    # No reconcile and no backlog reading during the test: the bridge's `GET /rollouts?status_in=…` would count as a
    # batch read (a backlog read every 5 s made one quiet run count 6 in 3 intervals).
    env = {
        "HEARTBEAT_INTERVAL_S": str(INTERVAL_S),
        "BRIDGE_RECONCILE_INTERVAL_S": "3600",
        "BRIDGE_BACKLOG_INTERVAL_S": "3600",
    }
    with slow_episode_stack(
        clean_store, tmp_path, LLM_LATENCY_MS, env, concurrency=SLOTS, pool=request.param, counted_store=True
    ) as stack:
        yield stack


def _reads(store_url: str) -> tuple[float, float]:
    counts = store_requests(store_url)
    return counts.get(BATCH_READ, 0.0), counts.get(SINGLE_READ, 0.0)


def _wait_all_started(store_url: str, rollout_ids: list[str], timeout_s: float = 60.0) -> dict[str, str]:
    """Rollout id -> its attempt id, once every rollout has been dequeued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {rid: items[-1]["attempt_id"] for rid in rollout_ids if (items := attempts(store_url, rid))}
        if len(found) == len(rollout_ids):
            return found
        time.sleep(0.2)
    raise AssertionError("not every rollout was dequeued")


def _seconds_until_logged(stack: LocalStack, needle: str, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if needle in "".join(worker.log_path.read_text() for worker in stack.workers):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"the worker never logged {needle!r}")


def test_one_read_per_interval_per_worker_and_every_change_seen_within_one(worker_stack: LocalStack) -> None:
    store = worker_stack.store_url
    rids = enqueue(store, split_tasks(SLOTS))
    aids = _wait_all_started(store, rids)
    time.sleep(INTERVAL_S)  # every attempt is past its start and on the process's heartbeat schedule

    batch_before, single_before = _reads(store)
    time.sleep(WINDOW_INTERVALS * INTERVAL_S)
    batch_after, single_after = _reads(store)
    batch_reads, single_reads = batch_after - batch_before, single_after - single_before
    print(f"{WINDOW_INTERVALS} intervals, {SLOTS} attempts: {batch_reads:.0f} batched, {single_reads:.0f} single reads")
    # One request per interval for the eight attempts (a read per attempt would be 24), give or take one at either end
    # of the window; and no per-rollout read at all. Under prefork the eight processes share each round through the
    # fence board, and a process whose beat is GRACE_S overdue with no verdict reads on its own: within the bound above
    # in every quiet run, 6 beside two busy loops (pytest --cpu-load 2). At most three an interval is still batching.
    most = WINDOW_INTERVALS + 2 if worker_stack.config.pool == "threads" else 3 * WINDOW_INTERVALS
    assert 1 <= batch_reads <= most, f"{batch_reads} batched reads in {WINDOW_INTERVALS} intervals"
    assert single_reads == 0, f"{single_reads} per-rollout reads while {SLOTS} attempts ran"

    cancelled, superseded, timed_out, *others = rids
    changes = [
        (cancelled, lambda: httpx.post(f"{store}{API}/rollouts/{cancelled}", json={"status": "cancelled"}, timeout=30)),
        (superseded, lambda: httpx.post(f"{store}{API}/rollouts/{superseded}/attempts", json={}, timeout=30)),
        (
            timed_out,
            lambda: httpx.post(
                f"{store}{API}/rollouts/{timed_out}/attempts/{aids[timed_out]}", json={"status": "timeout"}, timeout=30
            ),
        ),
    ]
    for rid, change in changes:
        change().raise_for_status()
        seconds = _seconds_until_logged(worker_stack, f"stopping rollout={rid} attempt={aids[rid]}", 30.0)
        print(f"{rid}: stopped {seconds:.2f}s after the change")
        assert seconds <= INTERVAL_S + DETECTION_SLACK_S, f"{rid}: stopped {seconds:.1f}s after the change"

    finished = wait_finished(store, others, timeout_s=120)
    assert {rid: view["status"] for rid, view in finished.items()} == dict.fromkeys(others, "succeeded")
    for rid in (cancelled, superseded, timed_out):
        mine = [a for a in attempts(store, rid) if a["attempt_id"] == aids[rid]]
        assert mine and mine[0]["status"] not in ("succeeded", "failed"), f"{rid}: a stopped attempt was reported"
    assert rollout(store, cancelled)["status"] == "cancelled"
    log = "".join(worker.log_path.read_text() for worker in worker_stack.workers)
    assert f"stopping rollout={cancelled} attempt={aids[cancelled]}: rollout is cancelled" in log
    assert f"stopping rollout={superseded} attempt={aids[superseded]}: superseded by attempt" in log
    # The timed-out attempt fails its rollout (one attempt allowed): the fence reads either status.
    assert re.search(
        rf"stopping rollout={timed_out} attempt={aids[timed_out]}: (rollout is failed|attempt is timeout)", log
    )
