"""CeleryRunner against the real parts: an Agent Lightning Trainer, real ``celery -A workers worker`` processes
running a LitAgent of ours (``AGENT=...``), the session's ``agl store`` and Redis, the LLM stand-in.

No ``python -m bridge`` runs here: the runner's own ``iter`` is the dispatch loop, and ``step`` needs none.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agentlightning as agl
import pytest
import redis
from agentlightning.execution.events import ThreadingEvent

from bridge.core.coordination import coordination_client, keys
from bridge.runner import AgentMismatchError, CeleryRunner, RolloutFailedError
from bridge_lab.procs import free_port
from bridge_lab.stack import LocalStack, StackConfig
from tests.fakes.runner_agents import AGENT_PATH, OtherAgent, ScoredAgent
from tests.helpers import attempts, cancel_unfinished, stack_for

pytestmark = [pytest.mark.integration, pytest.mark.cost(22)]

ROOT = str(Path(__file__).resolve().parents[2])
REWARDS = [0.0, 0.25, 0.5, 0.75, 1.0, 0.125]


@pytest.fixture(scope="module")
def cluster(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One worker node (2 slots) running ScoredAgent, on a clean Store queue and broker database."""
    cancel_unfinished(services.store_url)
    redis.Redis.from_url(services.broker_url).flushdb()
    stack = stack_for(
        services,
        tmp_path_factory.mktemp("runner"),
        workers=1,
        concurrency=2,
        bridge=False,
        extra_env={"AGENT": AGENT_PATH, "PYTHONPATH": ROOT},  # tests.* importable by the workers
    )
    stack.start()
    yield stack
    stack.stop()
    cancel_unfinished(services.store_url)


def llm(services: LocalStack) -> agl.LLM:
    return agl.LLM(endpoint=services.llm_base_url, model="stand-in")


class EnqueueAndRead(agl.Algorithm):
    """Enqueues the dataset, waits for every rollout and reads it back through the Trainer's adapter
    (``TracerTraceToTriplet``), as a training algorithm would."""

    def __init__(self) -> None:
        super().__init__()
        self.results: dict[str, tuple[str, Any, list[agl.Triplet]]] = {}

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        store = self.get_store()
        initial = self.get_initial_resources()
        assert initial is not None
        resources = await store.add_resources(initial)
        ids = []
        for task in train_dataset or []:
            queued = await store.enqueue_rollout(input=task, mode="train", resources_id=resources.resources_id)
            ids.append(queued.rollout_id)
        finished: list[agl.Rollout] = []
        for _ in range(240):  # the Store's client refuses a blocking wait: poll
            finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=0)
            if len(finished) == len(ids):
                break
            await asyncio.sleep(0.5)
        for item in finished:
            spans = await store.query_spans(item.rollout_id, attempt_id="latest")
            self.results[item.rollout_id] = (item.status, item.input, self.get_adapter().adapt(spans))


@pytest.mark.parametrize("n_runners", [1, 2])
@pytest.mark.usefixtures("fork_like_a_trainer")
def test_a_trainer_gets_every_rollout_back_succeeded_with_the_reward_the_agent_returned(
    cluster: LocalStack, n_runners: int
) -> None:
    """With two runner processes both run the dispatch loop; the leader lock lets one publish, so each
    rollout still has exactly one attempt."""
    tasks = [{"id": i, "question": f"What is {i} + {i}?", "reward": r} for i, r in enumerate(REWARDS)]
    algorithm = EnqueueAndRead()
    trainer = agl.Trainer(
        runner=CeleryRunner(broker_url=cluster.broker_url),
        n_runners=n_runners,
        store=agl.LightningStoreClient(cluster.store_url),
        strategy=agl.ClientServerExecutionStrategy(n_runners=n_runners, managed_store=False),
        algorithm=algorithm,
        initial_resources={"main_llm": llm(cluster)},
        tracer=agl.OtelTracer(),
    )
    trainer.fit(ScoredAgent(), train_dataset=tasks)

    assert len(algorithm.results) == len(tasks)
    for rollout_id, (status, task, triplets) in algorithm.results.items():
        assert status == "succeeded", task
        assert len(attempts(cluster.store_url, rollout_id)) == 1
        assert triplets, f"no triplet for {task}: the adapter found no LLM call span"
        assert triplets[-1].reward == task["reward"]
        for triplet in triplets:
            assert triplet.prompt.get("token_ids") and triplet.response.get("token_ids"), triplet


