"""Flower tells the truth under every pool the README recommends (prefork and threads).

Flower knows a task only from the workers' Celery events. A receiver on the broker, started before the
worker, feeds Celery's own event ``State`` (what Flower's task list is built from) while real workers run
real rollouts; afterwards every attempt the Store finished must be ``SUCCESS`` there, with its
``task-received``, ``task-started`` and ``task-succeeded`` events. The task id is the attempt id.

Under ``-P threads`` Celery 5.6 erased events that task threads sent while a batch was being published
(``bridge/core/patches/celery_task_events.py``): before that fix this run saw 40-60 % of ``task-started``
events lost and tasks left ``RECEIVED`` or ``STARTED`` for good, while prefork saw every event.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from bridge_lab.stack import LocalStack
from tests.helpers import enqueue, split_tasks, stack_for, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(31)]

ROLLOUTS = 56
BAD_INPUTS = 4  # fail at once as `input`: a Store `failed` is still a task that ended (Celery SUCCESS)
TASK_EVENTS = ("task-received", "task-started", "task-succeeded")


class EventTap:
    """Celery's event stream as Flower consumes it: an ``EventReceiver`` feeding ``celery.events.State``."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery("events-tap", broker=broker_url)
        self.state = self.app.events.State()
        self.seen: defaultdict[str, list[str]] = defaultdict(list)  # task id -> event types, in arrival order
        self.hostnames: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.state.event(event)
            if "uuid" in event:
                self.seen[str(event["uuid"])].append(str(event["type"]))
            elif str(event.get("type", "")).startswith("worker-"):
                self.hostnames.add(str(event.get("hostname")))

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            self._receiver = receiver
            receiver.should_stop = self._stop.is_set()
            receiver.capture(limit=None, timeout=None, wakeup=False)

    def heard_from(self, hostname: str, timeout_s: float) -> bool:
        """A worker event (online or heartbeat, every 2 s) from ``hostname``: the subscription is live."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if hostname in self.hostnames:
                    return True
            time.sleep(0.1)
        return False

    def states(self, task_ids: list[str]) -> dict[str, str]:
        with self._lock:
            return {tid: (self.state.tasks[tid].state if tid in self.state.tasks else "UNSEEN") for tid in task_ids}

    def events_of(self, task_id: str) -> list[str]:
        with self._lock:
            return list(self.seen.get(task_id, []))

    def settle(self, task_ids: list[str], timeout_s: float) -> dict[str, str]:
        """Wait (bounded) until every task is SUCCESS through events; a lost event never arrives."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.states(task_ids)
            if all(state == "SUCCESS" for state in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.2)

    @contextmanager
    def running(self) -> Iterator[EventTap]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            if self._receiver is not None:
                self._receiver.should_stop = True
            self._thread.join(timeout=10)  # the receiver checks once a second


@pytest.mark.parametrize(
    ("pool", "concurrency"),
    [
        ("prefork", 8),
        pytest.param("threads", 16, marks=pytest.mark.nightly("the same events under prefork, every time")),
    ],
)
def test_every_task_event_reaches_the_monitor_under_each_recommended_pool(
    clean_store: LocalStack, tmp_path: Path, pool: str, concurrency: int
) -> None:
    tap = EventTap(clean_store.broker_url)
    stack = stack_for(clean_store, tmp_path, workers=1, pool=pool, concurrency=concurrency)
    with tap.running(), stack:
        hostname = next(iter(_worker_hostnames(stack)))
        assert tap.heard_from(hostname, timeout_s=15), f"no worker event from {hostname}: the tap is not subscribed"
        inputs: list[Any] = list(split_tasks(ROLLOUTS)) + [{"not_an_instruction": i} for i in range(BAD_INPUTS)]
        started = time.monotonic()
        ids = enqueue(clean_store.store_url, inputs)
        final = wait_finished(clean_store.store_url, ids, timeout_s=90)
        elapsed = time.monotonic() - started
        statuses = {rid: r["status"] for rid, r in final.items()}
        assert sorted(statuses.values()) == ["failed"] * BAD_INPUTS + ["succeeded"] * ROLLOUTS, statuses
        task_ids = [str(final[rid]["attempt"]["attempt_id"]) for rid in ids]
        states = tap.settle(task_ids, timeout_s=10)

    wrong = {tid: (state, tap.events_of(tid)) for tid, state in states.items() if state != "SUCCESS"}
    missing = {tid: [e for e in TASK_EVENTS if e not in tap.events_of(tid)] for tid in task_ids}
    missing = {tid: lost for tid, lost in missing.items() if lost}
    print(
        f"{pool} -c {concurrency}: {len(ids)} rollouts in {elapsed:.1f}s; {len(wrong)} not SUCCESS, "
        f"{len(missing)} missing an event"
    )
    assert not wrong, f"{len(wrong)} of {len(ids)} finished tasks are not SUCCESS through events under {pool}: {wrong}"
    assert not missing, f"{len(missing)} of {len(ids)} tasks lack task events under {pool}: {missing}"


def _worker_hostnames(stack: LocalStack) -> list[str]:
    """``workerN@host`` of the stack's workers, as their events name them (``LocalStack.add_worker``)."""
    return [f"{process.name}@{socket.gethostname()}" for process in stack.workers]
