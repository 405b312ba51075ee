"""A new operator's first `docker compose up`, tried as one would: a stack that cannot work is refused with one line
that names the fix (the preflight services), and `docker compose stop`/`down` take seconds on the defaults while
the episodes they stop are handed over, never lost.

One project, brought up step by step as an operator fixes what the preflight named: no LLM (no `standin`, no
OPENAI_API_BASE), then `agl-v1` without a gateway, then `rabbitmq` without its password, and last the stand-in,
whose answers take ``LATENCY_MS``: then every episode is still running when the worker is stopped, and only the
bounded drain (WORKER_SHUTDOWN_GRACE_S, 25 s by default) keeps `stop` from waiting for them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from bridge.core.coordination import markers
from bridge.core.store import StoreClient
from bridge_lab import docker_here
from tests.deployed.conftest import Project, services
from webshop_env.goals import load_tasks

pytestmark = pytest.mark.deployed

LATENCY_MS = 120_000  # each LLM answer: longer than any drain, so the stop cuts every episode
ROLLOUTS = 4
DEFAULT_GRACE_S = 25.0  # docker-compose.yml's WORKER_SHUTDOWN_GRACE_S default
STOP_GRACE_S = 30.0  # docker-compose.yml's stop_grace_period of the workers: docker's SIGKILL comes after it


def refused(project: Project, preflight: str, *services: str) -> str:
    """`up -d [services]` fails at ``preflight``; returns the one line its log holds."""
    done = project.run("up", "-d", *services, check=False, timeout=600)
    assert done.returncode != 0, f"compose started the stack:\n{done.stderr[-3000:]}"
    assert f'service "{preflight}" didn\'t complete successfully: exit 2' in done.stderr, done.stderr[-3000:]
    logged = project.run("logs", "--no-color", "--no-log-prefix", preflight).stdout
    lines = [line for line in logged.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("preflight: refusing to start: "), lines
    return lines[0]


def running(project: Project) -> set[str]:
    return set(services(project).values())


def wait_until_all_leased(project: Project, store: StoreClient, ids: list[str], timeout_s: float = 300.0) -> None:
    """Until a worker holds the lease of each rollout's attempt: its episode runs (workers send the Store no
    ``running`` mark)."""
    deadline = time.monotonic() + timeout_s
    with redis.Redis.from_url(project.redis_url) as client:
        while True:
            attempts = [getattr(store.get_rollout(rid), "attempt", None) for rid in ids]
            held = [a is not None and a.attempt_id for a in attempts]
            facts = markers.read_markers(client, [str(h) for h in held if h]) if all(held) else {}
            if facts and all(fact.leased for fact in facts.values()):
                return
            assert time.monotonic() < deadline, f"the episodes never all ran: {facts}\n{project.logs()}"
            time.sleep(1.0)


def test_compose_refuses_a_stack_that_cannot_work_and_stop_takes_seconds(compose: Callable[..., Project]) -> None:
    project = compose([], POLICY_LATENCY_MS=str(LATENCY_MS))
    phases: dict[str, float] = {}
    began = time.monotonic()

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - began - sum(phases.values()), 1)

    line = refused(project, "preflight")  # `docker compose up -d`, as the README's cluster section once showed it
    assert "--profile standin" in line and "OPENAI_API_BASE" in line, line
    assert not running(project) & {"worker", "bridge", "flower"}, running(project)
    phase("no LLM")

    project.profiles = ["standin", "agl-v1"]
    project.env["AGL_V1_KEY"] = uuid.uuid4().hex
    line = refused(project, "preflight-v1", "dispatcher-v1", "worker-agl-v1")  # what this profile adds
    assert "--profile agl-v1-gateway" in line and "AGL_V1_SERVER_URL" in line, line
    assert not running(project) & {"dispatcher-v1", "worker-agl-v1"}, running(project)
    phase("no gateway")

    project.profiles = ["standin", "rabbitmq"]
    line = refused(project, "preflight-rabbitmq", "rabbitmq")
    assert "RABBITMQ_PASSWORD" in line, line
    for cid in project.run("ps", "-q", "--all", "rabbitmq").stdout.split():  # created, never started
        never = json.loads(docker_here.docker("inspect", "--format", "{{json .State}}", cid).stdout)
        assert never["StartedAt"].startswith("0001-"), f"RabbitMQ ran (and made its user) before the check: {never}"
    phase("no RabbitMQ password")

    project.profiles = ["standin"]
    project.run("up", "-d", timeout=600)  # the episodes below show the worker serving
    with StoreClient(project.url("STORE_PORT"), retries=3) as store:
        tasks = load_tasks("test", limit=ROLLOUTS)
        ids = [rollout.rollout_id for rollout in store.enqueue([{"input": t, "mode": "test"} for t in tasks])]
        wait_until_all_leased(project, store, ids)
        phase("up, episodes running")
        worker = project.container("worker")
        started = time.monotonic()
        project.run("stop", "worker", timeout=120)
        took = time.monotonic() - started
        state = json.loads(docker_here.docker("inspect", "--format", "{{json .State}}", worker).stdout)
        statuses = [str(store.get_rollout(rid).status) for rid in ids]
    phase("worker stopped")
    print(f"\n[deployed] worker stopped in {took:.1f} s with {ROLLOUTS} episodes running; exit {state['ExitCode']}")
    assert took < STOP_GRACE_S, f"stop took {took:.1f} s: the drain did not bound it (docker's SIGKILL did)"
    # 1: the drain's forced exit (os._exit), by design; 142: the same timer's SIGALRM where the interpreter had
    # already dropped its handler while finalizing (docs/operations.md, "Graceful shutdown").
    assert state["ExitCode"] in (0, 1, 142) and not state["OOMKilled"], state
    # The Store's default (one attempt): each cut episode's rollout is handed back to run again, never failed or lost.
    assert statuses == ["requeuing"] * ROLLOUTS, statuses
    started = time.monotonic()
    project.run("stop", timeout=120)  # `down` is this, then the containers' removal (the engine's own time)
    took = time.monotonic() - started
    print(f"[deployed] docker compose stop of the rest: {took:.1f} s; phases {phases}")
    assert took < STOP_GRACE_S, f"stop took {took:.1f} s"