def test_step_from_a_plain_script_returns_the_completed_rollout(cluster: LocalStack) -> None:
    runner = CeleryRunner(broker_url=cluster.broker_url)
    store = agl.LightningStoreClient(cluster.store_url)
    with runner.run_context(agent=ScoredAgent(), store=store):
        rollout = asyncio.run(
            runner.step({"id": "s", "question": "What is 2 + 3?", "reward": 0.5}, resources={"main_llm": llm(cluster)})
        )
    assert isinstance(rollout, agl.Rollout)
    assert rollout.status == "succeeded" and rollout.input["reward"] == 0.5
    assert rollout.resources_id is not None  # the resources given were published first and used
    spans = asyncio.run(store_spans(cluster.store_url, rollout.rollout_id))
    assert agl.find_final_reward(spans) == 0.5


async def store_spans(store_url: str, rollout_id: str) -> list[agl.Span]:
    client = agl.LightningStoreClient(store_url)
    try:
        return list(await client.query_spans(rollout_id, attempt_id="latest"))
    finally:
        await client.close()


def test_a_failing_step_raises_with_the_workers_error_and_failure_class(cluster: LocalStack) -> None:
    runner = CeleryRunner(broker_url=cluster.broker_url)
    with (
        runner.run_context(agent=ScoredAgent(), store=agl.LightningStoreClient(cluster.store_url)),
        pytest.raises(RolloutFailedError) as caught,
    ):
        asyncio.run(runner.step({"id": "f", "fail": True}, resources={"main_llm": llm(cluster)}))
    error = caught.value
    assert error.status == "failed" and error.failure_class == "agent"
    assert error.error is not None and "asked to fail" in error.error
    (attempt,) = attempts(cluster.store_url, error.rollout_id)
    assert attempt["status"] == "failed" and attempt["metadata"]["failure_class"] == "agent"


def test_a_step_the_store_retries_raises_at_once_when_no_dispatch_loop_runs(cluster: LocalStack) -> None:
    """The Store requeues the failed first attempt; with no loop to dequeue it, step says so instead of
    waiting out the rollout's budget (minutes) for a retry nobody will start."""
    coordination_client(cluster.broker_url).delete(keys.bridge_leader(cluster.scope))
    runner = CeleryRunner(broker_url=cluster.broker_url)
    started = time.monotonic()
    with (
        runner.run_context(agent=ScoredAgent(), store=agl.LightningStoreClient(cluster.store_url)),
        pytest.raises(RolloutFailedError) as caught,
    ):
        asyncio.run(
            runner.step(
                {"id": "r1", "question": "What is 1 + 2?", "fail_first": True, "reward": 0.5},
                resources={"main_llm": llm(cluster)},
            )
        )
    assert time.monotonic() - started < 30
    error = caught.value
    assert error.status == "requeuing" and error.failure_class == "agent"
    assert error.error is not None and "fail its first attempt" in error.error
    assert "no dispatch loop" in str(error)
    (attempt,) = attempts(cluster.store_url, error.rollout_id)
    assert attempt["status"] == "failed"
    cancel_unfinished(cluster.store_url)  # what a later bridge would otherwise retry


