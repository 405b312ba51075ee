"""A worker's 1.0 attempt (``workers.v1.attempt``) on the shared attempt protocol (``workers.protocol.held``), run in
this process against a stub gateway (``tests/stub_gateway.py``) and this process's Redis, with real agent programs
(``tests/agl_v1_agents.py``) as subprocesses: the lease held through a slow gateway read, keys scoped per deployment
and per rollout incarnation, the process group killed when the program exits leaving children, a bounded output
tail, and failure classes. The same attempt under real workers and a drain: ``test_v1_worker_drain.py``."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.gateway import V1Rollout, attempt_key, scoped_attempt_key
from bridge.core.settings import Settings
from tests.helpers import TEST_REDIS_URL, program_alive, wait_for
from tests.stub_gateway import StubGateway
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.v1.attempt import OUTPUT_TAIL_BYTES, OutputTail, V1Attempt

pytestmark = [pytest.mark.integration, pytest.mark.cost(20)]

QUEUE = "rollouts"
AGENTS = "tests.agl_v1_agents"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    connection = coordination_client(TEST_REDIS_URL, socket_timeout=5)
    yield connection
    connection.close()


@pytest.fixture
def gateway() -> Iterator[StubGateway]:
    with StubGateway().serving() as stub:
        yield stub


@pytest.fixture
def monitor(client: redis.Redis) -> Iterator[HeartbeatMonitor]:
    watcher = HeartbeatMonitor(None, client)
    yield watcher
    watcher.close()


def _settings(gateway: StubGateway, scope: str) -> Settings:
    return Settings(
        agl_v1_url=gateway.url, agl_v1_key="k", lease_ttl_s=3.0, heartbeat_interval_s=1.0, redis_key_scope=scope
    )


def _attempt(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor, rollout: dict, scope: str
) -> V1Attempt:
    model = V1Rollout.model_validate(rollout)
    capacity.mark_inflight(client, scope, QUEUE, attempt_key(model.rollout_id, "0"))  # as the dispatcher does
    return V1Attempt(
        model, "0", settings=_settings(gateway, scope), client=client, scope=scope, queue=QUEUE, monitor=monitor
    )


def test_the_lease_stays_held_through_a_gateway_read_slower_than_its_ttl(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor
) -> None:
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rollout = gateway.add(f"slow-{uuid.uuid4().hex[:6]}", f"{AGENTS}:Quick", created_at=1000.0)
    gateway.slow_reads_s = 7.0  # more than twice LEASE_TTL_S (3 s)
    attempt = _attempt(gateway, client, monitor, rollout, scope)
    lease = keys.lease(scoped_attempt_key(scope, attempt.rollout, "0"))
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(first=attempt.run()))
    runner.start()
    wait_for(lambda: bool(client.exists(lease)), 5, "the lease taken")
    lapses = 0
    second = None
    deadline = time.monotonic() + 6.5  # while the first read is still in flight
    while time.monotonic() < deadline:
        lapses += not client.exists(lease)
        if second is None and time.monotonic() > deadline - 2.0:
            # What the dispatcher's reconcile would start if the lease had lapsed: another executor of the attempt.
            second = _attempt(gateway, client, monitor, rollout, scope).run()
        time.sleep(0.05)
    gateway.slow_reads_s = 0.0
    runner.join(60)
    assert lapses == 0, f"the lease lapsed {lapses} times during the slow read"
    assert second is not None and second.state is None and "another executor holds" in second.detail, second
    assert result["first"].state == "succeeded", result
    assert len(gateway.final_patches(rollout["rollout_id"])) == 1


def test_a_reused_rollout_id_runs_again_and_deployments_do_not_share_attempt_state(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor
) -> None:
    rid = f"reused-{uuid.uuid4().hex[:6]}"
    scope_a, scope_b = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    first = _attempt(gateway, client, monitor, gateway.add(rid, f"{AGENTS}:Quick", created_at=1000.0), scope_a).run()
    assert first.state == "succeeded", first
    # Another deployment on the same Redis whose gateway hands out the same id: its attempt is its own.
    other = _attempt(gateway, client, monitor, gateway.add(rid, f"{AGENTS}:Quick", created_at=1000.0), scope_b).run()
    assert other.state == "succeeded", other
    # The first deployment's gateway restarted: the id comes again, a new rollout.
    again = _attempt(gateway, client, monitor, gateway.add(rid, f"{AGENTS}:Quick", created_at=2000.0), scope_a).run()
    assert again.state == "succeeded", again
    assert len(gateway.final_patches(rid)) == 3
    # A redelivery of the same incarnation is still dropped.
    dup = _attempt(gateway, client, monitor, gateway.add(rid, f"{AGENTS}:Quick", created_at=2000.0), scope_a).run()
    assert dup.state is None and "already finished" in dup.detail, dup
    for scope in (scope_a, scope_b):
        assert capacity.inflight_count(client, scope, QUEUE) == 0


def test_children_a_program_leaves_behind_at_its_exit_are_killed(
    gateway: StubGateway,
    client: redis.Redis,
    monitor: HeartbeatMonitor,
    outbox: Path,
) -> None:
    pid_file = outbox / "pids"
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rollout = gateway.add(
        f"child-{uuid.uuid4().hex[:6]}",
        f"{AGENTS}:LeavesChild",
        created_at=1.0,
        task_input={"pid_file": str(pid_file)},
        env_map={"PID_FILE": "input.pid_file"},  # the program's environment is clean: the worker's is not passed
    )
    outcome = _attempt(gateway, client, monitor, rollout, scope).run()
    assert outcome.state == "succeeded", outcome
    assert len(pid_file.read_text().split()) == 3
    wait_for(lambda: not program_alive(pid_file), 5, "the program's child gone")


def test_a_crashing_program_fails_with_class_agent_and_a_bounded_output_tail(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor
) -> None:
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rollout = gateway.add(f"long-{uuid.uuid4().hex[:6]}", f"{AGENTS}:LongLine", created_at=1.0)
    outcome = _attempt(gateway, client, monitor, rollout, scope).run()
    assert outcome.state == "failed", outcome
    assert outcome.as_dict()["failure_class"] == "agent"
    assert "exited with code 3" in outcome.detail and len(outcome.detail) < OUTPUT_TAIL_BYTES + 200
    (patch,) = gateway.final_patches(rollout["rollout_id"])
    assert patch["error_message"].startswith("[failure class: agent] ")
    # An invalid config is class input, never run.
    bad = gateway.add(f"bad-{uuid.uuid4().hex[:6]}", "", created_at=1.0)
    invalid = _attempt(gateway, client, monitor, bad, scope).run()
    assert invalid.as_dict()["failure_class"] == "input" and invalid.as_dict()["status"] == "failed"
    kept = client.get(keys.v1_result(scoped_attempt_key(scope, V1Rollout.model_validate(bad), "0")))
    assert kept is None  # sent to the gateway, so no longer kept


def test_the_output_tail_never_holds_more_than_its_bound() -> None:
    tail = OutputTail(max_bytes=1024, lines=3)
    for _ in range(1000):
        tail.feed(b"y" * 4096)  # one line, 4 MB, no newline
    tail.feed(b"\nlast one\n")
    assert len(tail.text()) <= 1024
    assert tail.text().endswith("last one")
    assert json.dumps(tail.text())


@pytest.mark.parametrize("paused", [None, "weight update 7"])
def test_a_program_that_fails_while_the_gateway_is_paused_is_infra_with_the_pause_named(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor, paused: str | None
) -> None:
    """A 1.0 program on the plain OpenAI SDK gives up after its retries in a pause: the pause is to blame, not the
    agent. Without a pause the same crash is the agent's."""
    scope = f"t-{uuid.uuid4().hex[:8]}"
    gateway.paused = paused
    rollout = gateway.add(f"paused-{uuid.uuid4().hex[:6]}", f"{AGENTS}:Crashing", created_at=1.0)
    outcome = _attempt(gateway, client, monitor, rollout, scope).run()
    (patch,) = gateway.final_patches(rollout["rollout_id"])
    if paused is None:
        assert outcome.as_dict()["failure_class"] == "agent", outcome
        assert patch["error_message"].startswith("[failure class: agent] the agent exited with code 1")
    else:
        assert outcome.as_dict()["failure_class"] == "infra", outcome
        assert patch["error_message"].startswith(
            "[failure class: infra] the gateway's proxy was paused (weight update 7) when the program ended: "
            "the agent exited with code 1"
        ), patch
        assert "the agent broke on purpose" in patch["error_message"]  # the output's tail is kept


