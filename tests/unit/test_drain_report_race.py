"""The drain never turns a success into a failure (``AttemptWatch.interrupt``, ``workers.protocol.reporting``), and
never waits on an agent that does not return (``HeldAttempt.hand_over_at_drain``).

Real ``Delivery``, ``AttemptRun``, ``Lease`` and reporter on the Redis at ``TEST_REDIS_URL``, a loopback Store that
records what it is sent, and the real interrupt: SIGUSR1 to this process, whose handler raises
``SoftTimeLimitExceeded`` in the main thread as billiard's does in a prefork child. The interleavings are forced
with events, not timing: the drain decides to interrupt exactly as the episode returns, and the time limit strikes
exactly as the success report is kept.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar, cast

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded

from bridge.core.coordination import capacity, keys
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.core.task import OutcomeStatus
from tests.loopback import LoopbackServer
from workers.agents.webshop_loop import Episode
from workers.execution import Delivery
from workers.lifecycle import drain, state
from workers.lifecycle.drain import DrainClock
from workers.lifecycle.resources import WorkerResources
from workers.protocol.failures import FailureClass
from workers.protocol.heartbeat import AttemptWatch, HeartbeatMonitor
from workers.protocol.reporting import ReportPending
from workers.protocol.write_guard import WriteGuard
from workers.telemetry.courier import TraceCourier

JSON = {"Content-Type": "application/json"}


class Store(LoopbackServer):
    """One running rollout; records every POST (path, body; spans without theirs) and answers it as the Store
    would."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.rollout = {**payload, "status": "running"}
        self.rollout["attempt"] = {**payload["attempt"], "status": "running"}
        self.posts: list[tuple[str, dict[str, Any]]] = []
        super().__init__(lambda method, path: (500, {}, b""))

    def respond(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        rid, aid = self.rollout["rollout_id"], self.rollout["attempt"]["attempt_id"]
        if method == "GET" and path == f"/v1/agl/rollouts/{rid}":
            return 200, JSON, json.dumps(self.rollout).encode()
        if method == "POST" and path == "/v1/traces":  # spans (protobuf): taken, recorded without their body
            self.posts.append((path, {}))
            return 200, {}, b""
        if method == "POST":
            fields = json.loads(body or b"{}")
            self.posts.append((path, fields))
            if path == f"/v1/agl/rollouts/{rid}/attempts/{aid}":
                return 200, JSON, json.dumps({**self.rollout["attempt"], **fields}).encode()
            if path == f"/v1/agl/rollouts/{rid}":
                return 200, JSON, json.dumps({**self.rollout, **fields}).encode()
        return 404, {}, b""

    def attempt_statuses(self) -> list[str]:
        aid = self.rollout["attempt"]["attempt_id"]
        return [f["status"] for p, f in self.posts if p.endswith(f"/attempts/{aid}") and "status" in f]


@dataclass
class Result:
    """A finished run (``workers.protocol.reporting.RunResult``)."""

    blame: ClassVar[FailureClass] = FailureClass.AGENT
    reward: float | None = 0.75
    steps: int = 1

    def metadata(self) -> dict[str, object]:
        return {"reward": self.reward}


def _payload() -> dict[str, Any]:
    rid, aid, now = f"ro-{uuid.uuid4().hex[:8]}", f"at-{uuid.uuid4().hex[:8]}", time.time()
    return {
        "rollout_id": rid,
        "input": {"instruction": "buy a lamp"},  # the built-in agent's task, whose episode a test replaces
        "start_time": now,
        "status": "preparing",
        "config": {"timeout_seconds": 30, "max_attempts": 1},  # no retry left: the drain hands the rollout back
        "attempt": {"rollout_id": rid, "attempt_id": aid, "sequence_id": 1, "start_time": now},
    }


@pytest.fixture
def payload(redis_client: redis.Redis) -> Iterator[dict[str, Any]]:
    data = _payload()
    yield data
    aid = data["attempt"]["attempt_id"]
    left = list(redis_client.scan_iter(f"*{aid}*"))
    if left:  # none when the test's own keys are gone already (DEL with no key is an error)
        redis_client.delete(*left)


@pytest.fixture
def store(payload: dict[str, Any]) -> Iterator[Store]:
    server = Store(payload)
    yield server
    server.close()


class KeepingRedis:
    """The worker's Redis client, where a test acts as a report is kept (``keys.pending_report``): ``on_keep(status,
    keep)`` is called in place of that write, and ``keep()`` makes it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.on_keep: Callable[[str, Callable[[], Any]], Any] | None = None

    def set(self, name: str, value: str, *args: Any, **kwargs: Any) -> Any:
        def keep() -> Any:
            return self.client.set(name, value, *args, **kwargs)

        if self.on_keep is None or not name.startswith(keys.pending_report("")):
            return keep()
        return self.on_keep(json.loads(value)["status"], keep)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.fixture
def kept_reports(redis_client: redis.Redis) -> KeepingRedis:
    return KeepingRedis(redis_client)


@pytest.fixture
def res(store: Store, kept_reports: KeepingRedis, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerResources]:
    # The built-in agent up to its episode, which each test replaces (``_run_body``): an LLM named, no resources.
    settings = load_settings(store_url=store.url, store_retries=0, openai_api_base="http://127.0.0.1:9/v1")
    client = StoreClient(store.url, retries=0, timeout_s=2)
    monkeypatch.setattr(client, "get_resources", lambda resources_id: None)
    worker_redis = cast(redis.Redis, kept_reports)
    monitor = HeartbeatMonitor(client, worker_redis)  # no drain scope: only the test's own drain check runs
    yield WorkerResources(settings, client, worker_redis, None, monitor, TraceCourier(client), 0)  # type: ignore[arg-type]
    monitor.close()
    client.close()


@pytest.fixture
def soft_limit_handler() -> Iterator[None]:
    """SIGUSR1 raises ``SoftTimeLimitExceeded`` in the main thread, as billiard's handler does in a pool child."""

    def raise_soft_limit(signum: int, frame: FrameType | None) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGUSR1, raise_soft_limit)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _run_body(
    monkeypatch: pytest.MonkeyPatch, res: WorkerResources, body: Callable[[Any, AttemptWatch], Result]
) -> None:
    """The built-in agent's episode is ``body``, given the attempt's telemetry and watch (the one ``res``'s monitor
    watches)."""

    def run(episode: Episode) -> Result:
        [watch] = res.monitor.watches()
        return body(episode.telemetry, watch)

    monkeypatch.setattr(Episode, "run", run)


