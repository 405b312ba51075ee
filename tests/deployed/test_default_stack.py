"""The default stack of `docker compose up` as it runs: a batch, what each container is given, faults.

One project of the default stack with the stand-in LLM (profile `standin`) and two worker containers serves the
module. First a batch of WebShop rollouts (``run_batch``: rewards and spans). Then what runs is what the files
promise: each container of ours runs as uid 1000; each secret of .env reaches exactly the containers
tests/unit/test_compose_environment.py's SECRETS allows (read from `docker inspect`); Flower refuses a request
without its login; Redis refuses a client without its password. Then the faults, audited as the chaos suite audits
(bridge_lab.chaos.audit): ``docker kill`` of a worker container mid-episode, ``docker stop`` of one (SIGTERM to its
init, the drain hands over within WORKER_SHUTDOWN_GRACE_S, far inside compose's `stop_grace_period`), ``docker
compose restart redis`` (its append-only file on the volume) and the Store container paused for 15 s. Each fault
gets a batch of its own; its audit's four counts (lost, twice, flipped, bad reward) must be 0 and every rollout
must succeed. The protocol's intervals are the chaos suite's short ones (CHAOS_ENV), and the stand-in answers after
POLICY_LATENCY_MS, so episodes last seconds and a fault lands in one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from bridge.core.store import StoreClient
from bridge_lab import docker_here
from bridge_lab.chaos.run import run_with_fault
from bridge_lab.chaos.scenarios import CHAOS_ENV, RETRY_CONFIG
from bridge_lab.chaos.state import ChaosRun, ScenarioResult
from bridge_lab.stack import LocalStack, StackConfig
from tests.deployed.conftest import FLOWER_LOGIN, Project, assert_secrets_placed, process_uids, services
from tests.deployed.test_compose_stack import run_batch
from tests.unit.test_compose_environment import SECRETS
from webshop_env.goals import load_tasks

pytestmark = pytest.mark.deployed

WORKERS = 2
CONCURRENCY = 4
BATCH = 12
GRACE_S = 8  # WORKER_SHUTDOWN_GRACE_S: the drain's bound (its minimum)
DEADLINE_S = 240.0
# Secrets of .env with values of their own, to find where each one lands.
SECRET_VALUES = {name: f"secret-{name.lower()}-{uuid.uuid4().hex}" for name in ("OPENAI_API_KEY", "WEBSHOP_TOKEN")}
SECRET_VALUES["AGENT_LIGHTNING_STORE_TOKEN"] = f"secret-store-token-{uuid.uuid4().hex}"
PROJECT_ENV = {
    **CHAOS_ENV,
    **SECRET_VALUES,
    "WORKER_CONCURRENCY": str(CONCURRENCY),
    "WORKER_SHUTDOWN_GRACE_S": str(GRACE_S),
    "POLICY_LATENCY_MS": "1000",
}
OURS = ("store", "webshop", "policy", "worker", "bridge", "flower")  # services run from this Dockerfile's images


@pytest.fixture(scope="module")
def stack(compose_module: Callable[..., Project]) -> Iterator[Project]:
    project = compose_module(["standin"], **PROJECT_ENV)
    serving(project)
    yield project


def run_fault(
    project: Project, fault: Callable[[ChaosRun], None], batch: int = BATCH, deadline_s: float = DEADLINE_S
) -> tuple[ScenarioResult, int]:
    """Enqueue ``batch`` rollouts, run ``fault`` beside the observer, wait (bounded) until every rollout finished,
    audit. Also returns how many rollouts ran more than one attempt (the fault cut theirs short)."""
    serving(project)
    services = LocalStack(
        StackConfig(
            store_url=project.url("STORE_PORT"),
            broker_url=project.redis_url,
            redis_url=project.redis_url,
            webshop_url=project.url("WEBSHOP_PUBLISH_PORT"),
            workers=0,
            bridge=False,
        )
    )
    started = time.monotonic()
    with StoreClient(services.store_url, retries=3) as store:
        tasks = load_tasks("test", limit=batch)
        rollouts = store.enqueue([{"input": task, "mode": "test", "config": RETRY_CONFIG} for task in tasks])
    run = ChaosRun(services, services, [r.rollout_id for r in rollouts])
    result = run_with_fault(run, fault, deadline_s)
    rerun = sum(len(run.store.list_attempts(rid)) > 1 for rid in run.rollout_ids)
    run.close()
    result.seconds = round(time.monotonic() - started, 1)
    result.notes.append(f"{rerun} rollout(s) ran more than one attempt")
    return result, rerun


def both_workers_busy(run: ChaosRun, timeout_s: float = 120.0) -> bool:
    """Until more attempts are leased than one container has slots: then each container runs episodes."""
    return run.wait_for(lambda: len(run.running()) > CONCURRENCY, timeout_s)


def assert_clean(project: Project, result: ScenarioResult) -> None:
    print(
        f"\n[deployed] {result.name}: {result.seconds} s, {result.succeeded}/{result.enqueued} succeeded, "
        f"attempts failed {dict(result.attempts_failed)}, notes {result.notes}"
    )
    assert result.clean, (result, project.logs())
    assert result.succeeded == BATCH, (result, project.logs())
    assert not [note for note in result.notes if note.startswith("fault injection error")], result.notes


def serving(project: Project) -> None:
    """Every worker replica up and healthy (a container an earlier fault killed or stopped is started again)."""
    project.run("up", "-d", "--wait", "--wait-timeout", "480", "--scale", f"worker={WORKERS}", timeout=600)


def test_the_default_stack_runs_a_webshop_batch(stack: Project) -> None:
    """As a user runs it (`docker compose --profile standin up`): each reward the ledger's, one episode span each."""
    seconds = run_batch(stack, "--scale", f"worker={WORKERS}")
    print(f"\n[deployed] default stack + standin: {seconds}")


