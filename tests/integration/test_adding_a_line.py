"""A line is small: a toy third line (jobs in a list, the task ``toy.run``) on the real ``LineDispatcher``, this test's
Redis its broker, a Celery worker process on its queue. The leader lock, the slot share, publishing, the in-flight
accounting and the reconcile are the dispatcher's (docs/architecture.md, "Adding a line")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis
from prometheus_client import Counter, Gauge

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.settings import Settings, load_settings
from bridge.core.task import base_app
from bridge.dispatch.backlog import Backlog, BacklogReader
from bridge.dispatch.dispatcher import LineDispatcher, Repair
from bridge.dispatch.leader import STANDBY_RETRY_S
from bridge.dispatch.publisher import Publisher, Task
from tests.helpers import TEST_REDIS_URL, wait_for

SLOTS = 2
WORKER = """
import os, time
from bridge.core.coordination import capacity
from bridge.core.coordination import coordination_client
from bridge.core.task import base_app
from bridge.core.settings import load_settings
url, scope, queue = os.environ["TOY_BROKER"], os.environ["TOY_SCOPE"], os.environ["TOY_QUEUE"]
app = base_app(load_settings(broker_url=url, redis_key_scope=scope, default_queue=queue), "toy")
client = coordination_client(url)

@app.task(name="toy.run")
def run(job):  # the worker's half: run, report, free the slot
    client.rpush(f"toy-peaks:{scope}", client.incr(f"toy-running:{scope}"))
    time.sleep(0.2)
    client.decr(f"toy-running:{scope}")
    client.sadd(f"toy-done:{scope}", job)
    capacity.clear_inflight(client, scope, queue, f"toy-{job}")
    capacity.notify_freed(client, scope, queue)

app.worker_main(["worker", "-Q", queue, "-P", "threads", "-c", "4", "-l", "WARNING", "--without-mingle"])
"""


@dataclass(frozen=True)
class Resend:
    key: str  # a job claimed and never published (its dispatcher died in between): publish it


@dataclass(frozen=True)
class ToyPlan:
    repairs: tuple[Resend, ...]
    suspects: dict[str, float]
    rescan_by: float | None = None

    @property
    def made(self) -> int:
        return len(self.repairs)


class ToyLine(LineDispatcher[str]):
    """Jobs wait in ``waiting``; a claimed job stays in ``claimed`` until its task adds it to ``done`` in Redis."""

    line = "toy"
    loop_name = "toy dispatch"
    error_wait_s = 0.5
    stopped_message = "toy line stopped"
    logger = logging.getLogger("toy")
    upstream_counter = (Counter("toy_errors", "toy source errors", ["kind"], registry=None), "listing")
    waiting_gauges = (Gauge("toy_wait", "", ["queue"], registry=None), Gauge("toy_old", "", ["queue"], registry=None))

    def __init__(self, settings: Settings, client: redis.Redis, publisher: Publisher, jobs: list[str]) -> None:
        self.waiting, self.claimed, self.done = list(jobs), set[str](), f"toy-done:{settings.redis_key_scope}"
        super().__init__(
            settings, client, publisher, None, queues=[settings.default_queue], lock_owner="toy", who="toy"
        )

    def _backlog_reader(self, leading: Callable[[], bool]) -> BacklogReader:
        def read(_timeout: float) -> Backlog:
            return Backlog({self.settings.default_queue: len(self.waiting)})

        return BacklogReader(read, self.settings, leading, source="toy", failures=(), errors=lambda: None)

    def _announce(self) -> None:
        self.logger.info("toy line on %s", self.queues)

    def _round(self, view: capacity.SlotView) -> float:
        rooms = view.rooms()
        self._share(view, rooms, len(self.waiting))
        for _ in range(min(rooms.get(self.settings.default_queue, 0), len(self.waiting))):
            job = self.waiting.pop(0)
            self.claimed.add(job)
            self._send(job)
        return 0.05

    def _task(self, claim: str) -> Task:
        return Task("toy.run", f"toy-{claim}", self.settings.default_queue, {"job": claim}, 30.0, 60.0, f"job={claim}")

    def _refused(self, claim: str, error: Exception) -> None:
        self.claimed.discard(claim)
        self.waiting.insert(0, claim)  # given back to the source: the next round claims it again

    _unsendable = _refused

    def _plan(self) -> ToyPlan:
        inflight = capacity.inflight_ids(self.redis, self.scope, self.settings.default_queue)  # before ``done``
        done = self.redis.smembers(self.done)
        lost = sorted(job for job in self.claimed - done if f"toy-{job}" not in inflight)
        return ToyPlan(tuple(Resend(job) for job in lost), {})

    def _carry_out(self, repair: Repair) -> None:
        self._send(repair.key)


def test_a_toy_line_runs_on_the_one_dispatcher_with_a_real_broker_and_worker() -> None:
    scope = f"toy-{uuid.uuid4().hex[:8]}"
    queue = f"{scope}-jobs"
    settings = load_settings(broker_url=TEST_REDIS_URL, redis_key_scope=scope, default_queue=queue)
    client = coordination_client(TEST_REDIS_URL, socket_timeout=5)
    env = {**os.environ, "TOY_BROKER": TEST_REDIS_URL, "TOY_SCOPE": scope, "TOY_QUEUE": queue}
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env=env)
    jobs = [f"j{n}" for n in range(6)]
    leader = ToyLine(settings, client, Publisher(settings, app=base_app(settings, "toy")), jobs)
    leader.claimed.add("lost")  # claimed by a dispatcher that died before it published it: the reconcile does
    standby = ToyLine(settings, client, Publisher(settings, app=base_app(settings, "toy")), [])
    capacity.advertise(client, leader.scope, "toy-worker", [queue], SLOTS)
    loop = threading.Thread(target=leader.run, name="toy-line")
    loop.start()
    try:
        wait_for(lambda: client.smembers(f"toy-done:{scope}") == {*jobs, "lost"}, 60, "every toy job done")
        assert standby.tick() == STANDBY_RETRY_S  # the leader lock is the leader's
        assert client.get(keys.slot_demand(scope, queue, "toy")) is not None  # the share published its demand
        assert max(map(int, client.lrange(f"toy-peaks:{scope}", 0, -1))) <= SLOTS  # never more than advertised
    finally:
        leader.stop.set()  # type: ignore[attr-defined]
        loop.join(10)
        worker.terminate()
        worker.wait(30)
        standby.publisher.close()
    assert not client.exists(leader.leader_lock.key)  # released on shutdown
    assert capacity.inflight_ids(client, scope, queue) == set()
    client.delete(f"toy-done:{scope}", f"toy-peaks:{scope}", f"toy-running:{scope}")