def _main_thread_in(name: str) -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the forced interleaving did not happen"
        time.sleep(0.005)


def test_a_drain_interrupt_decided_as_the_episode_returns_never_strikes_in_its_success_report(
    payload: dict[str, Any],
    store: Store,
    res: WorkerResources,
    soft_limit_handler: None,
    kept_reports: KeepingRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drain's check that no report began and its SIGUSR1 were two steps: the episode returned, the drain found
    no report under way and decided to interrupt, the success report began, and the signal struck in it, which
    then reported ``failed``. Forced here: the drain decides while the spans are flushed, and sends only once the
    attempt's thread is beginning its report (or is keeping it, where it used to be)."""
    monkeypatch.setattr(state.node.pool, "prefork", True)  # the agent runs on the main thread: SIGUSR1 interrupts it
    monkeypatch.setattr(state.node.pool, "threads", False)
    monkeypatch.setattr(state.process, "drain_clock", DrainClock(node="n@h", stop_at=time.time() - 1, grace_s=9.0))
    monkeypatch.setattr(drain, "INTERRUPT_AFTER_S", 0.0)
    decided, keeping = threading.Event(), threading.Event()
    struck_in_report: list[str] = []

    def interrupt_once_reporting() -> None:  # the drain's SIGUSR1, held until the main thread reaches the report
        decided.set()
        _until(lambda: keeping.is_set() or _main_thread_in("begin_reporting"), 5)
        os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(drain, "interrupt_main_thread", interrupt_once_reporting)
    draining = HeartbeatMonitor(res.store, res.redis, None, "scope")
    real_flush = WriteGuard.flush_while_ours

    def flush_then_drain(guard: WriteGuard, telemetry: Any, until: float) -> None:
        real_flush(guard, telemetry, until)
        threading.Thread(target=draining.stop_for_drain, args=(res.monitor.watches(),), daemon=True).start()
        assert decided.wait(5)  # the drain found no report under way and is interrupting

    def keep(status: str, write: Callable[[], Any]) -> Any:
        if status == "succeeded":
            keeping.set()
            try:
                threading.Event().wait(3)  # where the signal landed: the report being kept
            except SoftTimeLimitExceeded:
                struck_in_report.append("the interrupt struck while the success report was kept")
                raise
        return write()

    monkeypatch.setattr(WriteGuard, "flush_while_ours", flush_then_drain)
    kept_reports.on_keep = keep
    _run_body(monkeypatch, res, lambda telemetry, watch: Result())
    aid = payload["attempt"]["attempt_id"]

    outcome = Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()

    assert struck_in_report == []
    assert "failed" not in store.attempt_statuses(), store.posts
    # Interrupted first: no success report began; the rollout went back to the Store's queue (no retry left).
    assert outcome.status is OutcomeStatus.SKIPPED and outcome.failure_class is FailureClass.SHUTDOWN, outcome
    assert (f"/v1/agl/rollouts/{payload['rollout_id']}", {"status": "requeuing"}) in store.posts


def test_a_time_limit_while_the_success_is_kept_leaves_that_success_to_the_next_delivery(
    payload: dict[str, Any],
    store: Store,
    res: WorkerResources,
    redis_client: redis.Redis,
    kept_reports: KeepingRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Celery's soft time limit (or a drain's interrupt) striking as the success report is kept in Redis escaped
    the report path: the kept report was discarded and ``failed`` reported, although the reward spans were stored.
    Now the delivery ends in ``ReportPending`` (a Celery retry) and the retry delivers the kept success."""
    struck: list[str] = []

    def keep_then_time_limit(status: str, write: Callable[[], Any]) -> Any:
        kept = write()
        if not struck:
            struck.append(status)
            raise SoftTimeLimitExceeded()  # the limit strikes as the keep returns
        return kept

    kept_reports.on_keep = keep_then_time_limit
    _run_body(monkeypatch, res, lambda telemetry, watch: Result(0.75))
    aid = payload["attempt"]["attempt_id"]

    with pytest.raises(ReportPending):
        Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()
    assert struck == ["succeeded"]
    assert store.attempt_statuses() == [], store.posts  # nothing reported yet, and never `failed`

    retried = Delivery(payload, celery_task_id=aid, expected_agent=None, res=res).execute()  # the Celery retry
    assert retried.status is OutcomeStatus.SUCCEEDED and retried.reward == 0.75, retried
    assert store.attempt_statuses() == ["succeeded"], store.posts
    reported = next(f for p, f in store.posts if f.get("status") == "succeeded")
    assert reported["metadata"]["reward"] == 0.75


def test_an_agent_that_never_returns_is_handed_over_in_its_place_and_reports_nothing_later(
    payload: dict[str, Any],
    store: Store,
    res: WorkerResources,
    redis_client: redis.Redis,
    soft_limit_handler: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefork agent in a tool loop that swallows the drain's stop and its interrupt never returned, and the hand-over
    was made only on its return: at the worker's forced exit the attempt was still leased and unreported. Now the
    heartbeat hands it over in the agent's place while it still runs (the rollout handed back: no retry left), releases
    the lease and frees the slot; the agent returning with a reward afterwards reports nothing."""
    monkeypatch.setattr(state.node.pool, "prefork", True)
    monkeypatch.setattr(state.node.pool, "threads", False)
    monkeypatch.setattr(state.process, "drain_clock", DrainClock(node="n@h", stop_at=time.time() - 1, grace_s=9.0))
    monkeypatch.setattr(drain, "INTERRUPT_AFTER_S", 0.0)
    monkeypatch.setattr(drain, "HAND_OVER_AFTER_S", 0.2)
    draining = HeartbeatMonitor(res.store, res.redis, None, "scope")
    rid, aid = payload["rollout_id"], payload["attempt"]["attempt_id"]
    requeued = (f"/v1/agl/rollouts/{rid}", {"status": "requeuing"})
    scope, queue = f"t-{uuid.uuid4().hex[:6]}", "rollouts"
    capacity.mark_inflight(redis_client, scope, queue, aid)
    seen: dict[str, object] = {}

    returned = threading.Event()

    def heartbeat(watch: AttemptWatch) -> None:  # the process's heartbeat thread, as far as the drain goes
        while not returned.wait(0.05):
            draining.stop_for_drain([watch])

    def stubborn(telemetry: Any, watch: AttemptWatch) -> Result:
        threading.Thread(target=heartbeat, args=(watch,), daemon=True).start()
        with telemetry.span("agent.partial"):  # what it did so far: never sent once the attempt is handed over
            pass
        deadline = time.monotonic() + 10
        while True:
            # The interrupt is sent once and may land anywhere, the inner handler included: the outer one swallows it
            # there. The loop runs until both the interrupt and the hand-over happened, whichever comes first.
            try:
                try:
                    if (requeued in store.posts and "SoftTimeLimitExceeded" in seen) or time.monotonic() > deadline:
                        break
                    watch.check()  # the agent's LLM calls check this: Superseded once the drain stopped it
                    time.sleep(0.05)  # where the drain's interrupt lands: SoftTimeLimitExceeded
                except BaseException as exc:  # swallowed, as the agent's tool loop does
                    seen.setdefault(type(exc).__name__, exc)
            except BaseException as exc:
                seen.setdefault(type(exc).__name__, exc)
        time.sleep(0.2)  # the hand-over's release of the lease and the slot, after its Store write
        seen["leased"] = bool(redis_client.exists(keys.lease(aid)))
        seen["in flight"] = aid in capacity.inflight_ids(redis_client, scope, queue)
        returned.set()
        return Result(0.75)  # it returns after all, with a reward

    _run_body(monkeypatch, res, stubborn)
    try:
        outcome = Delivery(payload, celery_task_id=aid, expected_agent=None, res=res, slot=(scope, queue)).execute()
    finally:
        redis_client.delete(keys.inflight(scope, queue))

    assert {"Superseded", "SoftTimeLimitExceeded"} <= set(seen), seen  # stopped and interrupted, both swallowed
    assert seen["leased"] is False and seen["in flight"] is False, seen  # released while the agent still ran
    assert store.posts.count(requeued) == 1, store.posts  # handed over once, by the heartbeat
    assert store.attempt_statuses() == [], store.posts  # the late reward is never reported
    assert not any(p == "/v1/traces" for p, _ in store.posts), store.posts
    assert outcome.status is OutcomeStatus.SKIPPED and outcome.failure_class is FailureClass.SHUTDOWN, outcome
    assert redis_client.get(keys.done(aid)) == "requeued"
