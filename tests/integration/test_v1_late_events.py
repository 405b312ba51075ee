"""What Agent Lightning 1.0's gateway (a real ``agl-server``, ``bridge_lab.agl_v1_env``) does with what reaches it
for an attempt after that attempt ended: the facts behind "No dead end" in docs/agl-v1.md, "Guarantees".

On 0.3 a span batch that lands after a ``failed`` report turns a requeued rollout ``running`` again with no live
attempt, and the 0.3 reconcile settles it (``bridge.dispatch.reconcile``, "dead end"). The 1.0 gateway has no
such path, and the 1.0 dispatcher no such rule, because of what these tests record: a rollout's state changes
only by a ``PATCH`` and never leaves ``succeeded`` or ``failed``; a late event or proxied LLM call is stored under
its attempt and changes no status field; there is no span ingestion at all. A gateway version that changes any
of this fails here. The reports are made as our workers and dispatcher make them (``GatewayClient``), the late
traffic as an agent program sends it (``AGL_EVENT_URL``, ``AGL_OPENAI_BASE_URL``), against an in-process model
endpoint. No Redis, broker or worker is involved.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from bridge.core.agl_v1 import GatewayClient, GatewayConflict, V1Rollout, V1State
from bridge.dispatch.v1_repairs import Republish, V1Facts, current_key, plan_v1_repairs
from bridge_lab.agl_v1_env import v1_virtualenv
from bridge_lab.procs import StackError, free_port, serving
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(5)]

KEY = "agl-v1-late-key"
MODEL = "late-model"
CONFIRM_S = 25.0


class _Model(BaseHTTPRequestHandler):
    """An OpenAI-compatible model endpoint that answers every chat completion at once, with token ids."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        reply = {
            "id": "late",
            "object": "chat.completion",
            "model": MODEL,
            "prompt_token_ids": [1, 2],
            "choices": [{**choice, "token_ids": [3]}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        }
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Gateway:
    url: str
    client: GatewayClient
    http: httpx.Client

    def started(self) -> V1Rollout:
        """A rollout as our dispatcher leaves it after its publish: ``running``, attempt ``0``."""
        config = {"timeout_seconds": 60, "local": {"agent_class": "tests.agl_v1_agents:AskAndReward"}}
        [rollout] = self.client.create_rollouts([{"input": {"question": "late?"}, "config": config}])
        running = self.client.patch_status(rollout.rollout_id, state=V1State.RUNNING, last_attempt_id="0")
        assert running is not None
        return running

    def late_traffic(self, rollout_id: str, attempt_id: str) -> dict[str, int]:
        """What a program, or a request of it still in flight, sends for ``attempt_id``: a reward event, an LLM call
        through the proxy, and a span export to 0.3's OTLP path. The HTTP status of each."""
        event = self.http.post(
            f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events",
            json={"event_type": "reward", "data": {"value": 1.0}},
        )
        llm = self.http.post(
            f"/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/train/openai/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "still there?"}]},
        )
        spans = self.http.post("/v1/traces", content=b"", headers={"content-type": "application/x-protobuf"})
        return {"event": event.status_code, "llm": llm.status_code, "spans": spans.status_code}

    def detail(self, rollout_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get(f"/api/rollouts/{rollout_id}").raise_for_status().json()
        return answer

    def active_ids(self) -> set[str]:
        """The rollouts the 1.0 dispatcher would see: ``queuing`` (to start) or ``running`` (to reconcile)."""
        return {r.rollout_id for r in self.client.list_rollouts(V1State.QUEUING, V1State.RUNNING)}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    try:
        venv = v1_virtualenv()
    except StackError as exc:
        missing(str(exc))
    model = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    threading.Thread(target=model.serve_forever, daemon=True).start()
    log_dir: Path = tmp_path_factory.mktemp("agl-v1-late")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(venv / "bin/agl-server"), "host=127.0.0.1", f"port={port}", f"key={KEY}"]
    argv += [f"default_proxy.model_name={MODEL}", f"hydra.run.dir={log_dir / 'hydra'}"]
    try:
        with serving("agl-v1-gateway", argv, f"{url}/healthz", timeout_s=30, log_dir=log_dir):
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            endpoint = [{"model": MODEL, "endpoint": f"http://127.0.0.1:{model.server_port}/v1"}]
            http.post("/api/models", json=endpoint).raise_for_status()
            client = GatewayClient(url, key=KEY, retries=0)
            try:
                yield Gateway(url, client, http)
            finally:
                client.close()
                http.close()
    finally:
        model.shutdown()
        model.server_close()