def test_a_step_the_store_retries_returns_the_retry_while_the_runner_dispatches(cluster: LocalStack) -> None:
    """The same step beside the runner's own dispatch loop (``iter``): the loop dequeues the requeued rollout,
    a worker runs the second attempt, and step returns the rollout that succeeded."""
    runner = CeleryRunner(broker_url=cluster.broker_url)

    async def step_beside_the_loop() -> agl.Rollout:
        stop = ThreadingEvent()
        loop = asyncio.create_task(runner.iter(event=stop))
        try:
            task = {"id": "r2", "question": "What is 1 + 1?", "fail_first": True, "reward": 0.75}
            return await runner.step(task, resources={"main_llm": llm(cluster)})
        finally:
            stop.set()
            await asyncio.wait_for(loop, timeout=30)

    with runner.run_context(agent=ScoredAgent(), store=agl.LightningStoreClient(cluster.store_url)):
        rollout = asyncio.run(step_beside_the_loop())
    assert rollout.status == "succeeded"
    statuses = [
        a["status"] for a in sorted(attempts(cluster.store_url, rollout.rollout_id), key=lambda a: a["sequence_id"])
    ]
    assert statuses == ["failed", "succeeded"]
    spans = asyncio.run(store_spans(cluster.store_url, rollout.rollout_id))
    assert agl.find_final_reward(spans) == 0.75


def test_init_with_an_agent_the_workers_do_not_run_names_them(cluster: LocalStack) -> None:
    with pytest.raises(AgentMismatchError) as caught:
        CeleryRunner(broker_url=cluster.broker_url).init(OtherAgent())
    node = f"worker1@{socket.gethostname()}"
    assert caught.value.mismatched == {node: AGENT_PATH}
    assert node in str(caught.value) and "AGENT=tests.fakes.runner_agents:OtherAgent" in str(caught.value)
    CeleryRunner(broker_url=cluster.broker_url).init(ScoredAgent())  # the agent they run passes


@pytest.mark.nightly("localhost and 127.0.0.1 as one key scope: tests/unit/test_scope_spelling.py, every run")
@pytest.mark.usefixtures("fork_like_a_trainer")
def test_a_trainer_serving_its_own_store_at_localhost_reaches_workers_that_spell_it_127_0_0_1(
    cluster: LocalStack, tmp_path: Path
) -> None:
    """``role="both"`` with the Trainer's own Store: its runners are given ``http://localhost:P``, the workers
    were started with ``http://127.0.0.1:P`` (as every example here spells it); one canonical URL, one key scope,
    so the rollouts run and their rewards come back. A queue of its own: the module's workers serve another
    Store on the same broker."""
    port, queue = free_port(), "both-rollouts"
    workers = LocalStack(
        StackConfig(
            store=False,
            broker_url=cluster.broker_url,
            webshop_url=cluster.webshop_url,
            llm_base_url=cluster.llm_base_url,
            workers=1,
            concurrency=2,
            bridge=False,
            worker_name="both",
            queues=queue,
            log_dir=tmp_path,
            extra_env={"AGENT": AGENT_PATH, "PYTHONPATH": ROOT},
        )
    )
    workers.store_url = f"http://127.0.0.1:{port}"
    workers.start()
    try:
        tasks = [{"id": i, "question": f"What is {i} + 1?", "reward": r} for i, r in enumerate(REWARDS[:3])]
        algorithm = EnqueueAndRead()
        trainer = agl.Trainer(
            runner=CeleryRunner(broker_url=cluster.broker_url, default_queue=queue),
            n_runners=1,
            strategy=agl.ClientServerExecutionStrategy(role="both", server_port=port, n_runners=1),
            algorithm=algorithm,
            initial_resources={"main_llm": llm(cluster)},
            tracer=agl.OtelTracer(),
        )
        trainer.fit(ScoredAgent(), train_dataset=tasks)
    finally:
        workers.stop()
    assert sorted(status for status, _, _ in algorithm.results.values()) == ["succeeded"] * len(tasks)
    for _, task, triplets in algorithm.results.values():
        assert triplets and triplets[-1].reward == task["reward"]
