"""RabbitMQ as the broker: the pipeline, backpressure, message expiry and redelivery behave as with Redis.

Real processes throughout: the session's ``agl store``, WebShop server and LLM stand-in, its Redis (the
tests' database) for coordination, ``celery -A workers worker`` nodes and ``python -m bridge`` on the RabbitMQ
at 127.0.0.1:5672, isolated in a vhost of this module's own (deleted at the end: no other queue is touched).
The broker restart runs against a private ``rabbitmq-server`` node on a free port, never the shared server.
Where no RabbitMQ answers, everything is skipped with the reason (and fails on CI: ``tests/prerequisites.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bridge.core.coordination import capacity, coordination_client
from bridge.core.settings import load_settings
from bridge.core.store import StoreClient
from bridge.core.task import TASK_NAME, base_app, task_kwargs
from bridge.dispatch.broker import AmqpQueues
from bridge_lab.chaos import run as chaos
from bridge_lab.rabbitmq import PrivateRabbitMQ, server_version
from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished, enqueue, purchases, rollout, split_tasks, wait_finished
from tests.prerequisites import require
from tests.rabbit import amqp_services, over, private_vhost

pytestmark = [pytest.mark.integration, pytest.mark.cost(115)]

QUEUE = "rollouts"
# Few slots for the rollouts, so a run outlasts its faults' schedule (placed by progress) without 100 rollouts:
# kill-workers replaces three killed nodes (seconds each) while the rest must still be running.
CHAOS_ROLLOUTS = {"kill-workers": 60, "redeliver": 40, "restart-redis": 40}
CHAOS_WORKERS, CHAOS_SLOTS = 2, 2


@pytest.fixture(scope="module")
def rabbit(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """RabbitMQ (a vhost of this module's own) as broker beside the session's services."""
    with private_vhost("agl-test") as (url, _vhost):
        stack = amqp_services(services, url, tmp_path_factory.mktemp("rabbit"))
        print(f"RabbitMQ {server_version(url)}")
        yield stack
        stack.stop()
        cancel_unfinished(services.store_url)


@pytest.fixture
def clean(rabbit: LocalStack) -> LocalStack:
    chaos.reset_between_scenarios(rabbit)  # no unfinished rollout, coordination flushed, our queue emptied
    return rabbit


class Sampler:
    """Every 50 ms: in-flight attempts and advertised slots (coordination Redis), ready messages (RabbitMQ)."""

    def __init__(self, stack: LocalStack) -> None:
        self.redis = coordination_client(stack.redis_url)
        self.scope = stack.scope
        self.probe = AmqpQueues(stack.broker_url)
        self.samples: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            inflight = capacity.inflight_count(self.redis, self.scope, QUEUE)
            slots = capacity.total_slots(self.redis, self.scope, QUEUE)
            self.samples.append((inflight, slots, self.probe.depth(QUEUE)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.probe.close()
        self.redis.close()


@pytest.mark.nightly(
    "RabbitMQ's restart (its batch audited against the WebShop ledger) and expiry run every time; slots held: "
    "test_backpressure.py"
)
def test_rollouts_succeed_with_their_rewards_within_the_slots(clean: LocalStack, tmp_path: Path) -> None:
    """16 rollouts on 2 nodes x 2 slots (100 ms LLM calls): each succeeds with the reward the WebShop server
    computed, the bridge never has more attempts in flight than slots, and the queue is durable."""
    stack = over(clean, tmp_path, workers=2, concurrency=2, llm_base_url=None, policy_latency_ms=100.0)
    with stack, Sampler(stack) as sampler:
        ids = enqueue(stack.store_url, split_tasks(16))
        final = wait_finished(stack.store_url, ids, timeout_s=120)
        status = _status(stack)
    assert [final[rid]["status"] for rid in ids] == ["succeeded"] * 16
    for view in final.values():
        meta = view["attempt"]["metadata"]
        ledger = purchases(stack.webshop_url, meta["env_session_id"])
        assert meta["reward"] == (ledger[0]["reward"] if meta["done"] else 0.0)
    peak, ready = max(s[0] for s in sampler.samples), max(s[2] for s in sampler.samples)
    print(f"{len(sampler.samples)} samples; peak in flight {peak}; peak ready messages {ready}")
    assert 0 < peak <= 4 and all(inflight <= max(slots, 4) for inflight, slots, _ in sampler.samples)
    # `bridge status` reads RabbitMQ's queue (a passive declare) and never shows the password.
    broker = status["broker"]
    assert broker["ok"] and broker["kind"] == "rabbitmq", broker
    assert broker["queues"][QUEUE]["depth"] == 0 and broker["queues"][QUEUE]["oldest_queued_s"] is None
    assert broker["url"].startswith("amqp://guest:***@") and ":guest@" not in json.dumps(status)
    listed = _ctl("list_queues", "-p", _vhost_of(stack), "name", "durable", "arguments")
    assert any(line.split("\t")[:2] == [QUEUE, "true"] for line in listed.splitlines()), listed


def test_an_expired_message_is_handed_back_and_the_next_runs(clean: LocalStack, tmp_path: Path) -> None:
    """A message past its ``expires`` is discarded by the worker and its rollout handed back to the Store."""
    stack = over(clean, tmp_path, workers=1, concurrency=2, bridge=False)
    with stack:
        enqueue(stack.store_url, split_tasks(2))
        with StoreClient(stack.store_url) as store:
            expired, live = store.dequeue(2, "test-rabbitmq")  # this test plays the bridge
        settings = load_settings(store_url=stack.store_url, broker_url=stack.broker_url, redis_url=stack.redis_url)
        app = base_app(settings, "test-rabbitmq")
        past = datetime.now(UTC) - timedelta(seconds=5)
        for item, expires in ((expired, past), (live, None)):
            aid = item.attempt.attempt_id
            app.send_task(TASK_NAME, kwargs=task_kwargs(item, QUEUE), task_id=aid, queue=QUEUE, expires=expires)
        app.close()
        view = wait_finished(stack.store_url, [live.rollout_id], timeout_s=60)[live.rollout_id]
        deadline = time.monotonic() + 30
        while rollout(stack.store_url, expired.rollout_id)["status"] != "requeuing" and time.monotonic() < deadline:
            time.sleep(0.3)
        log = stack.workers[0].log_path.read_text()
    assert view["status"] == "succeeded"
    assert rollout(stack.store_url, expired.rollout_id)["status"] == "requeuing"
    assert f"Discarding revoked task: {TASK_NAME}[{expired.attempt.attempt_id}]" in log


@pytest.mark.chaos
@pytest.mark.nightly("RabbitMQ's restart and expiry run every time, and the same faults over Redis in test_chaos.py")
@pytest.mark.parametrize("scenario", ["kill-workers", "redeliver"])
def test_chaos_over_rabbitmq_loses_nothing(scenario: str, clean: LocalStack, tmp_path: Path) -> None:
    """SIGKILLed pool and main processes (RabbitMQ requeues their unacknowledged messages at once), and
    duplicate messages of running attempts: nothing lost, executed twice, flipped or misrewarded."""
    tasks = split_tasks(CHAOS_ROLLOUTS[scenario])
    scenario_ = chaos.SCENARIOS[scenario]
    result = chaos.run_scenario(
        clean, scenario_, tasks, tmp_path, workers=CHAOS_WORKERS, concurrency=CHAOS_SLOTS, deadline_s=150
    )
    print("\n" + chaos.format_table([result]), result.notes)
    assert (result.lost, result.executed_twice, result.flipped, result.bad_reward) == (0, 0, 0, 0), result
    assert result.succeeded == CHAOS_ROLLOUTS[scenario], result
    assert not any("error" in note for note in result.notes), result.notes
    if scenario == "kill-workers":
        assert sum("killed worker main process" in n for n in result.notes) == 3, result.notes
    else:
        assert any("re-published" in n and not n.startswith("re-published 0 ") for n in result.notes), result.notes


@pytest.mark.cost(95)
@pytest.mark.chaos
@pytest.mark.slow
def test_a_rabbitmq_restart_loses_nothing(services: LocalStack, tmp_path: Path) -> None:
    """A private RabbitMQ node (never the shared one) restarted mid-run: durable queues, persistent messages
    and publisher confirms keep every rollout."""
    require(PrivateRabbitMQ.unavailable())
    cancel_unfinished(services.store_url)
    node = PrivateRabbitMQ(tmp_path / "node").start()
    try:
        base = amqp_services(services, node.url, tmp_path)
        result = chaos.run_scenario(
            base,
            chaos.SCENARIOS["restart-redis"],
            split_tasks(CHAOS_ROLLOUTS["restart-redis"]),
            tmp_path,
            workers=CHAOS_WORKERS,
            concurrency=CHAOS_SLOTS,
            borrowed={"rabbitmq": node.process},
        )
    finally:
        node.stop()
        cancel_unfinished(services.store_url)
    print("\n" + chaos.format_table([result]), result.notes)
    assert "restarted RabbitMQ" in result.notes
    assert (result.lost, result.executed_twice, result.flipped, result.bad_reward) == (0, 0, 0, 0), result


def _status(stack: LocalStack) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bridge", "status", "--json", "--no-inspect"]
    out = subprocess.run(argv, env=stack.component_env(), capture_output=True, text=True, timeout=60)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _vhost_of(stack: LocalStack) -> str:
    from urllib.parse import unquote, urlsplit

    return unquote(urlsplit(stack.broker_url).path[1:])


def _ctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=True).stdout