@pytest.mark.parametrize("final", [V1State.FAILED, V1State.SUCCEEDED])
def test_what_arrives_for_a_reported_attempt_changes_no_status_and_revives_nothing(
    gateway: Gateway, final: V1State
) -> None:
    rid = gateway.started().rollout_id
    assert gateway.client.finish(rid, "0", final, "the agent's program exited with code 1")  # the worker's report
    reported = gateway.detail(rid)["rollout"]["status"]
    assert reported["state"] == final and reported["last_attempt_id"] == "0"

    # Stored, all of it: the gateway takes events and LLM calls for any attempt of a rollout it has, finished or
    # not. It has no span endpoint at all (0.3's OTLP path is not found), so nothing span-shaped can land.
    assert gateway.late_traffic(rid, "0") == {"event": 200, "llm": 200, "spans": 404}

    detail = gateway.detail(rid)
    assert detail["rollout"]["status"] == reported  # state, attempt, error, version and updated_at: untouched
    assert detail["attempts"] == ["0"]
    assert rid not in gateway.active_ids()  # never queuing or running again: nothing for the dispatcher to find
    # The late events are the current attempt's: a trainer that reads the events after the final state sees them.
    assert [e["event_type"] for e in gateway.client.events(rid)] == ["reward", "model_request"]

    # A final state is final: a write back to running is refused, and a second report of the attempt is not made.
    with pytest.raises(GatewayConflict):
        gateway.client.patch_status(rid, state=V1State.RUNNING)
    assert not gateway.client.finish(rid, "0", V1State.FAILED, "a late report")
    assert gateway.detail(rid)["rollout"]["status"] == reported


def test_what_arrives_for_an_attempt_a_re_run_superseded_leaves_the_rollout_on_its_new_attempt(
    gateway: Gateway,
) -> None:
    rid = gateway.started().rollout_id
    assert gateway.client.patch_status(rid, last_attempt_id="1")  # the dispatcher's re-run after a lost worker
    moved = gateway.detail(rid)["rollout"]["status"]

    assert gateway.late_traffic(rid, "0") == {"event": 200, "llm": 200, "spans": 404}
    assert not gateway.client.finish(rid, "0", V1State.FAILED, "the lost worker's late report")  # not current

    [rollout] = [r for r in gateway.client.list_rollouts(V1State.RUNNING) if r.rollout_id == rid]
    assert (rollout.status.state, rollout.status.last_attempt_id) == (V1State.RUNNING, "1")
    assert gateway.detail(rid)["rollout"]["status"] == moved  # the late traffic wrote no status field
    assert gateway.client.events(rid) == []  # the trainer reads attempt 1's events; attempt 0's stay out

    # Running on attempt 1 is what the reconcile watches: should attempt 1's message or executor be lost too, the
    # planner publishes it again (here, two scans apart, nothing in flight and no marker of it in Redis).
    key = current_key(rollout)
    facts = V1Facts(
        running={key: rollout},
        inflight={},
        executions={},
        kept={},
        handovers={},
        suspects={key: 0.0},
        now=CONFIRM_S,
        max_queue_wait_s=300.0,
        confirm_s=CONFIRM_S,
        max_reruns=1,
    )
    assert plan_v1_repairs(facts).repairs == (Republish(rollout, "1", f"v1-{rid}-1"),)

    assert gateway.client.finish(rid, "1", V1State.SUCCEEDED, "")
    assert gateway.detail(rid)["rollout"]["status"]["state"] == V1State.SUCCEEDED
