"""A finished episode is never lost on the report path (docs/architecture.md, "Guarantees").

The Store goes away right after it stored the episode's spans, reward span included, and stays away for
longer than the pre-report read's retries. Before the fix the task's Celery retry ran as a takeover,
found the attempt ``running`` and reported it ``failed`` (infra): an episode whose reward was in the Store
was thrown away. Now the worker keeps the pending report in Redis and delivers exactly that report.

Real processes throughout: an ``agl store`` of this module's own (so pausing it disturbs nothing else), the session's
Redis, WebShop server and LLM stand-in, one worker and the bridge. A small forwarding proxy in front of the
Store (``StoreFaults``) only watches the traffic: when the span batch carrying the reward has been stored it
stops the real Store (SIGSTOP) for a while, at exactly the moment the worker starts reporting, and it
records every final report the Store was sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from bridge.core.coordination import coordination_client, keys
from bridge.core.store import StoreClient
from bridge.core.task import TASK_NAME, task_kwargs
from bridge_lab.procs import ManagedProcess
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import (
    attempts,
    cancel_unfinished,
    enqueue,
    over_services,
    reward_value,
    rollout,
    spans,
    split_tasks,
    wait_finished,
)

pytestmark = [pytest.mark.integration, pytest.mark.cost(165)]

REWARD_SPAN_NAME = b"agentlightning.annotation"
OUTAGE_S = 20.0  # longer than the pre-report read's retries below (3 tries of 2 s + backoff: about 8 s)
FAST_FAILING_STORE = {
    "STORE_TIMEOUT_S": "2",
    "STORE_RETRIES": "2",
    "FENCE_MAX_AGE_S": "0",  # documented: read the rollout before every report
    "HEARTBEAT_INTERVAL_S": "1",
    "LEASE_TTL_S": "4",
    "SPAN_FLUSH_INTERVAL_S": "1",
    "LOG_LEVEL": "INFO",
}


@dataclass
class StoreFaults:
    """A forwarding HTTP proxy to the real Store that can stop the Store once the reward span is stored."""

    upstream: str
    store_pid: int
    outage_s: float = OUTAGE_S
    reports: list[dict[str, Any]] = field(default_factory=list)  # bodies of final reports the Store was sent
    stall_gets: dict[str, float] = field(default_factory=dict)  # GETs whose path holds the key wait that long
    traffic: list[tuple[float, str, str, float]] = field(default_factory=list)  # (at, method, path, seconds)
    paused_at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        faults = self
        self.upstream_client = httpx.Client(base_url=self.upstream, timeout=120)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                faults.note_request(self.command, self.path, body)
                began = time.monotonic()
                faults.maybe_stall(self.command, self.path)
                try:
                    answer = faults.upstream_client.request(self.command, self.path, content=body, headers=headers)
                    faults.traffic.append((began, self.command, self.path, time.monotonic() - began))
                except httpx.HTTPError:
                    self.send_response(502)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                faults.after_answer(self.command, self.path, body, answer.status_code)
                payload = answer.content
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except OSError:  # the worker gave up waiting (its timeout), as it would on the real Store
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _forward

            def log_message(self, *_: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="store-faults", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def note_request(self, method: str, path: str, body: bytes) -> None:
        if method != "POST" or "/attempts/" not in path:
            return
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return
        if isinstance(data, dict) and "status" in data:
            with self._lock:
                self.reports.append(data)

    def maybe_stall(self, method: str, path: str) -> None:
        """A slow Store for chosen rollouts only (as a Store busy with one large rollout would be)."""
        if method == "GET":
            time.sleep(max((s for key, s in self.stall_gets.items() if key in path), default=0.0))

    def after_answer(self, method: str, path: str, body: bytes, status: int) -> None:
        """The reward span is stored: stop the Store now, as the worker turns to its report."""
        if method != "POST" or not path.startswith("/v1/traces") or status != 200 or REWARD_SPAN_NAME not in body:
            return
        with self._lock:
            if self.paused_at is not None:
                return
            self.paused_at = time.monotonic()
        os.killpg(self.store_pid, signal.SIGSTOP)
        timer = threading.Timer(self.outage_s, os.killpg, (self.store_pid, signal.SIGCONT))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.upstream_client.close()
        os.killpg(self.store_pid, signal.SIGCONT)


Stacked = tuple[LocalStack, StoreFaults]


@pytest.fixture(scope="module")
def private_store(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """An ``agl store`` of this module's own, which its tests stop at will: started once for them all."""
    store_only = LocalStack(
        StackConfig(
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            workers=0,
            bridge=False,
            log_dir=tmp_path_factory.mktemp("private-store"),
        )
    )
    store_only.start()
    yield store_only
    store_only.stop()


@contextlib.contextmanager
def _behind_faults(
    services: LocalStack, store: LocalStack, log_dir: Path, *, bridge: bool, env: dict[str, str]
) -> Iterator[Stacked]:
    """The private Store behind ``StoreFaults``, with one single-slot worker (and the bridge) talking to the proxy."""
    cancel_unfinished(store.store_url)  # nothing an earlier test left for the bridge (or this test) to dequeue
    store_pid = store.process("store").pid
    assert store_pid is not None
    faults = StoreFaults(store.store_url, store_pid)
    stack = LocalStack(
        over_services(
            services,
            store_url=faults.url,
            workers=1,
            concurrency=1,
            bridge=bridge,
            log_dir=log_dir / "workers",
            extra_env=env,
        )
    )
    try:
        stack.start()
        yield stack, faults
    finally:
        stack.stop()
        faults.close()


