"""A stand-in for Agent Lightning 1.0's gateway (``agl-server``), serving only what a worker's 1.0 attempt calls:
``GET`` and ``PATCH /api/rollouts/{rid}``, ``POST`` of events and the proxy's pause state (``GET /proxy/state``). It
records every PATCH, can answer reads slowly (``slow_reads_s``), can change a rollout right after a read has taken it
(``after_read``, once: what another writer does in between, or the gateway forgetting it), can report its proxy
paused (``paused``), and enforces the gateway's state order (a change out of a final state, or ``running`` on a
running rollout, answers 409)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FINAL = ("succeeded", "failed")


class StubGateway:
    def __init__(self) -> None:
        self.rollouts: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.slow_reads_s = 0.0
        self.paused: str | None = None  # the pause's reason while the proxy is paused
        self.after_read: Callable[[dict[str, Any]], None] | None = None
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(
        self,
        rollout_id: str,
        agent_class: str,
        *,
        created_at: float,
        timeout_s: int = 60,
        task_input: dict[str, Any] | None = None,
        env_map: dict[str, str] | None = None,
        queuing: bool = False,
    ) -> dict[str, Any]:
        """A rollout as the dispatcher leaves it (``running``, attempt ``0``; ``queuing``: before its patch), returned
        as the gateway serves it. A program gets its variables only through ``env_map`` (paths into
        ``task_input``), never the worker's."""
        status = {"state": "queuing" if queuing else "running", "last_attempt_id": None if queuing else "0"}
        rollout = {
            "rollout_id": rollout_id,
            "input": task_input or {},
            "is_train": True,
            "config": {"timeout_seconds": timeout_s, "local": {"agent_class": agent_class, "env_map": env_map or {}}},
            "status": {**status, "created_at": created_at, "updated_at": created_at},
        }
        with self.lock:
            self.rollouts[rollout_id] = rollout
        return json.loads(json.dumps(rollout))

    def final_patches(self, rollout_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [p for rid, p in self.patches if rid == rollout_id and p.get("state") in FINAL]

    def handler(self) -> type[BaseHTTPRequestHandler]:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")

            def do_GET(self) -> None:
                if self.path == "/proxy/state":
                    paused = gateway.paused
                    return self._answer(200, {"paused": paused is not None, "reason": paused, "inflight": 0})
                match = re.fullmatch(r"/api/rollouts/([^/?]+)", self.path)
                if gateway.slow_reads_s:
                    time.sleep(gateway.slow_reads_s)
                with gateway.lock:
                    rid = match.group(1) if match else ""
                    rollout = gateway.rollouts.get(rid)
                    body = json.loads(json.dumps(rollout)) if rollout else None
                    change, gateway.after_read = gateway.after_read, None
                    if change is not None and rollout is not None:
                        change(rollout)
                if body is None:
                    self._answer(404, {"detail": "not found"})
                else:
                    self._answer(200, {"rollout": body})

            def do_PATCH(self) -> None:
                rid = self.path.rsplit("/", 1)[-1]
                status = self._body()["status"]
                with gateway.lock:
                    rollout = gateway.rollouts.get(rid)
                    if rollout is None:
                        return self._answer(404, {"detail": "not found"})
                    if rollout["status"]["state"] in FINAL and status.get("state") not in (None,):
                        return self._answer(409, {"detail": "final"})
                    if rollout["status"]["state"] == status.get("state") == "running":
                        return self._answer(409, {"detail": "cannot transition running -> running"})
                    gateway.patches.append((rid, status))
                    rollout["status"].update(status)
                    body = json.loads(json.dumps(rollout))
                self._answer(200, body)

            def do_POST(self) -> None:
                with gateway.lock:
                    gateway.events.append((self.path, self._body()))
                self._answer(200, {})

        return Handler

    @contextmanager
    def serving(self) -> Iterator[StubGateway]:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self._server.daemon_threads = True
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
