"""A worker's 1.0 attempt (``workers.v1.attempt``) against a stub gateway (``tests/stub_gateway.py``) and this test's
Redis, with the program replaced by a fake (no process starts): what the attempt lets out of the process (its
task result, the gateway's ``error_message``, its log lines) is redacted by the rule 0.3 applies to every error
(``bridge.core.infra.redact``), and the program's deadline is the gateway's ``timeout_seconds`` clamped to what the
task's Celery limits and the broker's redelivery cover, as the dispatcher clamps the message's.
The same attempt with real programs: tests/integration/test_v1_attempt_protocol.py."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from bridge.core.coordination import capacity, markers
from bridge.core.gateway import GatewayClient, V1Rollout, attempt_key
from bridge.core.settings import Settings
from tests.stub_gateway import StubGateway
from workers.protocol.heartbeat import HeartbeatMonitor
from workers.v1 import attempt as attempt_module
from workers.v1.attempt import V1Attempt
from workers.v1.programs import ProgramLost

QUEUE = "rollouts"
SECRET = "s3cr3t-value-42"


@pytest.fixture
def gateway() -> Iterator[StubGateway]:
    with StubGateway().serving() as stub:
        yield stub


@pytest.fixture
def monitor(redis_client: redis.Redis) -> Iterator[HeartbeatMonitor]:
    watcher = HeartbeatMonitor(None, redis_client)
    yield watcher
    watcher.close()


def _attempt(
    url: str,
    client: redis.Redis,
    monitor: HeartbeatMonitor,
    rollout: dict[str, Any],
    *,
    scope: str | None = None,
    **settings: Any,
) -> V1Attempt:
    """A delivery of ``rollout``'s attempt "0" in deployment ``scope`` (default: a fresh one)."""
    scope = scope or f"t-{uuid.uuid4().hex[:8]}"
    model = V1Rollout.model_validate(rollout)
    capacity.mark_inflight(client, scope, QUEUE, attempt_key(model.rollout_id, "0"))
    fields: dict[str, Any] = {"agl_v1_url": url, "agl_v1_key": "k", "lease_ttl_s": 3.0, "heartbeat_interval_s": 1.0}
    return V1Attempt(
        model,
        "0",
        settings=Settings(**{**fields, "redis_key_scope": scope, **settings}),
        client=client,
        scope=scope,
        queue=QUEUE,
        monitor=monitor,
    )


class FakeProgram:
    """A program that never exits on its own (until ``exits_after_s``, so a test of old code ends) and writes
    nothing."""

    start = "cold"
    pid = 2**22 + 1  # never a process: kill() is the fake's own
    box = None

    def __init__(self, exits_after_s: float) -> None:
        self.exits_at = time.monotonic() + exits_after_s
        self.output_fd, write_fd = os.pipe()
        os.close(write_fd)  # no output: the reader ends at once
        self.killed = False

    def wait(self, timeout: float) -> int | None:
        time.sleep(min(timeout, max(0.0, self.exits_at - time.monotonic())))
        return 0 if time.monotonic() >= self.exits_at else None

    def kill(self) -> None:
        self.killed = True


# --- redaction ------------------------------------------------------------------------------------------


def test_a_gateway_error_that_stops_the_attempt_is_redacted_in_its_result_and_its_log(
    redis_client: redis.Redis, monitor: HeartbeatMonitor, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway's answer (a proxy's error page, say) may echo what it was sent: the task's result (the result
    backend, Flower) and the worker's log get it masked, as 0.3's worker masks every error."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text=f"upstream failed: token={SECRET} via redis://:{SECRET}@cache:6379/0")

    rollout = {"rollout_id": f"r-{uuid.uuid4().hex[:6]}", "config": {"local": {"agent_class": "pkg:Agent"}}}
    attempt = _attempt("http://gateway.test", redis_client, monitor, rollout)
    attempt.gateway.close()
    http = httpx.Client(base_url="http://gateway.test", transport=httpx.MockTransport(answer))
    attempt.gateway = GatewayClient("http://gateway.test", key=None, retries=0, http=http)
    with caplog.at_level(logging.INFO):
        outcome = attempt.run()
    assert outcome.state is None and outcome.detail.startswith("not run: "), outcome
    assert "token=***" in outcome.detail
    assert SECRET not in str(outcome.as_dict()) and SECRET not in caplog.text


