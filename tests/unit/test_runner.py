"""CeleryRunner without processes: what a Trainer does to it before any rollout runs.

A Trainer constructs the runner in its main process and forks (or, under ``spawn``, pickles) it into each
runner process, which then calls ``init`` and ``init_worker``; so the runner must survive both with no
live client, find the Store the Trainer hands it, and refuse an agent the online workers do not run. The
worker advertisements are written into a real Redis the way workers write them.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# No network here: LiteLLM (imported by agentlightning) would try to fetch its model cost map three times.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import agentlightning as agl
import redis

from bridge.core.coordination import capacity, coordination_redis, keys
from bridge.core.infra import ConfigError
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.dispatch.v03.dispatcher import V03Dispatcher
from bridge.runner import DEFAULT_STORE_URL, CeleryRunner, _loop_alive, store_url_of
from bridge.runner_support import direct
from bridge.runner_support.direct import RolloutFailedError
from bridge.runner_support.fleet import AgentMismatchError, agent_path
from bridge.runner_support.stop import EitherEvent
from tests.helpers import TEST_REDIS_URL, drop_adverts
from tests.unit.test_architecture import IMPORTS, within


class EchoAgent(agl.LitAgent[Any]):
    """A LitAgent defined in an importable module (this one)."""

    def rollout(self, task: Any, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        return 1.0


EXPECTED = "tests.unit.test_runner:EchoAgent"
SCOPE = keys.store_scope("http://127.0.0.1:9")  # the Redis key scope of runner_for's Store
OTHER = keys.store_scope("http://127.0.0.1:10")  # another deployment's, on the same Redis


@pytest.fixture
def queue(redis_client: redis.Redis) -> Iterator[str]:
    """A queue of this test's own, so its advertisements meet nobody else's; removed afterwards."""
    name = f"runner-test-{uuid.uuid4().hex[:8]}"
    yield name
    for scope in (SCOPE, OTHER):
        for node in drop_adverts(redis_client, scope, name):
            redis_client.delete(keys.worker_agent(scope, node))


def advertise(client: redis.Redis, queue: str, node: str, agent: str | None, scope: str = SCOPE) -> None:
    """What a worker node of deployment ``scope`` writes: its slots on its queues and, beside them, its agent."""
    capacity.advertise(client, scope, node, [queue], 4)
    if agent is not None:
        client.set(keys.worker_agent(scope, node), agent, ex=capacity.CAPACITY_TTL_S)


def runner_for(queue: str) -> CeleryRunner:
    return CeleryRunner(broker_url=TEST_REDIS_URL, default_queue=queue, store_url="http://127.0.0.1:9")


def test_the_agent_path_is_the_class_import_path() -> None:
    assert agent_path(EchoAgent()) == EXPECTED


def test_init_refuses_an_agent_the_online_workers_do_not_run_and_names_them(
    redis_client: redis.Redis, queue: str
) -> None:
    advertise(redis_client, queue, "w1@host", EXPECTED)
    advertise(redis_client, queue, "w2@host", "webshop")
    advertise(redis_client, queue, "w3@host", "other.mod:Agent")
    advertise(redis_client, queue, "w4@host", "webshop", scope=OTHER)  # another Store's worker: not looked at
    with pytest.raises(AgentMismatchError) as caught:
        runner_for(queue).init(EchoAgent())
    assert caught.value.mismatched == {"w2@host": "webshop", "w3@host": "other.mod:Agent"}
    message = str(caught.value)
    assert "w2@host runs 'webshop'" in message and "w3@host runs 'other.mod:Agent'" in message
    assert f"AGENT={EXPECTED}" in message and "w1@host" not in message


def test_init_accepts_workers_running_the_agent_and_an_empty_cluster(redis_client: redis.Redis, queue: str) -> None:
    runner_for(queue).init(EchoAgent())  # nobody online yet: a warning, not an error
    advertise(redis_client, queue, "w1@host", EXPECTED)
    advertise(redis_client, queue, "w2@host", None)  # slots advertised, agent not yet
    runner_for(queue).init(EchoAgent())


def test_an_agent_defined_in_main_gets_a_hint() -> None:
    error = AgentMismatchError("__main__:Mine", {"w1@h": "pkg.mod:Mine"})
    assert "__main__" in str(error) and "move it into a module" in str(error)


def test_the_store_url_comes_from_the_store_object_the_trainer_gives() -> None:
    assert store_url_of(agl.LightningStoreClient("http://store-host:4747/")) == "http://store-host:4747"
    assert store_url_of(agl.InMemoryLightningStore()) is None
    runner = CeleryRunner(broker_url=TEST_REDIS_URL)
    runner.init_worker(0, agl.LightningStoreClient("http://store-host:4747"))
    settings, _ = runner.settings, None
    assert settings is not None and settings.store_base == "http://store-host:4747"
    assert runner.worker_id == 0


def test_a_store_the_workers_cannot_reach_is_refused_without_a_configured_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENT_LIGHTNING_STORE_URL", raising=False)
    monkeypatch.chdir("/")  # no .env file either
    with pytest.raises(TypeError, match="reach over HTTP"):
        CeleryRunner().init_worker(0, agl.InMemoryLightningStore())
    monkeypatch.setenv("AGENT_LIGHTNING_STORE_URL", "http://configured:4747")
    runner = CeleryRunner()
    runner.init_worker(0, agl.InMemoryLightningStore())
    assert runner.settings is not None and runner.settings.store_base == "http://configured:4747"


def test_a_bad_setting_in_a_trainer_is_an_ordinary_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a missing Store URL falls back to Agent Lightning's default; any other problem is raised."""
    monkeypatch.delenv("AGENT_LIGHTNING_STORE_URL", raising=False)
    monkeypatch.chdir("/")  # no .env file either
    runner = CeleryRunner()
    runner.init_worker(0, None)
    assert runner.settings is not None and runner.settings.store_base == DEFAULT_STORE_URL.rstrip("/")
    with pytest.raises(ConfigError) as info:
        CeleryRunner(max_batch=0).init_worker(0, None)
    assert info.value.setting == "BRIDGE_MAX_BATCH" and not isinstance(info.value, SystemExit)