def test_a_timeout_in_a_pause_is_infra_with_the_pause_named(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor, outbox: Path
) -> None:
    scope = f"t-{uuid.uuid4().hex[:8]}"
    gateway.paused = "weight update 8"
    rollout = gateway.add(
        f"pause-timeout-{uuid.uuid4().hex[:6]}",
        f"{AGENTS}:Sleeping",
        created_at=1.0,
        timeout_s=2,
        task_input={"pid_file": str(outbox / "pids")},
        env_map={"PID_FILE": "input.pid_file"},
    )
    outcome = _attempt(gateway, client, monitor, rollout, scope).run()
    assert outcome.as_dict()["failure_class"] == "infra", outcome
    (patch,) = gateway.final_patches(rollout["rollout_id"])
    assert patch["error_message"].startswith(
        "[failure class: infra] the gateway's proxy was paused (weight update 8) when the program ended: timed out"
    ), patch


def test_a_rollout_created_again_under_its_id_stops_the_old_program_within_a_watch_interval(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor, outbox: Path
) -> None:
    """A restarted gateway forgets every rollout; a trainer that enqueues its batch again with its own ids creates
    new rollouts under old ids. The old program is not theirs: it is stopped at the next read and reports nothing."""
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rid = f"again-{uuid.uuid4().hex[:6]}"
    pid_file = outbox / "pids"
    task_input, env_map = {"pid_file": str(pid_file)}, {"PID_FILE": "input.pid_file"}
    rollout = gateway.add(rid, f"{AGENTS}:Sleeping", created_at=1000.0, task_input=task_input, env_map=env_map)
    attempt = _attempt(gateway, client, monitor, rollout, scope)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outcome=attempt.run()))
    runner.start()
    wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 3, 30, "the program started")
    renewed = gateway.add(rid, f"{AGENTS}:Sleeping", created_at=2000.0, task_input=task_input, env_map=env_map)
    with gateway.lock:
        gateway.rollouts[rid]["status"].update(state="queuing", last_attempt_id=None)
    replaced = time.monotonic()
    runner.join(30)
    took = time.monotonic() - replaced
    outcome = result["outcome"]
    assert outcome.state is None and "moved on" in outcome.detail, outcome
    assert took < 1.0 + 2.0, f"stopped {took:.1f}s after the rollout was created again (watch interval 1 s)"
    wait_for(lambda: not program_alive(pid_file), 5, "the old program's processes gone")
    assert gateway.final_patches(rid) == []
    assert renewed["status"]["created_at"] == 2000.0
    assert capacity.inflight_count(client, scope, QUEUE) == 0


