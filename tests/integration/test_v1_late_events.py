"""What Agent Lightning 1.0's gateway (a real ``agl-server``, ``bridge_lab.agl_v1_env``) does with what reaches it
for an attempt after that attempt ended: the facts behind "No dead end" in docs/agl-v1.md, "Guarantees".

On 0.3 a span batch that lands after a ``failed`` report turns a requeued rollout ``running`` again with no live
attempt, and the 0.3 reconcile settles it (``bridge.dispatch.v03.repairs``, "dead end"). The 1.0 gateway has no
such path, and the 1.0 dispatcher no such rule, because of what these tests record: a rollout's state changes
only by a ``PATCH`` and never leaves ``succeeded`` or ``failed``; a late event or proxied LLM call is stored under
its attempt and changes no status field; there is no span ingestion at all. A gateway version that changes any
of this fails here. The reports are made as our workers and dispatcher make them (``GatewayClient``), the late
traffic as an agent program sends it (``AGL_EVENT_URL``, ``AGL_OPENAI_BASE_URL``), against an in-process model
endpoint. No broker or worker is involved.

The gateway also takes a ``last_attempt_id`` write without a ``state`` on a finished rollout, refuses ``state:
running`` on a running one, and has no conditional update (recorded here too), so no single write names a re-run's
attempt on a running rollout only, and a re-run the dispatcher planned from a listing could move a rollout
finished since onto an attempt with no events. So the dispatcher's reconcile runs here too (with this test's Redis
database and a broker that records) against a rollout the trainer or a report finishes right after the listing,
or right after the re-run's own read: it keeps its attempt and events and nothing is published.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.gateway import GatewayClient, GatewayConflict, Malformed, V1Rollout, V1State, scoped_attempt_key
from bridge.core.settings import load_settings
from bridge.dispatch.v1.dispatcher import V1Dispatcher
from bridge.dispatch.v1.repairs import Republish, V1Facts, current_key, plan_v1_repairs
from bridge_lab.agl_v1_env import v1_virtualenv
from bridge_lab.procs import StackError, free_port, serving
from tests.helpers import TEST_REDIS_URL
from tests.loopback import LoopbackServer
from tests.prerequisites import missing

pytestmark = [pytest.mark.integration, pytest.mark.cost(5)]

KEY = "agl-v1-late-key"
MODEL = "late-model"
CONFIRM_S = 25.0


def _model(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """An OpenAI-compatible model endpoint (``LoopbackServer``) that answers every chat completion at once, with
    token ids."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    reply = {
        "id": "late",
        "object": "chat.completion",
        "model": MODEL,
        "prompt_token_ids": [1, 2],
        "choices": [{**choice, "token_ids": [3]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    return 200, {"content-type": "application/json"}, json.dumps(reply).encode()


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
    model = LoopbackServer(_model)
    log_dir: Path = tmp_path_factory.mktemp("agl-v1-late")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(venv / "bin/agl-server"), "host=127.0.0.1", f"port={port}", f"key={KEY}"]
    argv += [f"default_proxy.model_name={MODEL}", f"hydra.run.dir={log_dir / 'hydra'}"]
    try:
        with serving("agl-v1-gateway", argv, f"{url}/healthz", timeout_s=30, log_dir=log_dir):
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            endpoint = [{"model": MODEL, "endpoint": f"{model.url}/v1"}]
            http.post("/api/models", json=endpoint).raise_for_status()
            client = GatewayClient(url, key=KEY, retries=0)
            try:
                yield Gateway(url, client, http)
            finally:
                client.close()
                http.close()
    finally:
        model.close()


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
    assert gateway.client.supersede(rid, "0", "1")  # the dispatcher's re-run after a lost worker
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
        monotonic=CONFIRM_S,
        max_queue_wait_s=300.0,
        confirm_s=CONFIRM_S,
        max_reruns=1,
    )
    assert plan_v1_repairs(facts).repairs == (Republish(rollout, "1", f"v1-{rid}-1"),)

    assert gateway.client.finish(rid, "1", V1State.SUCCEEDED, "")
    assert gateway.detail(rid)["rollout"]["status"]["state"] == V1State.SUCCEEDED


def test_no_write_names_a_new_attempt_on_a_running_rollout_only(gateway: Gateway) -> None:
    """Why the re-run cannot refuse a finished rollout in one write (``GatewayClient.supersede``): the gateway
    guards ``state`` only, ``running`` is no transition from ``running``, and no write is conditional."""
    running = gateway.started().rollout_id
    before = gateway.detail(running)["rollout"]["status"]
    rerun = {"status": {"state": "running", "last_attempt_id": "1"}}
    assert gateway.http.patch(f"/api/rollouts/{running}", json=rerun).status_code == 409  # a running one too
    assert gateway.detail(running)["rollout"]["status"] == before  # version and updated_at included
    stale = {"status": {"last_attempt_id": "1", "version": before["version"] - 1}}
    assert gateway.http.patch(f"/api/rollouts/{running}", json=stale).status_code == 422  # no such field
    match = gateway.http.patch(
        f"/api/rollouts/{running}", json={"status": {"last_attempt_id": "1"}}, headers={"If-Match": '"0"'}
    )
    assert match.status_code == 200 and "etag" not in match.headers  # the condition is ignored
    assert gateway.detail(running)["rollout"]["status"]["last_attempt_id"] == "1"

    finished = gateway.started().rollout_id
    assert gateway.client.finish(finished, "0", V1State.FAILED, "")
    before = gateway.detail(finished)["rollout"]["status"]
    assert gateway.http.patch(f"/api/rollouts/{finished}", json=rerun).status_code == 409
    assert gateway.detail(finished)["rollout"]["status"] == before
    moved = gateway.http.patch(f"/api/rollouts/{finished}", json={"status": {"last_attempt_id": "1"}})
    assert moved.status_code == 200  # taken, and its answer shows the state the write found
    assert (moved.json()["status"]["state"], moved.json()["status"]["last_attempt_id"]) == ("failed", "1")


