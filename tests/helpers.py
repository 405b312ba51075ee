"""What the tests share: the Store's REST API (enqueue, wait, inspect, clean up), a loopback OTLP collector.

* Store look-ups go through the real REST API at ``bridge.core.store.client.API``.
* ``OtlpCollector`` is what an operator's Jaeger/Tempo would be (``OTEL_EXPORTER_OTLP_ENDPOINT``), or a
  stand-in for ``AGENT_LIGHTNING_OTLP_ENDPOINT`` that refuses the reward span on purpose. It decodes real
  OTLP protobuf, so it proves what the processes actually sent.

No tests live here.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from bridge.core.coordination import keys, slot_share
from bridge.core.store import API
from bridge_lab.stack import LocalStack, StackConfig
from tests import redis_for_tests

TEST_REDIS_URL = redis_for_tests.url()  # this process's own database or server (tests/redis_for_tests.py)


def line_of(attempt_key: str) -> str:
    """The line that published an in-flight entry: the 1.0 dispatcher's task ids start ``v1-``."""
    return slot_share.V1 if attempt_key.startswith(slot_share.V1_PREFIX) else slot_share.V03


def drop_adverts(client: redis.Redis, scope: str, queue: str) -> list[str]:
    """Remove every slot advert on ``queue`` of deployment ``scope`` and its node listing (a test's own queue);
    the nodes it had."""
    nodes: list[str] = client.zrange(keys.capacity_nodes(scope, queue), 0, -1)
    client.delete(keys.capacity_nodes(scope, queue), *[keys.capacity(scope, queue, node) for node in nodes])
    return nodes


def split_tasks(limit: int, split: str = "test") -> list[dict[str, Any]]:
    out = subprocess.check_output(
        [sys.executable, "-m", "webshop_env", "tasks", "--split", split, "--limit", str(limit)], timeout=60
    )
    return list(json.loads(out))


def enqueue(
    store_url: str,
    inputs: list[Any],
    *,
    mode: str = "test",
    config: dict[str, Any] | None = None,
    resources_id: str | None = None,
) -> list[str]:
    """Enqueue through the REST API; without ``resources_id`` the Store stamps its latest resources."""
    extra = {"resources_id": resources_id} if resources_id else {}
    body = {"rollouts": [{"input": item, "mode": mode, "config": config, **extra} for item in inputs]}
    response = httpx.post(f"{store_url}{API}/queues/rollouts/enqueue", json=body, timeout=30)
    response.raise_for_status()
    return [item["rollout_id"] for item in response.json()]


def rollout(store_url: str, rollout_id: str) -> dict[str, Any]:
    response = httpx.get(f"{store_url}{API}/rollouts/{rollout_id}", timeout=30)
    response.raise_for_status()
    return dict(response.json())