def test_a_program_that_ends_after_its_rollout_was_forgotten_reports_nothing(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor
) -> None:
    """The gateway forgets the rollout (a restart, the trainer's delete) after the attempt's first read, and the
    program then fails: nothing is reported, nothing stays kept, the slot is free, and the task's result says
    skipped, not an agent failure."""
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rollout = gateway.add(f"gone-{uuid.uuid4().hex[:6]}", f"{AGENTS}:Crashing", created_at=1.0)

    def forget(stored: dict) -> None:  # after the attempt's first read, as a restart or the trainer's delete does
        del gateway.rollouts[stored["rollout_id"]]

    gateway.after_read = forget
    attempt = _attempt(gateway, client, monitor, rollout, scope)
    outcome = attempt.run()
    assert outcome.state is None and "not reported" in outcome.detail, outcome
    assert outcome.as_dict()["status"] == "skipped"
    assert gateway.final_patches(rollout["rollout_id"]) == []
    assert client.get(keys.v1_result(attempt.state_key)) is None
    assert capacity.inflight_count(client, scope, QUEUE) == 0


def test_a_dispatcher_patch_landing_between_the_workers_read_and_its_own_runs_the_program_once(
    gateway: StubGateway, client: redis.Redis, monitor: HeartbeatMonitor
) -> None:
    """The worker read the rollout still ``queuing`` and marks it ``running`` itself; the dispatcher's patch lands
    in between, so the gateway refuses the worker's (running -> running). The attempt reads the rollout again and
    runs. It used to give up ("could not run") and leave the rollout to the reconcile, which ran it again as
    attempt 1 a minute later: 3 of 2,000 rollouts in ``bench-v1 --long 2000``."""
    scope = f"t-{uuid.uuid4().hex[:8]}"
    rollout = gateway.add(f"race-{uuid.uuid4().hex[:6]}", f"{AGENTS}:Quick", created_at=1.0, queuing=True)
    gateway.after_read = lambda stored: stored["status"].update(state="running", last_attempt_id="0")
    outcome = _attempt(gateway, client, monitor, rollout, scope).run()
    assert outcome.state == "succeeded", outcome
    assert [p["state"] for p in gateway.final_patches(rollout["rollout_id"])] == ["succeeded"]
    assert capacity.inflight_count(client, scope, QUEUE) == 0