class _Meanwhile(GatewayClient):
    """The dispatcher's gateway client, with ``then`` run once right after its next listing (``list``) or read of
    one rollout (``read``): a trainer or a worker writing between the dispatcher's calls."""

    def __init__(self, url: str, *, key: str) -> None:
        super().__init__(url, key=key, retries=0)
        self.then: dict[str, Callable[[], None]] = {}

    def list_checked(self, *states: V1State, limit: int = 500) -> tuple[list[V1Rollout], list[Malformed]]:
        answer = super().list_checked(*states, limit=limit)
        self._then("list")
        return answer

    def get_rollout(self, rollout_id: str) -> V1Rollout | None:
        answer = super().get_rollout(rollout_id)
        self._then("read")
        return answer

    def _then(self, kind: str) -> None:
        hook = self.then.pop(kind, None)
        if hook is not None:
            hook()


class _Broker:
    """The dispatcher's Celery app: ``send_task`` records the task ids."""

    def __init__(self) -> None:
        self.task_ids: list[str] = []

    def send_task(self, name: str, **options: Any) -> None:
        self.task_ids.append(options["task_id"])

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("window", "final"), [("list", V1State.FAILED), ("read", V1State.FAILED), ("read", V1State.SUCCEEDED)]
)
def test_a_rollout_finished_after_the_listing_keeps_its_attempt_and_its_re_run_publishes_nothing(
    gateway: Gateway, window: str, final: V1State
) -> None:
    """Its worker lost (started, no lease), the rollout is finished (the trainer fails it, or the worker's report
    lands) right after the dispatcher's listing or right after the re-run's read of it."""
    client = coordination_client(TEST_REDIS_URL, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        missing(f"Redis at the test database: {exc}")
    settings = load_settings(
        agl_v1_url=gateway.url, broker_url=TEST_REDIS_URL, redis_key_scope=f"v1r-{uuid.uuid4().hex[:8]}"
    )
    watched = _Meanwhile(gateway.url, key=KEY)
    dispatcher = V1Dispatcher(settings, watched, client, threading.Event())
    dispatcher.publisher.close()
    broker = _Broker()
    dispatcher.publisher.app = broker
    dispatcher.confirm_s = 0.0  # one scan confirms a lost worker: the two-scan rule is the planner's
    rollout = gateway.started()
    rid = rollout.rollout_id
    lost = scoped_attempt_key(dispatcher.scope, rollout, "0")
    reward = gateway.http.post(
        f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 1.0}}
    )
    assert reward.status_code == 200  # what the episode earned before its worker went silent
    client.set(keys.started(lost), "x")
    capacity.mark_inflight(client, dispatcher.scope, settings.default_queue, f"v1-{rid}-0")

    finished_at: list[int] = []  # the status version the finish left

    def finish() -> None:
        if final == V1State.FAILED:  # the trainer gives up on it
            gateway.http.patch(f"/api/rollouts/{rid}", json={"status": {"state": "failed"}}).raise_for_status()
        else:  # the worker's report lands after all
            assert gateway.client.finish(rid, "0", final, "")
        finished_at.append(gateway.detail(rid)["rollout"]["status"]["version"])

    watched.then[window] = finish
    try:
        dispatcher.reconcile()
        status = gateway.detail(rid)["rollout"]["status"]
        assert (status["state"], status["last_attempt_id"]) == (final, "0")
        # Seen by the re-run's read: nothing written. Seen only in the write's answer: attempt 1 was named, and
        # attempt 0 written back at once (the window that remains, docs/agl-v1.md).
        assert status["version"] - finished_at[0] == (0 if window == "list" else 2)
        assert [e["event_type"] for e in gateway.client.events(rid)] == ["reward"]  # the trainer keeps the reward
        assert not [task for task in broker.task_ids if rid in task]
        assert f"v1-{rid}-0" not in capacity.inflight_entries(client, dispatcher.scope, settings.default_queue)
    finally:
        client.delete(keys.started(lost), keys.inflight(dispatcher.scope, settings.default_queue))
        watched.close()
        client.close()


def test_a_report_read_before_a_re_run_named_the_next_attempt_finishes_the_rollout_on_the_reported_one(
    gateway: Gateway,
) -> None:
    """The other side of the same window: a worker's report whose read came just before the re-run's write. Its
    write carries its attempt id with the final state, so the rollout ends on the reported attempt, whose events the
    trainer reads; the re-run's worker then finds the rollout finished and runs nothing."""
    rid = gateway.started().rollout_id
    reporter = _Meanwhile(gateway.url, key=KEY)

    def rerun() -> None:
        assert gateway.client.supersede(rid, "0", "1") is not None

    reporter.then["read"] = rerun
    try:
        assert reporter.finish(rid, "0", V1State.SUCCEEDED, "")
    finally:
        reporter.close()
    status = gateway.detail(rid)["rollout"]["status"]
    assert (status["state"], status["last_attempt_id"]) == (V1State.SUCCEEDED, "0")
