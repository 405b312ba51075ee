"""The 1.0 line's collaborators: the gateway's controller API in-process (behind the real ``GatewayClient``), the
Celery app the 1.0 dispatcher publishes through, and a ``V1Dispatcher`` built on both and this test's Redis."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import redis

from bridge.core.coordination import capacity
from bridge.core.gateway import GatewayClient
from bridge.core.settings import Settings, load_settings
from bridge.dispatch.v1.dispatcher import V1Dispatcher
from tests.helpers import TEST_REDIS_URL

QUEUE = "rollouts"
ALLOWED = {("queuing", "running"), ("queuing", "failed"), ("running", "succeeded"), ("running", "failed")}


class FakeGateway:
    """The gateway's controller API on a dict of raw rollouts: listing by state (in insertion order), reading one,
    and PATCHing status fields as ``agl-server`` 1.0 does: a ``state`` that is no transition (the same state too)
    answers 409 and changes nothing; the other fields are written whatever the state, a finished one's too.

    ``meanwhile[kind]`` (``list``, ``read``): run once, right after the next answer of that kind, as a trainer or
    worker writing between the dispatcher's calls."""

    def __init__(self) -> None:
        self.rollouts: dict[str, dict[str, Any]] = {}
        self.meanwhile: dict[str, Callable[[], None]] = {}
        self.writes: list[tuple[str, dict[str, Any]]] = []  # the PATCHes it took: rollout id, status fields

    def add(self, rollout_id: str, *, state: str = "queuing", attempt: str | None = None, **config: Any) -> None:
        self.rollouts[rollout_id] = {
            "rollout_id": rollout_id,
            "input": {"q": rollout_id},
            "config": {"timeout_seconds": 60, "local": {"agent_class": "pkg:Agent"}, **config},
            "status": {"state": state, "last_attempt_id": attempt},
        }

    def status(self, rollout_id: str) -> dict[str, Any]:
        return dict(self.rollouts[rollout_id]["status"])

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path == "/api/rollouts":
            states = request.url.params.get_list("state_in")
            limit = int(request.url.params["limit"])
            found = [r for r in self.rollouts.values() if r["status"]["state"] in states]
            return self._then("list", httpx.Response(200, json=found[:limit]))
        rid = path.rsplit("/", 1)[-1]
        if rid not in self.rollouts:
            return httpx.Response(404, json={"detail": "not found"})
        rollout = self.rollouts[rid]
        if request.method == "GET":
            return self._then("read", httpx.Response(200, json={"rollout": rollout}))
        fields = json.loads(request.content)["status"]
        now = rollout["status"]["state"]
        if "state" in fields and (now, fields["state"]) not in ALLOWED:
            return httpx.Response(409, json={"detail": f"cannot transition {now} -> {fields['state']}"})
        rollout["status"].update(fields)
        self.writes.append((rid, fields))
        return httpx.Response(200, json=rollout)

    def _then(self, kind: str, answer: httpx.Response) -> httpx.Response:
        hook = self.meanwhile.pop(kind, None)
        if hook is not None:
            hook()
        return answer


class FakeApp:
    """What the dispatcher uses of its Celery app: ``send_task``, which records or raises ``refuse``."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.refuse: dict[str, BaseException] = {}  # rollout id -> what publishing it raises

    def send_task(self, name: str, **options: Any) -> None:
        error = self.refuse.get(options["kwargs"]["rollout"]["rollout_id"])
        if error is not None:
            raise error
        self.sent.append({"name": name, **options})

    def close(self) -> None:
        pass

    def task_ids(self) -> list[str]:
        return [task["task_id"] for task in self.sent]


def v1_dispatcher(
    gateway: FakeGateway, client: redis.Redis, slots: int = 4, **overrides: Any
) -> tuple[V1Dispatcher, FakeApp]:
    """A ``V1Dispatcher`` on ``gateway`` and ``client`` with a Redis key scope of its own, publishing to a ``FakeApp``,
    ``slots`` advertised on ``QUEUE``; ``overrides``: settings fields."""
    fields: dict[str, Any] = {
        "agl_v1_url": "http://gateway.test",
        "broker_url": TEST_REDIS_URL,
        "redis_key_scope": f"v1t-{uuid.uuid4().hex[:8]}",
    }
    settings: Settings = load_settings(**{**fields, **overrides})
    http = httpx.Client(base_url=settings.agl_v1_url, transport=httpx.MockTransport(gateway.handle))
    client_ = GatewayClient(settings.agl_v1_url, key=None, retries=0, http=http)
    dispatcher = V1Dispatcher(settings, client_, client, threading.Event())
    dispatcher.publisher.close()
    app = FakeApp()
    dispatcher.publisher.app = app
    dispatcher.confirm_s = 0.0  # one scan confirms: the two-scan rule is the planner's, tested there
    capacity.advertise(client, dispatcher.scope, "worker-1", [QUEUE], slots)
    return dispatcher, app
