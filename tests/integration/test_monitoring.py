"""Operability against real processes: `bridge status --json`, Prometheus series of bridge and workers, Flower.

One module stack (one prefork worker node with metrics on, Flower with basic auth, a bridge with metrics)
runs a few real rollouts plus one bad input; the tests then read what an operator would read. The last test
stops the worker and reads the autoscaling signal (docs/operations.md, "Autoscaling signal") from the leader
and from a standby bridge.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bridge.core.task import TASK_NAME
from bridge.dispatch import metrics
from bridge_lab.procs import free_port
from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished, enqueue, metric_samples, split_tasks, stack_for, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(20)]

GOOD = 6
FLOWER_AUTH = ("ops", "s3cret-for-tests")
GAUGES_SETTLE_S = 15.0


@pytest.fixture(scope="module")
def ops(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A stack with every observability surface on, after GOOD succeeded rollouts and one failed one."""
    cancel_unfinished(services.store_url)
    stack = stack_for(
        services,
        tmp_path_factory.mktemp("operability"),
        workers=1,
        concurrency=4,
        flower=True,
        bridge_metrics_port=0,
        worker_metrics=True,
        # FLOWER_READ_ONLY as docker-compose.yml and deploy/kubernetes set it
        extra_env={
            "FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH),
            "FLOWER_READ_ONLY": "true",
            "BRIDGE_BACKLOG_INTERVAL_S": "1",
        },
    )
    stack.start()
    try:
        good = enqueue(stack.store_url, split_tasks(GOOD))
        [bad] = enqueue(stack.store_url, [{"task_id": "no-instruction"}])
        final = wait_finished(stack.store_url, [*good, bad], timeout_s=180)
        yield {"stack": stack, "good": good, "bad": bad, "final": final}
    finally:
        stack.stop()
        cancel_unfinished(services.store_url)


def _env(stack: LocalStack) -> dict[str, str]:
    return {**os.environ, "AGENT_LIGHTNING_STORE_URL": stack.store_url, "CELERY_BROKER_URL": stack.broker_url}


def _total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    found = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(pairs.get(k) == v for k, v in labels.items()):
            found += value
    return found


def test_rollouts_finished_as_expected(ops: dict[str, object]) -> None:
    final = ops["final"]
    assert isinstance(final, dict)
    assert all(final[rid]["status"] == "succeeded" for rid in ops["good"])  # type: ignore[attr-defined]
    assert final[ops["bad"]]["status"] == "failed"


