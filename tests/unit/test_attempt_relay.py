"""The attempt relay (``workers.v1.relay``): what a 1.0 program's token opens, what it never reaches, and what the
answers carry. The upstream here is a recording HTTP server in the gateway's place; tests/integration/test_agl_v1.py
runs a hostile program against the real ``agl-server``."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from bridge.core.gateway import V1Rollout
from workers.lifecycle import metrics
from workers.v1 import relay as relay_module
from workers.v1.relay import AttemptRelay

KEY = "the-gateway-key"


class Upstream(ThreadingHTTPServer):
    """Records every request; ``/slow`` paths answer in two chunks a moment apart, ``/paused`` with a 429."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
        if "paused" in self.path:
            self._reply(429, b'{"detail": "paused"}', {"Retry-After": "7"})
        elif "slow" in self.path:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"first ", b"second"):
                self.wfile.write(b"%x\r\n%b\r\n" % (len(part), part))
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._reply(200, json.dumps({"echo": body.decode()}).encode(), {"X-Upstream": "yes"})

    do_GET = do_PATCH = do_DELETE = do_POST

    def _reply(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def relay(upstream: Upstream) -> Iterator[AttemptRelay]:
    relay = AttemptRelay(f"http://127.0.0.1:{upstream.server_address[1]}", KEY)
    yield relay
    relay.close()


def _rollout(rollout_id: str) -> V1Rollout:
    return V1Rollout.model_validate(
        {"rollout_id": rollout_id, "input": {}, "config": {"local": {"agent_class": "a:B"}}}
    )


def _refused(reason: str) -> float:
    return metrics.RELAY_REFUSED.labels(reason)._value.get()


def test_its_own_model_call_and_event_reach_the_gateway_with_the_key_in_place_of_the_token(
    relay: AttemptRelay, upstream: Upstream
) -> None:
    grant = relay.grant(_rollout("ro-1"), "0")
    env = grant.env
    assert env["AGL_KEY"] == grant.token != KEY and env["AGL_OPENAI_BASE_URL"].startswith(relay.url)
    call = httpx.post(
        env["AGL_OPENAI_BASE_URL"] + "/chat/completions",
        json={"m": 1},
        headers={"Authorization": f"Bearer {grant.token}"},
    )
    event = httpx.post(env["AGL_EVENT_URL"], json={"event_type": "reward"}, headers={"x-api-key": grant.token})
    assert call.status_code == event.status_code == 200 and call.headers["X-Upstream"] == "yes"
    assert json.loads(call.json()["echo"]) == {"m": 1}
    paths = [seen["path"] for seen in upstream.seen]
    assert paths == [
        "/proxy/rollout/ro-1/attempt/0/mode/train/openai/v1/chat/completions",
        "/api/rollouts/ro-1/attempt/0/events",
    ]
    for seen in upstream.seen:
        assert seen["headers"]["Authorization"] == f"Bearer {KEY}" and "X-Api-Key" not in seen["headers"]
        assert grant.token not in json.dumps(seen["headers"])


def test_everything_else_is_refused_before_the_gateway_and_counted(relay: AttemptRelay, upstream: Upstream) -> None:
    mine, other = relay.grant(_rollout("ro-1"), "0"), relay.grant(_rollout("ro-2"), "0")
    auth = {"Authorization": f"Bearer {mine.token}"}
    routes_before, tokens_before = _refused("route"), _refused("token")
    for method, path in [
        ("GET", "/api/rollouts"),
        ("GET", "/api/rollouts/ro-1"),
        ("PATCH", "/api/rollouts/ro-2"),
        ("DELETE", "/api/rollouts/ro-2"),
        ("POST", "/api/rollouts"),
        ("POST", "/api/rollouts/ro-2/attempt/0/events"),
        ("POST", "/api/rollouts/ro-1/attempt/1/events"),
        ("GET", "/api/rollouts/ro-1/attempt/0/events"),
        ("POST", "/proxy/pause"),
        ("POST", "/proxy/resume"),
        ("POST", "/api/models"),
        ("DELETE", "/api/models"),
        ("POST", "/proxy/rollout/ro-2/attempt/0/mode/train/openai/v1/chat/completions"),
        ("POST", "/proxy/rollout/ro-1/attempt/0/mode/val/openai/v1/chat/completions"),
        ("POST", "/proxy/rollout/ro-1/attempt/0/mode/train/openai/v1/embeddings"),
        ("POST", "/proxy/rollout/ro-1/attempt/0/mode/train/openai/v1/../../../../../../../api/rollouts"),
    ]:
        request = httpx.Request(method, relay.url + path, headers=auth, json={})
        request.url = request.url.copy_with(raw_path=path.encode())
        with httpx.Client() as client:
            answer = client.send(request)
        assert answer.status_code == 403, (method, path)
        assert KEY not in answer.text and mine.token not in answer.text
    assert _refused("route") - routes_before == 16
    for headers in ({}, {"Authorization": "Bearer made-up"}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(mine.env["AGL_EVENT_URL"], json={}, headers=headers).status_code == 403
    assert _refused("token") - tokens_before == 3
    other.revoke()
    late = httpx.post(other.env["AGL_EVENT_URL"], json={}, headers={"Authorization": f"Bearer {other.token}"})
    assert late.status_code == 403 and relay.live == 1
    assert upstream.seen == []


def test_the_gateways_answers_come_back_as_given_streamed_and_paused(relay: AttemptRelay, upstream: Upstream) -> None:
    rollout = V1Rollout.model_validate({"rollout_id": "slow", "input": {}, "config": {"local": {"agent_class": "a:B"}}})
    grant = relay.grant(rollout, "0")
    auth = {"Authorization": f"Bearer {grant.token}"}
    url = grant.env["AGL_OPENAI_BASE_URL"] + "/completions"
    with httpx.stream("POST", url, json={}, headers=auth) as answer:
        started = time.monotonic()
        chunks = [(chunk, time.monotonic() - started) for chunk in answer.iter_bytes() if chunk]
    assert b"".join(c for c, _ in chunks) == b"first second"
    assert chunks[0][0] == b"first " and chunks[-1][1] - chunks[0][1] >= 0.3  # the first part came before the last
    paused = relay.grant(V1Rollout.model_validate({**rollout.model_dump(), "rollout_id": "paused"}), "0")
    answer = httpx.post(
        paused.env["AGL_OPENAI_BASE_URL"] + "/chat/completions",
        json={},
        headers={"Authorization": f"Bearer {paused.token}"},
    )
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "7" and answer.json() == {"detail": "paused"}


def test_a_body_past_the_bound_and_connections_past_the_bound_never_reach_the_gateway(
    relay: AttemptRelay, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    grant = relay.grant(_rollout("ro-1"), "0")
    auth = {"Authorization": f"Bearer {grant.token}"}
    monkeypatch.setattr(relay_module, "MAX_BODY_BYTES", 1000)
    assert httpx.post(grant.env["AGL_EVENT_URL"], content=b"x" * 1001, headers=auth).status_code == 413
    assert upstream.seen == []
    monkeypatch.setattr(relay_module, "MAX_CONNECTIONS", 2)
    small = AttemptRelay(f"http://127.0.0.1:{upstream.server_address[1]}", KEY)
    try:
        crowded = small.grant(_rollout("ro-2"), "0")
        crowded_auth = {"Authorization": f"Bearer {crowded.token}"}
        host, port = small.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]  # every slot held
        try:
            before = _refused("connections")
            assert httpx.post(crowded.env["AGL_EVENT_URL"], json={}, headers=crowded_auth).status_code == 503
            assert _refused("connections") - before == 1 and upstream.seen == []
        finally:
            for connection in idle:
                connection.close()
        deadline = time.monotonic() + 10  # the idle connections' handler threads give their slots back
        while (status := httpx.post(crowded.env["AGL_EVENT_URL"], json={}, headers=crowded_auth).status_code) == 503:
            assert time.monotonic() < deadline, "the closed connections' slots were never given back"
            time.sleep(0.05)
        assert status == 200
    finally:
        small.close()
    assert httpx.post(grant.env["AGL_EVENT_URL"], json={}, headers=auth).status_code == 200