def test_a_redis_error_that_stops_the_attempt_is_redacted_in_its_result_and_its_log(
    redis_client: redis.Redis,
    monitor: HeartbeatMonitor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rollout = {"rollout_id": f"r-{uuid.uuid4().hex[:6]}", "config": {"local": {"agent_class": "pkg:Agent"}}}
    attempt = _attempt("http://gateway.test", redis_client, monitor, rollout)

    def claim(ttl_s: float) -> None:
        raise redis.AuthenticationError(f"AUTH refused at redis://worker:{SECRET}@redis:6379/0")

    monkeypatch.setattr(attempt.held, "claim", claim)
    with caplog.at_level(logging.INFO):
        outcome = attempt.run()
    assert outcome.detail == "not run: AUTH refused at redis://worker:***@redis:6379/0", outcome
    assert SECRET not in str(outcome.as_dict()) and SECRET not in caplog.text


def test_a_lost_program_server_is_redacted_in_the_gateways_error_message(
    gateway: StubGateway,
    redis_client: redis.Redis,
    monitor: HeartbeatMonitor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def lost(*args: Any) -> None:
        raise ProgramLost(f"the program server refused it: malformed request: KeyError('password={SECRET}')")

    monkeypatch.setattr(attempt_module, "start_program", lost)
    rollout = gateway.add(f"r-{uuid.uuid4().hex[:6]}", "pkg:Agent", created_at=1.0)
    with caplog.at_level(logging.INFO):
        outcome = _attempt(gateway.url, redis_client, monitor, rollout).run()
    (patch,) = gateway.final_patches(rollout["rollout_id"])
    assert patch["error_message"].startswith("[failure class: infra] the agent's program server failed: ")
    assert "password=***" in patch["error_message"]
    assert SECRET not in patch["error_message"] and SECRET not in str(outcome.as_dict())
    assert SECRET not in caplog.text


# --- the time budget ------------------------------------------------------------------------------------


def test_the_program_deadline_is_the_gateways_timeout_clamped_to_what_the_tasks_limits_cover(
    gateway: StubGateway,
    redis_client: redis.Redis,
    monitor: HeartbeatMonitor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatcher published the rollout with its timeout clamped (``_covered``), and Celery's hard limit
    and the broker's redelivery are sized for that; the worker runs the gateway's copy, whose timeout is the
    trainer's. Here the broker covers a 2 s budget (76 s visibility - 10 s queue wait - 1 s - (3 s lease + 60 s)),
    and the trainer asked for an hour: the program is stopped at 2 s, not run past the task's hard limit."""
    programs: list[FakeProgram] = []

    def start(*args: Any) -> FakeProgram:
        programs.append(FakeProgram(exits_after_s=20.0))
        return programs[-1]

    monkeypatch.setattr(attempt_module, "start_program", start)
    covered: dict[str, Any] = {"visibility_timeout_s": 76.0, "max_queue_wait_s": 10.0, "default_timeout_s": 30.0}
    rollout = gateway.add(f"r-{uuid.uuid4().hex[:6]}", "pkg:Agent", created_at=1.0, timeout_s=3600)
    attempt = _attempt(gateway.url, redis_client, monitor, rollout, **covered)
    started = time.monotonic()
    outcome = attempt.run()
    took = time.monotonic() - started
    assert outcome.as_dict().get("failure_class") == "timeout", outcome
    assert outcome.detail.startswith("timed out after 2s"), outcome
    assert took < 10.0, f"the program ran {took:.1f}s"
    assert programs and programs[0].killed


# --- takeovers ------------------------------------------------------------------------------------------


def test_a_takeover_never_starts_a_second_program_for_an_attempt_whose_program_began(
    gateway: StubGateway,
    redis_client: redis.Redis,
    monitor: HeartbeatMonitor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An earlier executor started this attempt's program, then stalled past its lease: its program may still post
    spans and a reward under the attempt's id. The redelivery that takes the lease over starts no program of its own
    and reports nothing: the attempt, started and neither leased nor done, is the dispatcher's lost worker, which runs
    the rollout again under the next attempt id. The attempt never holds two executions."""
    started: list[FakeProgram] = []

    def start(*args: Any) -> FakeProgram:
        started.append(FakeProgram(exits_after_s=0.0))
        return started[-1]

    monkeypatch.setattr(attempt_module, "start_program", start)
    rollout = gateway.add(f"r-{uuid.uuid4().hex[:6]}", "pkg:Agent", created_at=1.0)
    first = _attempt(gateway.url, redis_client, monitor, rollout)
    assert first.held.claim(60.0, renew=False).acquired and first.held.lease.mark_ran()  # its program began ...
    redis_client.delete(first.held.lease.key)  # ... and its lease lapsed while its worker stalled
    takeover = _attempt(gateway.url, redis_client, monitor, rollout, scope=first.scope)
    outcome = takeover.run()
    assert started == [], "a second program started in the attempt"
    assert outcome.state is None and outcome.as_dict().get("failure_class") == "infra", outcome
    assert "not re-run in place" in outcome.detail, outcome
    assert gateway.final_patches(rollout["rollout_id"]) == []  # the dispatcher decides, under the next attempt id
    marks = markers.read_markers(redis_client, [first.state_key])[first.state_key]
    assert marks.started and not marks.leased and not marks.done  # what the dispatcher's lost-worker rule reads
