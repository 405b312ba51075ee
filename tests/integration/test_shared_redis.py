"""Two deployments on one Redis database: two real ``agl store`` processes, and a bridge and a worker node for
each, dispatching at the same time (docs/operations.md, "Several deployments on one Redis").

Every Redis key that holds one deployment's state carries its Store's scope (``bridge.core.coordination.keys``), so both
bridges lead at once, each counts only its own worker's slots, and every rollout runs on a worker of its own
deployment. The broker is that same Redis database, so each deployment has Celery queue names of its own
(``CELERY_DEFAULT_QUEUE`` on the bridge, ``-Q`` on the worker), or one deployment's workers would take the
other's messages.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import attempts, enqueue, split_tasks, wait_finished, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cost(60)]

ROLLOUTS = 6  # per deployment: three waves on its worker's two slots
SLOTS = 2
WAIT_S = 180.0


def deployment(services: LocalStack, log_dir: Path, name: str, store_url: str | None) -> LocalStack:
    """One deployment on the session's Redis, WebShop server and LLM stand-in: its own queue, worker node and
    bridge, on ``store_url`` (None: it starts an ``agl store`` of its own)."""
    queue = f"rollouts-{name}"
    return LocalStack(
        StackConfig(
            store_url=store_url,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            workers=1,
            concurrency=SLOTS,
            pool="threads",  # tasks run in the worker's own process: its pid names the executor
            queues=queue,
            worker_name=f"worker-{name}-",
            log_dir=log_dir / name,
            extra_env={"CELERY_DEFAULT_QUEUE": queue},
        )
    )


@dataclass
class Sample:
    leaders: tuple[bool, bool]  # each deployment's leader lock is held
    in_flight: tuple[int, int]


@dataclass
class Sampler:
    """Every 50 ms while the rollouts run: both leader locks and both in-flight counts, read from Redis."""

    client: redis.Redis
    one: LocalStack
    two: LocalStack
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            leaders = self.client.mget([keys.bridge_leader(self.one.scope), keys.bridge_leader(self.two.scope)])
            counts = (
                capacity.inflight_count(self.client, self.one.scope, queue_of(self.one)),
                capacity.inflight_count(self.client, self.two.scope, queue_of(self.two)),
            )
            self.samples.append(Sample((leaders[0] is not None, leaders[1] is not None), counts))

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="shared-redis-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def queue_of(stack: LocalStack) -> str:
    assert stack.config.queues is not None
    return stack.config.queues


def node_of(stack: LocalStack) -> str:
    return f"{stack.config.worker_name}1@{socket.gethostname()}"


def executor_pid(worker_id: Any) -> int:
    """The process of an executor id ``host:pid:thread`` (``workers.protocol.lease.executor_id``)."""
    assert isinstance(worker_id, str), worker_id
    return int(worker_id.split(":")[1])


def freed(client: redis.Redis, stack: LocalStack) -> Callable[[], bool]:
    return lambda: capacity.inflight_count(client, stack.scope, queue_of(stack)) == 0


def test_two_deployments_on_one_redis_both_lead_and_each_runs_only_its_own_rollouts(
    clean_store: LocalStack, tmp_path: Path
) -> None:
    one = deployment(clean_store, tmp_path, "one", clean_store.store_url)
    two = deployment(clean_store, tmp_path, "two", None)
    client = coordination_client(clean_store.broker_url)
    tasks = split_tasks(ROLLOUTS)
    # Starting the second bridge waits until it holds its own leader lock: with one lock for all it never would.
    with one, two:
        assert one.store_url != two.store_url and one.scope != two.scope
        assert one.broker_url == two.broker_url and one.redis_url == two.redis_url  # one Redis database
        for stack, other in ((one, two), (two, one)):
            assert f"(Redis key scope {stack.scope})" in (stack.log_dir / "bridge.log").read_text()
            # Each bridge counts its own worker's slots only, on its own queue and on the other one.
            assert capacity.read_slots(client, stack.scope, [queue_of(stack)]).nodes == {
                node_of(stack): (SLOTS, frozenset({queue_of(stack)}))
            }
            assert capacity.read_slots(client, stack.scope, [queue_of(other)]).nodes == {}
            assert capacity.advertised_agents(client, stack.scope, [queue_of(stack)]) == {node_of(stack): "webshop"}
        with Sampler(client, one, two) as sampler:
            ids = {one.store_url: enqueue(one.store_url, tasks), two.store_url: enqueue(two.store_url, tasks)}
            finished = {url: wait_finished(url, rollout_ids, WAIT_S) for url, rollout_ids in ids.items()}
        pids = {one.store_url: {one.workers[0].pid}, two.store_url: {two.workers[0].pid}}
        intervals: dict[str, list[tuple[float, float]]] = {}
        for stack, other in ((one, two), (two, one)):
            url = stack.store_url
            assert {r["status"] for r in finished[url].values()} == {"succeeded"}, finished[url]
            for rid in ids[url]:
                for attempt in attempts(url, rid):  # every attempt ran on this deployment's worker
                    assert executor_pid(attempt["worker_id"]) in pids[url], (attempt, pids)
                    assert executor_pid(attempt["worker_id"]) not in pids[other.store_url]
            metas = [r["attempt"]["metadata"] for r in finished[url].values()]
            intervals[url] = [(m["started_at"], m["started_at"] + m["duration_s"]) for m in metas]
            # Every slot was freed in this deployment's in-flight set, by its own worker.
            wait_for(freed(client, stack), 30, f"every slot of {queue_of(stack)} freed")
        assert sampler.samples and all(s.leaders == (True, True) for s in sampler.samples)  # both led throughout
        assert any(all(s.in_flight) for s in sampler.samples), "the two deployments never ran at the same time"
        assert any(a0 < b1 and b0 < a1 for a0, a1 in intervals[one.store_url] for b0, b1 in intervals[two.store_url]), (
            intervals
        )