def test_construction_opens_nothing_and_the_runner_pickles_before_and_after_use() -> None:
    threads = threading.active_count()
    runner = CeleryRunner(broker_url=TEST_REDIS_URL)
    assert threading.active_count() == threads
    pickle.loads(pickle.dumps(runner))
    runner.init_worker(1, agl.LightningStoreClient("http://store-host:4747"))
    runner.init(EchoAgent())  # the fleet check of that Store's deployment: no worker online
    runner._direct()  # live clients, as after a step: sockets and locks, which no pickle carries
    copy = pickle.loads(pickle.dumps(runner))
    assert copy.settings is not None and copy.settings.store_base == "http://store-host:4747"
    assert copy.agent == EXPECTED
    copy.teardown_worker(1)  # the copy has a lock of its own and no clients to close
    runner.teardown_worker(1)
    assert runner.worker_id is None
    pickle.loads(pickle.dumps(runner))


def _child(runner: CeleryRunner, out: Any) -> None:
    runner.init_worker(3, agl.LightningStoreClient("http://store-host:4747"))
    assert runner.settings is not None
    out.put(runner.settings.store_base)


@pytest.mark.usefixtures("fork_like_a_trainer")
def test_the_runner_survives_the_trainers_fork() -> None:
    """Forked as the Trainer forks its runner processes (spawn pickles it: tested above, without the
    ten-second re-import of Agent Lightning a spawned child costs)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    process = ctx.Process(target=_child, args=(CeleryRunner(broker_url=TEST_REDIS_URL), out))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert out.get(timeout=5) == "http://store-host:4747"


def test_work_before_init_says_what_is_missing() -> None:
    runner = CeleryRunner(broker_url=TEST_REDIS_URL, default_queue=f"runner-test-{uuid.uuid4().hex[:8]}")
    with pytest.raises(RuntimeError, match=r"init\(agent\)"):
        asyncio.run(runner.step({"q": 1}))
    runner.init(EchoAgent())  # no worker consumes its queue: nothing to check
    with pytest.raises(RuntimeError, match="init_worker"):
        asyncio.run(runner.iter())


def test_a_failed_rollout_error_carries_the_workers_error_and_class() -> None:
    error = RolloutFailedError("ro-1", "at-1", "failed", "ValueError: bad sum", "agent")
    assert (error.error, error.failure_class, error.status) == ("ValueError: bad sum", "agent", "failed")
    assert "failure_class=agent" in str(error) and "ValueError: bad sum" in str(error)


def test_a_requeued_step_waits_only_while_a_dispatch_loop_holds_the_lock(redis_client: redis.Redis) -> None:
    """What ``step`` asks when the Store puts its rollout back in the queue; an unreachable Redis counts as a
    running loop (keep waiting, bounded), never as a reason to fail the step."""
    redis_client.delete(keys.bridge_leader(SCOPE))
    try:
        redis_client.set(keys.bridge_leader(OTHER), "bridge-other:1", px=5_000)  # another Store's loop
        assert not _loop_alive(redis_client, SCOPE)
        redis_client.set(keys.bridge_leader(SCOPE), "bridge-test:1", px=5_000)
        assert _loop_alive(redis_client, SCOPE)
    finally:
        redis_client.delete(keys.bridge_leader(SCOPE), keys.bridge_leader(OTHER))
    assert _loop_alive(redis.Redis(port=1, socket_connect_timeout=0.5), SCOPE)
    error = RolloutFailedError("ro-1", "at-1", "requeuing", "ValueError: bad sum", "agent")
    assert "no dispatch loop runs to retry it" in str(error) and "ValueError: bad sum" in str(error)


def test_the_stop_signal_follows_the_trainers_multiprocessing_event_and_a_cancellation() -> None:
    outside = agl.MultiprocessingEvent() if hasattr(agl, "MultiprocessingEvent") else multiprocessing.Event()
    stop = EitherEvent(outside)
    assert stop.wait(0.3) is False and not stop.is_set()
    threading.Timer(0.2, outside.set).start()
    started = time.monotonic()
    assert stop.wait(10) is True
    assert time.monotonic() - started < 2
    own = EitherEvent(multiprocessing.Event())
    threading.Timer(0.2, own.set).start()
    assert own.wait(10) is True and own.is_set()
    assert not own.outside.is_set()  # type: ignore[union-attr]  # the Trainer's event is left alone


@pytest.mark.parametrize("package", ["bridge.runner", "bridge.runner_support"])
def test_the_runner_imports_neither_the_worker_stack_nor_the_tools(package: str) -> None:
    banned = ("workers", "bridge_lab", "bridge.ops", "bridge.cli")
    violations = [
        f"{name} imports {imp.target}"
        for name, imports in IMPORTS.items()
        if within(name, package)
        for imp in imports
        if any(within(imp.target, b) for b in banned)
    ]
    assert not violations
    assert any(within(name, package) for name in IMPORTS)


def test_the_readmes_example_agent_is_the_one_in_examples() -> None:
    """The README shows examples/calc_agent.py's class verbatim, so the runnable file and the docs agree."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    shown = readme.split("```python\nclass CalcAgent", 1)[1].split("```", 1)[0]
    example = (root / "examples" / "calc_agent.py").read_text(encoding="utf-8")
    assert "class CalcAgent" + shown in example
    assert "AGENT=examples.calc_agent:CalcAgent celery -A workers worker" in readme
    assert (
        "runner=CeleryRunner()" in readme
        and "runner=CeleryRunner()" in (root / "examples" / "train_calc.py").read_text()
    )


