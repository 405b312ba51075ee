"""The worker node's lifecycle steps (``workers.lifecycle.steps``): their order, and what their hooks do at the
warm shutdown's signal, without a Celery worker (the integration tests run them in real ones)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import bootsteps, signals

from bridge.core.coordination import capacity, keys
from bridge.core.settings import get_settings
from workers.lifecycle import drain, state
from workers.lifecycle.steps import WORKER_STEPS, advertising
from workers.lifecycle.steps import drain as drain_step
from workers.lifecycle.steps.startup import NodeStartup


def test_every_step_requires_the_node_start_up_and_the_drain_follows_the_adverts() -> None:
    steps = [bootsteps.symbol_by_name(name) for name in WORKER_STEPS]

    def required(step: type[bootsteps.Step]) -> set[type[bootsteps.Step]]:
        direct = {bootsteps.symbol_by_name(r) for r in step.requires}
        return direct.union(*(required(r) for r in direct))

    assert all(NodeStartup in required(step) for step in steps if step is not NodeStartup)
    assert advertising.SlotAdvertising in required(drain_step.DrainStart)


@pytest.fixture
def shutdown_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The adverts' and the drain's steps started as a worker starts them (grace 8 s); what happens, in order."""
    monkeypatch.setenv("WORKER_SHUTDOWN_GRACE_S", "8")
    get_settings.cache_clear()
    happened: list[str] = []
    withdraw = capacity.withdraw

    def withdrawing(*args: object) -> None:
        happened.append("withdraw")
        withdraw(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(capacity, "withdraw", withdrawing)
    monkeypatch.setattr(drain, "exit_by", lambda deadline: happened.append("exit_by"))  # never this test's exit
    started: list[bootsteps.StartStopStep] = [advertising.SlotAdvertising(None), drain_step.DrainStart(None)]
    assert all(step.include_if(None) for step in started)
    for step in started:
        step.start(None)
    yield happened
    for step in reversed(started):
        step.stop(None)


def test_the_shutdown_signal_withdraws_the_adverts_then_starts_the_drain(
    shutdown_hooks: list[str], redis_client: redis.Redis
) -> None:
    scope, queue = f"steps-{uuid.uuid4().hex[:8]}", "q"
    advert = advertising.Advert("w@h", [queue], 2, redis_client, scope)
    assert state.node.advertising is not None
    state.node.advertising.advert = advert  # as worker_ready sets it
    advertising.advertise(redis_client, scope, "w@h", [queue], 2, "webshop")
    assert capacity.missing_adverts(redis_client, scope, "w@h", [queue]) == []

    signals.worker_shutting_down.send(sender="w@h", sig="SIGTERM", how="Warm", exitcode=0)

    assert shutdown_hooks == ["withdraw", "exit_by"]
    assert capacity.missing_adverts(redis_client, scope, "w@h", [queue]) == [queue]
    assert redis_client.get(keys.worker_agent(scope, "w@h")) is None
    clock = state.process.drain_clock
    assert clock.draining and clock.incarnation == state.node.incarnation
    assert redis_client.get(keys.worker_drain(scope, "w@h")) is not None
    assert state.node.advertising.stopped.is_set()


def test_a_node_not_yet_ready_neither_withdraws_nor_drains(shutdown_hooks: list[str]) -> None:
    signals.worker_shutting_down.send(sender="w@h", sig="SIGTERM", how="Warm", exitcode=0)
    assert shutdown_hooks == [] and not state.process.drain_clock.draining