def attempts(store_url: str, rollout_id: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{store_url}{API}/rollouts/{rollout_id}/attempts", timeout=30)
    response.raise_for_status()
    return list(response.json()["items"])


def spans(store_url: str, rollout_id: str, attempt_id: str = "latest") -> list[dict[str, Any]]:
    response = httpx.get(
        f"{store_url}{API}/spans", params={"rollout_id": rollout_id, "attempt_id": attempt_id}, timeout=30
    )
    response.raise_for_status()
    return list(response.json()["items"])


def metric_samples(url: str) -> dict[str, float]:
    """A process's /metrics (Prometheus text format) as {'name{labels}': value}; labels kept verbatim."""
    text = httpx.get(url, timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 0.1 s; AssertionError naming ``what`` when it is not true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def wait_finished(store_url: str, rollout_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Poll until every rollout is succeeded/failed/cancelled or the deadline passes; return the last view."""
    deadline = time.monotonic() + timeout_s
    finished: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        pending = [r for r in rollout_ids if r not in finished]
        if not pending:
            break
        response = httpx.post(
            f"{store_url}{API}/waits/rollouts", json={"rollout_ids": pending, "timeout": 0}, timeout=30
        )
        response.raise_for_status()
        for item in response.json():
            finished[item["rollout_id"]] = item
        if len(finished) < len(rollout_ids):
            time.sleep(0.5)
    return {rid: rollout(store_url, rid) for rid in rollout_ids}


def cancel_unfinished(store_url: str) -> int:
    """Cancel every rollout that is not finished, so the next test's bridge does not pick it up."""
    params = {"status_in": ["queuing", "requeuing", "preparing", "running"]}
    response = httpx.get(f"{store_url}{API}/rollouts", params=params, timeout=30)
    response.raise_for_status()
    items = response.json()["items"]
    for item in items:
        httpx.post(f"{store_url}{API}/rollouts/{item['rollout_id']}", json={"status": "cancelled"}, timeout=30)
    return len(items)


def purchases(webshop_url: str, session_id: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{webshop_url}/purchases", params={"session_id": session_id}, timeout=30)
    response.raise_for_status()
    return list(response.json()["items"])


def stack_for(services: LocalStack, log_dir: Path, **config: object) -> LocalStack:
    """A stack reusing the session's services, adding its own workers/bridge."""
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            log_dir=log_dir,
            **config,  # type: ignore[arg-type]
        )
    )
    return stack


# --- a loopback OTLP/HTTP collector and span look-ups ---------------------------------------------------

REWARD_SPAN = "agentlightning.annotation"


@dataclass(frozen=True)
class CollectedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpCollector:
    """``ThreadingHTTPServer`` on 127.0.0.1 taking ``POST /v1/traces``; ``reject`` decides a 500 per request."""

    def __init__(self, reject: Callable[[list[CollectedSpan]], bool] | None = None) -> None:
        self.spans: list[CollectedSpan] = []
        self.rejected: list[CollectedSpan] = []
        self.requests = 0
        self._reject = reject
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = collector._receive(self.path, body)
                payload = ExportTraceServiceResponse().SerializeToString() if status == 200 else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes it (the exporter appends ``/v1/traces``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _receive(self, path: str, body: bytes) -> int:
        if path != "/v1/traces":
            return 404
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception:  # a malformed body is the sender's bug: answer like a collector would
            return 400
        batch: list[CollectedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    batch.append(
                        CollectedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            resource=resource,
                        )
                    )
        with self._lock:
            self.requests += 1
            if self._reject is not None and self._reject(batch):
                self.rejected.extend(batch)
                return 500
            self.spans.extend(batch)
        return 200

    def snapshot(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float) -> list[CollectedSpan]:
        """Bounded wait: the SDK's batch processor exports every few seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.25)


def rejects_reward(batch: list[CollectedSpan]) -> bool:
    return any(span.name == REWARD_SPAN for span in batch)


def reward_value(span: dict[str, Any]) -> float | None:
    """The primary reward of a Store span in section 8's format, or None if it is not a reward span."""
    attributes = span.get("attributes") or {}
    if span.get("name") != REWARD_SPAN or attributes.get("agentlightning.reward.0.name") != "primary":
        return None
    return float(attributes["agentlightning.reward.0.value"])


@contextlib.contextmanager
def silent_llm_url() -> Iterator[str]:
    """An OpenAI base URL whose server accepts connections (the kernel's backlog) and never replies."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        listener.close()


def slow_episode_stack(
    services: LocalStack,
    log_dir: Path,
    latency_ms: float,
    env: dict[str, str],
    *,
    concurrency: int = 2,
    pool: str = "prefork",
    counted_store: bool = False,
) -> LocalStack:
    """One worker node and a bridge with their own slow LLM stand-in: episodes long enough for a test to
    act while they run (cancel them, redeliver them, fence them). ``counted_store``: a Store of their own with
    its Prometheus request counters (``--tracker prometheus``, which the session's Stores go without: it doubles
    the CPU of each request) instead of the session's."""
    return LocalStack(
        StackConfig(
            store_url=None if counted_store else services.store_url,
            store_tracker="prometheus" if counted_store else None,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            policy_latency_ms=latency_ms,
            workers=1,
            concurrency=concurrency,
            pool=pool,
            log_dir=log_dir,
            extra_env=env,
        )
    )


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def serving_programs(settings: Any) -> Iterator[Any]:
    """A 1.0 program server (``workers.v1.server_supervisor.ProgramServer``) started for ``settings``, stopped after."""
    from workers.v1.server_supervisor import ProgramServer

    started = ProgramServer(settings)
    started.start()
    try:
        yield started
    finally:
        started.stop()


def program_alive(pid_file: Path) -> bool:
    """Whether anything of the program that wrote ``pid_file`` still runs (``Sleeping``, ``LeavesChild`` in
    tests/agl_v1_agents.py write their pid, their child's and their uid): in a box, any process of its uid (the pids
    it wrote may be its own PID namespace's); unboxed, those two pids."""
    pid, child, uid = (int(word) for word in pid_file.read_text().split())
    if uid < 1_000_000:  # not a box's (AGL_V1_PROGRAM_UID_BASE is at least that)
        return process_alive(pid) or process_alive(child)
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid and process_alive(int(entry)):
                return True
        except OSError:
            continue
    return False


def over_services(services: LocalStack, **fields: Any) -> StackConfig:
    """A stack on the session's services (its Store unless ``store_url`` is given, its broker, WebShop server and
    LLM stand-in) with ``fields`` for the rest: workers, concurrency, bridge, log_dir, extra_env, ..."""
    shared: dict[str, Any] = {
        "store_url": services.store_url,
        "broker_url": services.broker_url,
        "webshop_url": services.webshop_url,
        "llm_base_url": services.llm_base_url,
    }
    return StackConfig(**{**shared, **fields})
