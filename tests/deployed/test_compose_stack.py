"""`docker compose up` of docker-compose.yml as a user runs it: a batch of WebShop rollouts runs to `succeeded`, each
with the reward the WebShop server computed and its spans (``run_batch``, which the default stack's and both lines'
modules run too), here with RabbitMQ as the broker (profile `rabbitmq`)."""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from bridge.core.store import FINISHED_ROLLOUT, AttemptedRollout
from bridge_lab.demo import StoreRollouts
from tests.deployed.conftest import Project, assert_secrets_placed
from tests.unit.test_compose_environment import SECRETS
from webshop_env.goals import load_tasks

pytestmark = pytest.mark.deployed

BATCH = 8
BATCH_TIMEOUT_S = 300.0


def run_batch(project: Project, *up_args: str) -> dict[str, float]:
    """`up` the project (with ``up_args``: the services to start, ``--scale``; a no-op for what is already up),
    enqueue BATCH WebShop rollouts in its Store and audit them; returns the phases' wall seconds."""
    seconds: dict[str, float] = {}
    started = time.monotonic()
    project.run("up", "-d", "--wait", "--wait-timeout", "480", *up_args, timeout=600)
    seconds["up to healthy"] = round(time.monotonic() - started, 1)
    rollouts = StoreRollouts(project.url("STORE_PORT"))
    try:
        started = time.monotonic()
        ids = rollouts.enqueue(load_tasks("test", limit=BATCH), "test")
        views = rollouts.views(ids)
        while not all(view.status in FINISHED_ROLLOUT for view in views):
            assert time.monotonic() - started < BATCH_TIMEOUT_S, (
                f"unfinished after {BATCH_TIMEOUT_S:.0f} s: {collections.Counter(str(v.status) for v in views)}\n"
                + project.logs()
            )
            time.sleep(2.0)
            views = rollouts.views(ids)
        seconds["batch"] = round(time.monotonic() - started, 1)
        assert [str(view.status) for view in views] == ["succeeded"] * BATCH, project.logs()
        ledger: dict[str, list[float]] = collections.defaultdict(list)
        for item in httpx.get(f"{project.url('WEBSHOP_PUBLISH_PORT')}/purchases", timeout=30).json()["items"]:
            ledger[item["session_id"]].append(item["reward"])
        for view in views:
            assert isinstance(view, AttemptedRollout)
            meta = view.attempt.metadata or {}
            assert meta.get("done") and ledger[str(meta["env_session_id"])] == [meta["reward"]], (view.rollout_id, meta)
            spans = rollouts.store.spans(view.rollout_id, view.attempt.attempt_id)
            assert [s["name"] for s in spans].count("webshop.episode") == 1, [s["name"] for s in spans]
    finally:
        rollouts.close(ids if "ids" in locals() else [])
    return seconds


def test_the_stack_on_rabbitmq_runs_the_same_batch(compose: Callable[..., Project]) -> None:
    """Profile `rabbitmq` with COMPOSE_BROKER_URL as .env.example says: the rollouts go through its queue, and the
    RabbitMQ password and the broker URL are in exactly the running containers that read them."""
    password = uuid.uuid4().hex
    project = compose(
        ["standin", "rabbitmq"],
        RABBITMQ_PASSWORD=password,
        COMPOSE_BROKER_URL=f"amqp://agl:{password}@rabbitmq:5672//",
    )
    seconds = run_batch(project)
    # The password reaches the broker's clients inside COMPOSE_BROKER_URL, and nowhere else but the broker.
    allowed = {**SECRETS, "RABBITMQ_PASSWORD": SECRETS["RABBITMQ_PASSWORD"] | SECRETS["COMPOSE_BROKER_URL"]}
    values = {name: project.env[name] for name in ("RABBITMQ_PASSWORD", "COMPOSE_BROKER_URL")}
    assert_secrets_placed(project, values, allowed)
    queues = project.run("exec", "-T", "rabbitmq", "rabbitmqctl", "-q", "list_queues", "name", "consumers").stdout
    assert any(line.split()[:1] == ["rollouts"] and int(line.split()[1]) >= 1 for line in queues.splitlines()), queues
    print(f"\n[deployed] default stack + standin + rabbitmq: {seconds}")