def test_status_json_reports_store_broker_workers_and_last_errors(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack)
    out = subprocess.run(
        [sys.executable, "-m", "bridge", "status", "--json"],
        env=_env(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) >= {"store", "broker", "workers", "in_flight", "oldest_queued_s", "last_errors"}
    assert report["store"]["ok"] and report["broker"]["ok"]
    counts = report["store"]["counts"]
    assert set(counts) == {"queuing", "preparing", "running", "succeeded", "failed", "cancelled", "requeuing"}
    assert counts["succeeded"] >= GOOD and counts["failed"] >= 1
    queue = report["broker"]["queues"]["rollouts"]
    assert queue["depth"] == 0 and queue["in_flight"] == 0 and queue["oldest_queued_s"] is None
    assert queue["slots"] == 4 and queue["free_slots"] == 4
    assert queue["waiting"] == 0 and queue["oldest_waiting_s"] is None and report["waiting_exact"]
    assert report["in_flight"] == 0
    [worker] = [w for w in report["workers"] if w["name"] == f"worker1@{socket.gethostname()}"]
    assert worker["slots"] == 4 and worker["queues"] == ["rollouts"] and worker["active"] == []
    errors = {e["rollout_id"]: e for e in report["last_errors"]}
    assert ops["bad"] in errors
    assert errors[ops["bad"]]["failure_class"] == "input" and "instruction" in errors[ops["bad"]]["error"]


def test_status_text_is_readable(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack)
    out = subprocess.run(
        [sys.executable, "-m", "bridge", "status", "--no-inspect"],
        env=_env(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for words in ("Store", "succeeded", "Broker", "rollouts", "Workers (1 online", "Last errors", str(ops["bad"])):
        assert words in out.stdout, out.stdout


def test_bridge_metrics_expose_the_named_series(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack) and stack.bridge_metrics_url
    samples = metric_samples(stack.bridge_metrics_url)
    assert _total(samples, "agl_bridge_dequeued_total") >= GOOD + 1
    assert _total(samples, "agl_bridge_published_total", queue="rollouts") >= GOOD + 1
    assert _total(samples, "agl_bridge_dequeue_to_publish_seconds_count") >= GOOD + 1
    assert _total(samples, "agl_bridge_handed_back_total") == 0
    assert _total(samples, "agl_bridge_store_errors_total") == 0
    assert 'agl_bridge_store_errors_total{kind="dequeue"}' in samples
    assert samples['agl_bridge_is_leader{line="v03"}'] == 1
    # Every rollout has finished: the bridge's next ticks (every fraction of a second) see nothing in flight and
    # nothing waiting in the broker, so each gauge settles at 0 within a few seconds.
    gauges = [
        f'{gauge}{{queue="rollouts"}}'
        for gauge in ("agl_bridge_in_flight", "agl_bridge_queue_depth", "agl_bridge_oldest_queued_age_seconds")
    ]
    deadline = time.monotonic() + GAUGES_SETTLE_S
    while True:
        settled = {name: samples.get(name) for name in gauges}
        if all(value == 0 for value in settled.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        samples = metric_samples(stack.bridge_metrics_url)
    assert all(value == 0 for value in settled.values()), f"{settled}, {GAUGES_SETTLE_S:.0f} s after the last rollout"


def test_worker_metrics_expose_the_named_series(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack)
    [url] = stack.worker_metrics_urls.values()
    samples = metric_samples(url)
    assert _total(samples, "agl_worker_rollouts_total", status="succeeded", failure_class="none") == GOOD
    assert _total(samples, "agl_worker_rollouts_total", status="failed", failure_class="input") == 1
    assert _total(samples, "agl_worker_episode_duration_seconds_count", status="succeeded") == GOOD
    assert _total(samples, "agl_worker_episode_steps_count") == GOOD
    assert _total(samples, "agl_worker_reward_count") == GOOD
    reward_sum = _total(samples, "agl_worker_reward_sum")
    assert 0 <= reward_sum <= GOOD
    assert _total(samples, "agl_worker_dequeue_to_start_seconds_count", queue="rollouts") == GOOD + 1
    assert _total(samples, "agl_worker_llm_request_seconds_count", outcome="ok") >= GOOD
    assert _total(samples, "agl_worker_llm_rate_limited_total") == 0
    assert 'agl_worker_llm_rate_limited_total{source="settings"}' in samples
    assert _total(samples, "agl_worker_env_request_seconds_count", op="reset") == GOOD
    assert _total(samples, "agl_worker_env_request_seconds_count", op="step") >= GOOD
    assert _total(samples, "agl_worker_env_errors_total") == 0


def test_flower_shows_rollout_attempt_and_instruction_behind_basic_auth(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack) and stack.flower_url
    assert httpx.get(f"{stack.flower_url}/api/tasks", timeout=10).status_code == 401
    tasks = httpx.get(f"{stack.flower_url}/api/tasks", auth=FLOWER_AUTH, timeout=10).json()
    final = ops["final"]
    assert isinstance(final, dict)
    shown = {task_id: task for task_id, task in tasks.items() if task.get("name") == TASK_NAME}
    for rid in ops["good"]:  # type: ignore[attr-defined]
        attempt_id = final[rid]["attempt"]["attempt_id"]
        assert attempt_id in shown, f"{attempt_id} not in Flower"
        text = shown[attempt_id]["kwargs"]
        assert f"rollout={rid}" in text and f"attempt={attempt_id}" in text
        assert "instruction=" in text and final[rid]["input"]["instruction"][:20] in text
        assert "api_key" not in text and "OPENAI" not in text


def test_read_only_flower_sends_no_task_and_controls_no_worker(ops: dict[str, object]) -> None:
    """FLOWER_READ_ONLY, the deployments' default, turns off what would let Flower's login run code on the
    workers (any task sent by name) or stop them; the views stay. An unknown task name keeps this harmless
    where read-only mode is off: Flower answers 404 then, 403 only when it refuses every send."""
    stack = ops["stack"]
    assert isinstance(stack, LocalStack) and stack.flower_url
    send = httpx.post(
        f"{stack.flower_url}/api/task/async-apply/tests.no_such_task", auth=FLOWER_AUTH, json={}, timeout=10
    )
    assert send.status_code == 403 and "read only" in send.text.lower(), (send.status_code, send.text)
    revoke = httpx.post(f"{stack.flower_url}/api/task/revoke/no-such-id", auth=FLOWER_AUTH, timeout=10)
    assert revoke.status_code == 403 and "read only" in revoke.text.lower(), (revoke.status_code, revoke.text)
    assert httpx.get(f"{stack.flower_url}/api/workers", auth=FLOWER_AUTH, timeout=30).status_code == 200


def test_worker_log_lines_carry_rollout_attempt_and_task_ids(ops: dict[str, object]) -> None:
    stack = ops["stack"]
    assert isinstance(stack, LocalStack)
    log = Path(stack.process("worker1").log_path).read_text(errors="replace")
    final = ops["final"]
    assert isinstance(final, dict)
    for rid in ops["good"]:  # type: ignore[attr-defined]
        aid = final[rid]["attempt"]["attempt_id"]
        assert f"[rollout={rid} attempt={aid} task={aid}] reported succeeded" in log


WAITING = 5


def test_the_leader_exports_the_stores_backlog_as_desired_slots_and_a_standby_exports_none(
    ops: dict[str, object],
) -> None:
    """Last in the module: it stops the worker, so what is enqueued waits in the Store."""
    stack = ops["stack"]
    assert isinstance(stack, LocalStack) and stack.bridge_metrics_url
    port = free_port()
    standby = subprocess.Popen(
        [sys.executable, "-m", "bridge", "run", "--metrics-port", str(port)],
        env=stack.component_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stack.process("worker1").stop()  # a warm shutdown withdraws its slots: the bridge claims nothing
        enqueue(stack.store_url, split_tasks(WAITING))
        leader = _settled(
            stack.bridge_metrics_url, lambda s: s.get('agl_bridge_store_waiting_rollouts{queue="rollouts"}'), WAITING
        )
        assert leader['agl_bridge_desired_slots{queue="rollouts"}'] == WAITING
        assert leader['agl_bridge_total_slots{queue="rollouts"}'] == 0
        assert leader['agl_bridge_free_slots{queue="rollouts"}'] == 0
        assert leader['agl_bridge_store_oldest_waiting_seconds{queue="rollouts"}'] >= 0
        assert leader['agl_bridge_is_leader{line="v03"}'] == 1
        others = _settled(f"http://127.0.0.1:{port}/metrics", lambda s: s.get('agl_bridge_is_leader{line="v03"}'), 0)
        exported = {key.partition("{")[0] for key in others}
        leader_only = {gauge._name for gauge in metrics.LEADER_GAUGES}
        assert not exported & leader_only, exported & leader_only
    finally:
        standby.terminate()
        standby.wait(timeout=15)


def _settled(url: str, read: Callable[[dict[str, float]], float | None], want: float) -> dict[str, float]:
    """The samples at ``url`` once ``read`` gives ``want`` (an unanswered scrape reads as none), within 30 s."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            samples = metric_samples(url)
        except httpx.HTTPError:
            samples = {}
        if read(samples) == want or time.monotonic() > deadline:
            assert read(samples) == want, samples
            return samples
        time.sleep(0.5)