def test_iter_returns_once_the_event_is_set_and_a_cancelled_iter_leaves_no_thread(queue: str) -> None:
    """The dispatch loop (no worker online on this queue, so it only waits for slots) stops on the Trainer's
    event within a second, and a cancelled ``iter`` stops its thread too instead of leaking it."""
    # No Store answers here: without retries its first reconciliation gives up at once (a real, unreachable
    # Store makes the loop finish its retries first, as ``python -m bridge`` does).
    runner = CeleryRunner(broker_url=TEST_REDIS_URL, default_queue=queue, store_retries=0)
    runner.init(EchoAgent())
    runner.init_worker(0, agl.LightningStoreClient("http://127.0.0.1:9"))
    event = agl.MultiprocessingEvent()

    async def stop_after(delay: float) -> float:
        asyncio.get_running_loop().call_later(delay, event.set)
        started = time.monotonic()
        await runner.iter(event=event)
        return time.monotonic() - started

    assert asyncio.run(stop_after(1.0)) < 3.0

    threads = threading.active_count()

    async def cancel_after(delay: float) -> None:
        task = asyncio.create_task(runner.iter(event=agl.MultiprocessingEvent()))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(cancel_after(1.0))  # asyncio.run joins the loop's worker threads: it returns once ours ended
    assert time.monotonic() - started < 5.0
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]


def _direct_dispatcher(queue: str, **overrides: Any) -> V03Dispatcher:
    settings = load_settings(
        broker_url=TEST_REDIS_URL, default_queue=queue, store_url="http://127.0.0.1:9", **overrides
    )
    client = coordination_redis(settings)
    return V03Dispatcher(settings, StoreClient.from_settings(settings), client, publisher=None)  # type: ignore[arg-type]


def test_step_creates_its_rollout_only_once_a_live_worker_has_a_free_slot(
    redis_client: redis.Redis, queue: str
) -> None:
    """A step on a full queue waits before creating anything, so its message never outwaits its expiry."""
    dispatcher = _direct_dispatcher(queue)
    capacity.advertise(redis_client, SCOPE, "w1@host", [queue], 1)
    capacity.mark_inflight(redis_client, SCOPE, queue, "at-busy")
    waiter = threading.Thread(target=direct.wait_for_room, args=(dispatcher, None))
    try:
        waiter.start()
        waiter.join(1.5)
        assert waiter.is_alive(), "a step on a full queue went ahead"
        capacity.clear_inflight(redis_client, SCOPE, queue, "at-busy")
        waiter.join(3.0)
        assert not waiter.is_alive(), "a step did not go ahead once the slot freed"
    finally:
        capacity.clear_inflight(redis_client, SCOPE, queue, "at-busy")
        waiter.join(5.0)


def test_step_on_a_queue_no_worker_consumes_fails_naming_the_queue(queue: str) -> None:
    dispatcher = _direct_dispatcher(queue, max_queue_wait_s=1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"no live worker consumed queue '{queue}'"):
        direct.wait_for_room(dispatcher, None)
    assert 1.0 <= time.monotonic() - started < 5.0