def test_each_container_of_ours_runs_every_process_as_uid_1000(stack: Project) -> None:
    """Every process of each container of ours, its init (PID 1) included, as the host's process table shows it."""
    running = services(stack)
    assert set(OURS) <= set(running.values()), running
    for cid, service in running.items():
        if service in OURS:
            processes = process_uids(cid)
            assert processes and {uid for uid, _ in processes} == {1000}, (service, processes)


def test_each_secret_reaches_exactly_the_containers_that_read_it(stack: Project) -> None:
    """`docker inspect`'s environment of every container against SECRETS (the services that may hold each one):
    a secret set in .env is in a container's environment if and only if that service reads it."""
    secrets = {**SECRET_VALUES, "FLOWER_BASIC_AUTH": FLOWER_LOGIN, "REDIS_PASSWORD": stack.env["REDIS_PASSWORD"]}
    assert_secrets_placed(stack, secrets, SECRETS)


def test_flower_refuses_a_request_without_its_login(stack: Project) -> None:
    user, _, password = FLOWER_LOGIN.partition(":")
    url = f"{stack.url('FLOWER_PORT')}/api/workers"
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, auth=("intruder", "a-guess-of-12-chars"), timeout=30).status_code == 401
    assert httpx.get(url, auth=(user, password), timeout=30).status_code == 200


def test_redis_refuses_a_client_without_its_password(stack: Project) -> None:
    bare = stack.redis_url.replace(f":{stack.env['REDIS_PASSWORD']}@", "")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(bare, socket_timeout=5).get("agl:anything")
    assert redis.Redis.from_url(stack.redis_url, socket_timeout=5).ping()


def test_docker_kill_of_a_worker_mid_episode(stack: Project) -> None:
    """SIGKILL to the whole container (init, worker, pool): its leases lapse, the attempts run again elsewhere."""
    victim = stack.container("worker", 1)

    def kill(run: ChaosRun) -> None:
        assert both_workers_busy(run), "the batch never had both workers busy"
        docker_here.docker("kill", victim)
        run.note("killed")

    result, rerun = run_fault(stack, kill)
    result.name = "docker kill worker"
    assert_clean(stack, result)
    assert rerun >= 1, f"no attempt of the killed container was run again: {result}"


def test_docker_stop_of_a_worker_drains_within_its_grace(stack: Project) -> None:
    """SIGTERM to tini: the worker stops its episodes at G - 6 s, hands them over, and exits within G."""
    victim = stack.container("worker", 2)
    took: list[float] = []

    def stop(run: ChaosRun) -> None:
        assert both_workers_busy(run), "the batch never had both workers busy"
        started = time.monotonic()
        docker_here.docker("stop", victim, timeout=120)  # the container's stop_grace_period (30 s) bounds it
        took.append(time.monotonic() - started)

    result, _ = run_fault(stack, stop)
    result.name = "docker stop worker"
    state = json.loads(docker_here.docker("inspect", "--format", "{{json .State}}", victim).stdout)
    assert_clean(stack, result)
    print(f"[deployed] stopped in {took[0]:.1f} s (grace {GRACE_S} s), exit code {state['ExitCode']}")
    assert took and took[0] < GRACE_S + 4, f"docker stop took {took}: the drain did not bound the exit"
    assert state["ExitCode"] in (0, 1) and not state["OOMKilled"], state  # 1: the drain's forced exit, by design
    assert result.attempts_failed.get("shutdown", 0) >= 1, f"nothing was handed over: {result}"


def test_redis_restarted_mid_batch(stack: Project) -> None:
    """`docker compose restart redis`: broker and coordination come back from the append-only file."""

    def restart(run: ChaosRun) -> None:
        assert both_workers_busy(run), "the batch never had both workers busy"
        stack.run("restart", "redis", timeout=120)
        run.note("restarted")

    result, _ = run_fault(stack, restart)
    result.name = "docker compose restart redis"
    assert_clean(stack, result)


def test_store_paused_for_15_s(stack: Project) -> None:
    """`docker compose pause store` for 15 s: reports and dispatch wait, nothing is lost or reported twice. That
    they waited is shown: an episode that bought during the pause (the WebShop server was not paused) has its
    attempt ended in the Store only after it, with that purchase's reward."""
    window: list[float] = []
    ids: list[str] = []

    def pause(run: ChaosRun) -> None:
        ids.extend(run.rollout_ids)
        assert both_workers_busy(run), "the batch never had both workers busy"
        stack.run("pause", "store")
        window.append(time.time())
        time.sleep(15)
        window.append(time.time())
        stack.run("unpause", "store")
        run.note("paused 15 s")

    result, _ = run_fault(stack, pause)
    result.name = "store paused 15 s"
    assert_clean(stack, result)
    ledger = httpx.get(f"{stack.url('WEBSHOP_PUBLISH_PORT')}/purchases", timeout=30).json()["items"]
    bought = {item["session_id"]: item for item in ledger if window[0] < item["time"] < window[1]}
    with StoreClient(stack.url("STORE_PORT"), retries=3) as store:
        attempts = [attempt for rid in ids for attempt in store.list_attempts(rid)]
    waited = [
        attempt
        for attempt in attempts
        if str((attempt.metadata or {}).get("env_session_id")) in bought
        and attempt.end_time is not None
        and attempt.end_time >= window[1]
    ]
    print(f"[deployed] bought while the Store was paused: {len(bought)}; their reports waited for it: {len(waited)}")
    assert waited, f"no episode's report waited for the paused Store ({len(bought)} bought during the pause)"
    for attempt in waited:
        meta = attempt.metadata or {}
        assert meta["reward"] == bought[str(meta["env_session_id"])]["reward"], meta