@pytest.fixture
def outage_stack(services: LocalStack, private_store: LocalStack, tmp_path: Path) -> Iterator[Stacked]:
    with _behind_faults(services, private_store, tmp_path, bridge=True, env=FAST_FAILING_STORE) as stacked:
        yield stacked


def test_a_finished_episode_is_reported_once_with_its_reward_across_a_store_outage(
    outage_stack: Stacked,
) -> None:
    stack, faults = outage_stack
    [rid] = enqueue(stack.store_url, split_tasks(1))
    view = wait_finished(stack.store_url, [rid], timeout_s=OUTAGE_S + 120)[rid]

    log = "".join(worker.log_path.read_text() for worker in stack.workers)
    assert faults.paused_at is not None, "the reward span never reached the Store"
    [attempt] = attempts(stack.store_url, rid)
    assert view["status"] == "succeeded", (view["attempt"].get("metadata"), log[-4000:])
    [reward] = [r for r in (reward_value(s) for s in spans(stack.store_url, rid)) if r is not None]
    assert attempt["metadata"]["reward"] == reward
    # One outcome, however many times it had to be sent: never a second, different report.
    outcomes = {(r["status"], (r.get("metadata") or {}).get("reward")) for r in faults.reports}
    assert outcomes == {("succeeded", reward)}, faults.reports


def _pool_processes(worker: ManagedProcess) -> list[int]:
    """The prefork children of a worker's main process (the ones that run tasks)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(worker.pid)], capture_output=True, text=True, check=False)
    return [int(pid) for pid in out.stdout.split()]


def test_a_redelivery_after_the_worker_died_delivers_the_kept_report(
    outage_stack: Stacked,
) -> None:
    """The executor dies while the Store is away: the redelivered message delivers its report, not a failure."""
    stack, faults = outage_stack
    [rid] = enqueue(stack.store_url, split_tasks(1))
    deadline = time.monotonic() + 60
    while faults.paused_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert faults.paused_at is not None, "the reward span never reached the Store"
    time.sleep(2.0)  # the worker is now retrying its report
    client = coordination_client(stack.broker_url)
    kept = [key for key in client.scan_iter(match=keys.pending_report("*"))]
    assert len(kept) == 1, "the report was not kept while the Store was away"
    [worker] = stack.workers
    children = _pool_processes(worker)
    assert children
    for pid in children:
        os.kill(pid, signal.SIGKILL)

    view = wait_finished(stack.store_url, [rid], timeout_s=OUTAGE_S + 120)[rid]
    log = worker.log_path.read_text()
    [attempt] = attempts(stack.store_url, rid)
    assert view["status"] == "succeeded", (view["attempt"].get("metadata"), log[-4000:])
    [reward] = [r for r in (reward_value(s) for s in spans(stack.store_url, rid)) if r is not None]
    assert attempt["metadata"]["reward"] == reward
    assert "delivering the succeeded report kept by an earlier delivery" in log
    outcomes = {(r["status"], (r.get("metadata") or {}).get("reward")) for r in faults.reports}
    assert outcomes == {("succeeded", reward)}, faults.reports
    assert not list(client.scan_iter(match=keys.pending_report("*")))  # delivered, then dropped


STALL_S = 25.0  # one Store read for the expired rollout takes this long (below STORE_TIMEOUT_S: it answers)


@pytest.fixture
def slow_store_stack(services: LocalStack, private_store: LocalStack, tmp_path: Path) -> Iterator[Stacked]:
    env = {"STORE_TIMEOUT_S": "40", "LOG_LEVEL": "INFO"}
    with _behind_faults(services, private_store, tmp_path, bridge=False, env=env) as stacked:
        yield stacked


def test_an_expired_message_does_not_stall_the_node(slow_store_stack: Stacked) -> None:
    """Handing an expired message back reads the Store; a slow Store must not stop the node taking messages.

    Celery calls ``task_revoked`` inside its consumer loop. Before the fix the hand-back's Store calls ran
    there, and the next message (``live``) waited for them: about STALL_S here, with the slot idle.
    """
    stack, faults = slow_store_stack
    enqueue(stack.store_url, split_tasks(2))
    with StoreClient(stack.store_url) as store:
        expired, live = store.dequeue(2, "test-report-path")  # this test plays the bridge
    faults.stall_gets[f"/rollouts/{expired.rollout_id}"] = STALL_S
    app = Celery("test-report-path", broker=stack.broker_url)
    queue = "rollouts"
    past = datetime.now(UTC) - timedelta(seconds=5)
    app.send_task(
        TASK_NAME, kwargs=task_kwargs(expired, queue), task_id=expired.attempt.attempt_id, queue=queue, expires=past
    )
    sent = time.monotonic()
    app.send_task(TASK_NAME, kwargs=task_kwargs(live, queue), task_id=live.attempt.attempt_id, queue=queue)

    view = wait_finished(stack.store_url, [live.rollout_id], timeout_s=STALL_S + 60)[live.rollout_id]
    assert view["status"] == "succeeded"
    # When the live episode ran: its spans reached the Store (a fresh Store may then take a while to answer
    # its first spans and report, which is why the rollout's end is not what is timed).
    ran = [at - sent for at, method, path, _ in list(faults.traffic) if path.startswith("/v1/traces") and at >= sent]
    assert ran, "the live episode sent no spans"
    assert min(ran) < STALL_S / 2, f"the live message waited {min(ran):.1f}s behind the expired one's hand-back"
    # The hand-back itself still happens, once the Store answers.
    deadline = time.monotonic() + STALL_S * 2 + 15
    while rollout(stack.store_url, expired.rollout_id)["status"] != "requeuing" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rollout(stack.store_url, expired.rollout_id)["status"] == "requeuing"
