"""Either dispatch line's real dispatcher on the fakes of ``tests.fakes.v03`` and ``tests.fakes.v1``, with the means
to feed it, read what it published and make its publishes fail: what a test of the one dispatcher runs against both
lines (the ``line`` fixture)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from kombu.exceptions import OperationalError

from bridge.core.coordination import capacity
from bridge.core.infra import PublishError
from bridge.core.settings import load_settings
from bridge.dispatch.dispatcher import LineDispatcher
from bridge.dispatch.v03.dispatcher import V03Dispatcher
from tests.fakes.v03 import Publisher, Store, attempted_rollout
from tests.fakes.v1 import FakeApp, FakeGateway, v1_dispatcher

QUEUE = "rollouts"
SLOTS = 4


@dataclass
class Line:
    """One line's dispatcher and the means to feed it, read it and make its publishes fail."""

    dispatcher: LineDispatcher
    add_waiting: Callable[[int], list[str]]  # n more rollouts waiting at its source: their rollout ids
    published: Callable[[], list[str]]  # the rollout ids it published, in order
    refuse: Callable[[str], None]  # the broker refuses this rollout's publish
    other_line_key: Callable[[int], str]  # an in-flight entry of the other line
    forget: Callable[[], None]  # drop what the fakes recorded (what was published, what was written)


def v03_line(client: redis.Redis) -> Line:
    """A ``V03Dispatcher`` on a ``Store`` and a ``Publisher``; ``SLOTS`` advertised on ``QUEUE``."""
    settings = load_settings(store_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}", broker_url="redis://127.0.0.1:9/0")
    store = Store([])
    publisher = Publisher()
    dispatcher = V03Dispatcher(settings, store, client, publisher)  # type: ignore[arg-type]
    capacity.advertise(client, dispatcher.scope, "worker-1", [QUEUE], SLOTS)
    counter = iter(range(1, 10_000))

    def add_waiting(n: int) -> list[str]:
        made = [attempted_rollout(next(counter), mode="test") for _ in range(n)]
        store.queue.extend(made)
        store.rollouts.update({r.rollout_id: r for r in made})
        return [r.rollout_id for r in made]

    def refuse(rollout_id: str) -> None:
        publisher.fail = {*publisher.fail, rollout_id}
        publisher.error = PublishError("broker said no")

    def forget() -> None:
        publisher.published.clear()
        store.requeued.clear()

    return Line(
        dispatcher,
        add_waiting,
        lambda: [rid for rid, _ in publisher.published],
        refuse,
        lambda n: f"v1-other{n}-0",
        forget,
    )


def v1_line(client: redis.Redis) -> Line:
    """A ``V1Dispatcher`` on a ``FakeGateway`` and a ``FakeApp``; ``SLOTS`` advertised on ``QUEUE``."""
    gateway = FakeGateway()
    dispatcher, app = v1_dispatcher(gateway, client, slots=SLOTS)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    counter = iter(range(1, 10_000))

    def add_waiting(n: int) -> list[str]:
        made = [f"{prefix}-{next(counter)}" for _ in range(n)]
        for rid in made:
            gateway.add(rid)
        return made

    def published() -> list[str]:
        assert isinstance(dispatcher.publisher.app, FakeApp)
        return [task["kwargs"]["rollout"]["rollout_id"] for task in dispatcher.publisher.app.sent]

    def refuse(rollout_id: str) -> None:
        app.refuse[rollout_id] = OperationalError("broker said no")

    def forget() -> None:
        app.sent.clear()
        gateway.writes.clear()

    return Line(dispatcher, add_waiting, published, refuse, lambda n: f"at-other-{n}", forget)


@pytest.fixture(params=["v03", "v1"])
def line(request: pytest.FixtureRequest, redis_client: redis.Redis) -> Iterator[Line]:
    """Each line in turn on an emptied Redis database; its lock released afterwards."""
    redis_client.flushdb()
    made = v03_line(redis_client) if request.param == "v03" else v1_line(redis_client)
    yield made
    made.dispatcher.leader_lock.release()
    redis_client.flushdb()
