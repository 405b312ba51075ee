"""``bridge.core.patches.celery_task_events``: the worker's task events survive task threads appending while a
batch is published.

The integration test (tests/integration/test_events_truth.py) shows the loss with real workers; these
pin the two mechanisms deterministically. The broker side is a stand-in producer that records what was
serialised and, inside ``publish``, appends an event the way a task thread does during the socket write.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu.asynchronous import Hub

from bridge.core.patches import celery_task_events as events


class RecordingProducer:
    """Keeps each published body as serialised at that moment; ``during`` runs inside the write."""

    def __init__(self, during: Any = None, fail_first: int = 0, write_s: float = 0.0) -> None:
        self.bodies: list[list[str]] = []
        self.during = during
        self.fail_first = fail_first
        self.write_s = write_s  # a socket write releases the GIL: other threads append meanwhile

    def publish(self, body: Any, **_: Any) -> None:
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("broker away")
        self.bodies.append([event["uuid"] for event in body] if isinstance(body, list) else [body["uuid"]])
        if self.write_s:
            time.sleep(self.write_s)
        if self.during is not None:
            during, self.during = self.during, None
            during()


def _app() -> Celery:
    app = Celery("events-unit", broker="memory://")
    events.install(app)
    return app


def _dispatcher(app: Celery) -> Any:
    return app.events.Dispatcher(app.connection_for_write(), hostname="w1@test", buffer_group=["task"])


def test_install_swaps_in_the_thread_safe_dispatcher_and_consumer() -> None:
    app = _app()
    assert issubclass(app.events.Dispatcher, events.ThreadSafeEventDispatcher)
    assert app.conf.worker_consumer == "bridge.core.patches.celery_task_events:EventsConsumer"
    with pytest.raises(RuntimeError):
        events.install(app)  # app.events is cached now: too late


def test_an_event_appended_while_a_batch_is_published_is_sent_by_the_next_flush() -> None:
    dispatcher = _dispatcher(_app())
    dispatcher.producer = RecordingProducer(during=lambda: dispatcher.send("task-started", uuid="t2"))
    dispatcher.send("task-received", uuid="t1")
    dispatcher.flush()
    dispatcher.flush()
    assert dispatcher.producer.bodies == [["t1"], ["t2"]]  # Celery 5.6 erased t2 with the first batch
    dispatcher.flush()
    assert dispatcher.producer.bodies == [["t1"], ["t2"]]  # nothing left, and no empty batch sent


def test_a_batch_the_broker_refused_is_sent_once_it_answers() -> None:
    dispatcher = _dispatcher(_app())
    dispatcher.producer = RecordingProducer(fail_first=2)
    dispatcher.send("task-received", uuid="t1")
    dispatcher.flush()  # refused: kept for later
    dispatcher.flush()  # refused again: still kept (Celery 5.6 cleared it here)
    dispatcher.flush()
    assert dispatcher.producer.bodies == [["t1"]]


def test_many_threads_sending_while_the_loop_flushes_lose_nothing() -> None:
    dispatcher = _dispatcher(_app())
    dispatcher.producer = RecordingProducer(write_s=0.0005)
    done = threading.Event()

    def flusher() -> None:
        while not done.is_set():
            dispatcher.flush()

    def sender(n: int) -> None:
        for i in range(200):
            dispatcher.send("task-started", uuid=f"{n}-{i}")
            time.sleep(0.0001)

    loop = threading.Thread(target=flusher)
    loop.start()
    senders = [threading.Thread(target=sender, args=(n,)) for n in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    done.set()
    loop.join()
    dispatcher.flush()
    sent = [uuid for body in dispatcher.producer.bodies for uuid in body]
    assert sorted(sent) == sorted(f"{n}-{i}" for n in range(8) for i in range(200))


def test_the_consumer_schedules_one_flush_through_the_loops_lock() -> None:
    app = _app()
    hub = Hub()
    worker = SimpleNamespace(use_eventloop=True)  # what the consumer's control step reads of its worker
    consumer = events.EventsConsumer(lambda *_: None, app=app, hub=hub, pool=None, timer=hub.timer, controller=worker)
    consumer.event_dispatcher = _dispatcher(app)
    consumer.event_dispatcher.producer = RecordingProducer()
    consumer.event_dispatcher.send("task-received", uuid="t1")
    threads = [threading.Thread(target=consumer.on_send_event_buffered) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ready = hub._pop_ready()
    assert len(ready) == 1  # one pending flush, however many threads asked
    for item in ready:
        item()
    assert consumer.event_dispatcher.producer.bodies == [["t1"]]
    hub.close()
