"""Chaos for the Agent Lightning 1.0 line: ``python -m bridge chaos --agl v1``.

One stack serves every scenario: Redis and the LLM stand-in, 1.0's gateway (``agl-server`` from the 1.0 virtualenv,
``bridge_lab.agl_v1_env``), ``python -m bridge v1`` and worker nodes (``-P threads``, a 1.0-only deployment with
``WORKER_SHUTDOWN_GRACE_S`` set). Each scenario creates its rollouts on the gateway as 1.0's trainer does (``POST
/api/rollouts``), running ``bridge_lab.chaos.v1_program:ChaosProgram`` (a start event, a sleep, the reward its input
names), injects its fault, waits (bounded) until every rollout finished, restores what the fault took away (workers,
dispatcher), and audits from the gateway and Redis (``audit_v1``), with the 0.3 audit's definitions where they apply:

* lost: rollouts not finished by the deadline;
* twice: two executions in effect in the attempt the trainer reads (two ``chaos.start`` events of distinct
  executions, or two rewards), or a done marker in Redis naming another final state than the gateway holds;
* flipped: rollouts whose state (or current attempt) changed after they were first seen finished;
* bad reward: succeeded rollouts whose rewards are not exactly ``[input.reward]``.

Refused rollouts (the malformed and env_map attack scenarios) must fail with their reason and never start: one that
does not is noted as an error. Every other rollout must succeed; ``python -m bridge chaos --agl v1`` exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from bridge.core.coordination import capacity, coordination_client, keys
from bridge.core.gateway import GatewayClient, GatewayError, V1Rollout, V1State, scoped_attempt_key
from bridge.core.task import failure_class_of
from bridge_lab.agl_v1_env import GATEWAY_MODEL, start_gateway, start_v1_dispatcher, v1_virtualenv
from bridge_lab.chaos.state import ScenarioResult
from bridge_lab.chaos.v1_program import START_EVENT
from bridge_lab.procs import ManagedProcess, free_port, pause_group
from bridge_lab.stack import LocalStack, StackConfig

PROGRAM = "bridge_lab.chaos.v1_program:ChaosProgram"
ENV_MAP = {"CHAOS_SLEEP": "input.sleep", "CHAOS_REWARD": "input.reward"}
KEY = "chaos-v1-key"
DISPATCHER = "v1-dispatcher"
QUEUE = "rollouts"  # the stack's workers' default queue (CELERY_DEFAULT_QUEUE's default)
PROJECT_ROOT = Path(__file__).resolve().parents[2]
FINISHED = (V1State.SUCCEEDED, V1State.FAILED)
REPORTED = {V1State.SUCCEEDED.value, V1State.FAILED.value}
# Short intervals, so a lost lease, a hand-over and a never-started message are repaired within a scenario.
V1_CHAOS_ENV = {
    "HEARTBEAT_INTERVAL_S": "1",
    "LEASE_TTL_S": "4",
    "BRIDGE_RECONCILE_INTERVAL_S": "2",
    "BRIDGE_MAX_QUEUE_WAIT_S": "20",
    "WORKER_SHUTDOWN_GRACE_S": "8",  # a drained node hands its attempts over 2 s after SIGTERM
    "AGL_V1_MAX_RERUNS": "3",
    "AGL_V1_PASS_ENV": "PYTHONPATH",  # the program is this project's: its interpreter must find it
    "LOG_LEVEL": "INFO",
}


@dataclass
class V1Options:
    """How big and how long: the CLI's defaults, or the test suite's smaller ones."""

    rollouts: int = 20
    sleep_s: float = 4.0  # each program's run: a fault must land while programs run
    gateway_pause_s: float = 20.0
    proxy_pause_s: float = 30.0  # each of the two weight-update pauses of ``v1-proxy-pause``
    deadline_s: float = 240.0
    workers: int = 2
    concurrency: int = 4


@dataclass(frozen=True)
class Refused:
    """A rollout that must fail before anything starts: its ``config.local`` and input, and the reason's words."""

    label: str
    local: dict[str, Any] | None
    task_input: dict[str, Any]
    reason: str


# --- the shared stack ----------------------------------------------------------------------------


class V1ChaosStack:
    """Gateway, dispatcher and workers over ``services`` (its Redis and LLM stand-in), shared by the scenarios."""

    def __init__(self, services: LocalStack, log_dir: Path, options: V1Options) -> None:
        self.options = options
        self.port = free_port()
        self.gateway_url = f"http://127.0.0.1:{self.port}"
        pythonpath = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**V1_CHAOS_ENV, "AGL_V1_SERVER_URL": self.gateway_url, "AGL_V1_KEY": KEY, "PYTHONPATH": pythonpath}
        # The audit finds each program by the pid its start event names: a PID namespace would make it 1. The boxes
        # keep their uid, directory and limits.
        env["AGL_V1_PROGRAM_PID_NAMESPACE"] = "false"
        self.stack = LocalStack(
            StackConfig(
                store=False,
                broker_url=services.broker_url,
                redis_url=services.redis_url or None,
                webshop_url=services.webshop_url,
                llm_base_url=services.llm_base_url,
                workers=0,
                concurrency=options.concurrency,
                pool="threads",
                bridge=False,
                log_dir=log_dir,
                extra_env=env,
            )
        )
        self.gateway: GatewayClient | None = None
        self.redis: redis.Redis | None = None

    def start(self) -> None:
        venv = v1_virtualenv()
        try:
            self.stack.start_services(lambda message: None)
            start_gateway(self.stack, venv, key=KEY, port=self.port)
            self.ensure_serving()
        except BaseException:
            self.stack.stop()
            raise
        self.gateway = GatewayClient(self.gateway_url, key=KEY)
        self.redis = coordination_client(self.stack.redis_url or self.stack.broker_url, socket_timeout=5)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
        if self.redis is not None:
            self.redis.close()
        self.stack.stop()

    def ensure_serving(self) -> None:
        """Bring back what a fault took away: ``options.workers`` serving nodes and one dispatcher."""
        self.stack.workers[:] = [w for w in self.stack.workers if w.alive()]
        for worker in [w for w in self.stack.workers if not w.healthy()]:
            worker.wait_healthy()  # a replacement a fault started without waiting
        while len(self.stack.workers) < self.options.workers:
            self.stack.add_worker()
        dispatcher = self.stack.processes.get(DISPATCHER)
        if dispatcher is None or not dispatcher.alive():
            start_v1_dispatcher(self.stack, self.gateway_url, key=KEY, name=DISPATCHER)

    def gateway_process(self) -> ManagedProcess:
        return self.stack.process("agl-v1-gateway")

    def enqueue(
        self, prefix: str, refused: list[Refused] | None = None, *, sleep_s: Callable[[int], float] | None = None
    ) -> tuple[dict[str, float], dict[str, Refused]]:
        """Create ``options.rollouts`` rollouts on the gateway as 1.0's trainer does, ``refused`` among them: each
        one's reward (a random one its input names), and the refused ones. ``sleep_s(i)``: how long the ``i``-th
        program runs (default ``options.sleep_s``)."""
        assert self.gateway is not None
        refused = refused or []
        options = self.options
        tag = uuid.uuid4().hex[:6]
        rewards: dict[str, float] = {}
        bad: dict[str, Refused] = {}
        items: list[dict[str, Any]] = []
        for i in range(max(options.rollouts - len(refused), 1)):
            rid = f"{prefix}-{tag}-{i}"
            rewards[rid] = round(random.uniform(0.01, 1.0), 6)
            task = {"sleep": sleep_s(i) if sleep_s else options.sleep_s, "reward": rewards[rid]}
            local = {"agent_class": PROGRAM, "env_map": ENV_MAP}
            items.append({"rollout_id": rid, "input": task, "config": {"timeout_seconds": 120, "local": local}})
        for j, item in enumerate(refused):
            rid = f"{prefix}-{tag}-refused-{j}"
            bad[rid] = item
            task = {"sleep": options.sleep_s, "reward": 0.5, **item.task_input}
            config: dict[str, Any] = {"timeout_seconds": 120, "local": item.local}
            items.insert((j * 3) % (len(items) + 1), {"rollout_id": rid, "input": task, "config": config})
        self.gateway.create_rollouts(items)
        return rewards, bad

    @contextlib.contextmanager
    def running(self) -> Iterator[V1ChaosStack]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


# --- one run -------------------------------------------------------------------------------------


class V1ChaosRun:
    """One scenario's rollouts on the shared stack, watched from the gateway (``observe``), with its notes."""

    def __init__(self, chaos: V1ChaosStack, name: str, rewards: dict[str, float], refused: dict[str, Refused]) -> None:
        assert chaos.gateway is not None and chaos.redis is not None
        self.chaos, self.stack, self.name = chaos, chaos.stack, name
        self.gateway, self.redis = chaos.gateway, chaos.redis
        self.rewards, self.refused = rewards, refused  # rollout id -> its reward; rollout id -> why it must fail
        self.rollout_ids = [*rewards, *refused]
        self.versions: list[tuple[float, int]] = [(0.0, 0)]  # (when, version) of the model registrations
        self.enqueued = len(self.rollout_ids)
        self.forgotten = 0  # rollouts the gateway no longer has: out of the audit
        self.long: dict[str, bool] = {}  # rollout id -> its program runs FORGOTTEN_PROGRAM_S
        self.latest: dict[str, V1Rollout] = {}
        self.first_final: dict[str, V1Rollout] = {}
        self.flipped: set[str] = set()
        self.notes: list[str] = []
        self.stop = threading.Event()
        self._observing = threading.Lock()

    def note(self, text: str) -> None:
        self.notes.append(text)

    def replace_rollouts(self, enqueued: tuple[dict[str, float], dict[str, Refused]]) -> None:
        """The run's rollouts are now ``enqueued`` (the gateway forgot the others: a restart)."""
        with self._observing:
            self.forgotten += len(self.rollout_ids)
            self.rewards, self.refused = enqueued
            self.rollout_ids = [*self.rewards, *self.refused]
            self.enqueued += len(self.rollout_ids)
            for table in (self.latest, self.first_final):
                table.clear()
            self.flipped.clear()

    def forget_rollouts(self, rollout_ids: list[str]) -> None:
        """``rollout_ids`` leave the run (the trainer deleted them)."""
        with self._observing:
            gone = set(rollout_ids) & set(self.rollout_ids)
            self.forgotten += len(gone)
            self.rollout_ids = [rid for rid in self.rollout_ids if rid not in gone]
            for rid in gone:
                for table in (self.rewards, self.refused, self.latest, self.first_final):
                    table.pop(rid, None)
                self.flipped.discard(rid)

    @property
    def complete(self) -> bool:
        return len(self.first_final) == len(self.rollout_ids)

    def observe_once(self) -> None:
        """One look at every rollout; a read and its bookkeeping are one step, as in ``ChaosRun.observe_once``
        (the run's last look overlaps the observer's loop)."""
        with self._observing:
            self._observe_unlocked()

    def _observe_unlocked(self) -> None:
        for rid in self.rollout_ids:
            try:
                current = self.gateway.get_rollout(rid)
            except GatewayError:
                return  # the gateway is paused: the next round reads again
            if current is None:
                continue
            self.latest[rid] = current
            first = self.first_final.get(rid)
            if first is None and current.status.state in FINISHED:
                self.first_final[rid] = current
            elif first is not None and _moved(first, current):
                self.flipped.add(rid)

    def observe(self) -> None:
        while not self.stop.is_set():
            self.observe_once()
            self.stop.wait(0.5)

    def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if condition():
                return True
            time.sleep(0.2)
        return condition()

    def running_programs(self) -> dict[str, int]:
        """Rollout id -> the pid of its program (its current attempt's start event names it), for the running
        rollouts of this scenario whose program started."""
        running = [
            rid for rid in self.rollout_ids if (view := self.latest.get(rid)) and view.status.state == V1State.RUNNING
        ]
        return program_pids(self, running)

    def worker_running_programs(self, at_least: int, timeout_s: float = 60.0) -> ManagedProcess | None:
        """A serving worker node running ``at_least`` of this run's programs (the busiest), or None in time (an error
        note: the scenario's fault did not land). A program belongs to the node among whose processes' descendants
        it is: a warm one is a child of the node's program server, a cold one of the pool process that started it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            by_pid: dict[int, int] = {}
            for pid in self.running_programs().values():
                for ancestor in _ancestors(pid):
                    by_pid[ancestor] = by_pid.get(ancestor, 0) + 1
            nodes = [(by_pid.get(w.pid or -1, 0), w) for w in self.stack.workers if w.alive()]
            best = max(nodes, key=lambda item: item[0], default=(0, None))
            if best[1] is not None and best[0] >= at_least:
                return best[1]
            time.sleep(0.3)
        self.note(f"error: no worker ran {at_least} programs within {timeout_s:.0f}s: the fault did not land")
        return None


def _ancestors(pid: int) -> list[int]:
    """The pids of ``pid``'s parents up to init, or none when it is gone."""
    try:
        return [parent.pid for parent in psutil.Process(pid).parents()]
    except psutil.Error:
        return []


def _moved(first: V1Rollout, current: V1Rollout) -> bool:
    """The rollout changed after it was first seen finished: its state or its current attempt."""
    return (current.status.state, current.status.last_attempt_id) != (first.status.state, first.status.last_attempt_id)


# --- faults --------------------------------------------------------------------------------------


def kill_worker(run: V1ChaosRun) -> None:
    """SIGKILL a worker node (its programs die with it) while it runs programs; a new node replaces it."""
    victim = run.worker_running_programs(2)
    if victim is None or victim.pid is None:
        return
    os.killpg(victim.pid, signal.SIGKILL)
    if victim.proc is not None:
        victim.proc.wait(10)
    run.stack.workers.remove(victim)
    run.note(f"killed worker {victim.name} mid-program")
    run.stack.add_worker(wait=False)


def kill_dispatcher(run: V1ChaosRun) -> None:
    """SIGKILL the dispatcher once programs run and rollouts still queue; start it again."""
    run.wait_for(lambda: len(run.running_programs()) >= 2, 60)
    dispatcher = run.stack.process(DISPATCHER)
    if dispatcher.pid is not None:
        os.killpg(dispatcher.pid, signal.SIGKILL)
    if dispatcher.proc is not None:
        dispatcher.proc.wait(10)
    queuing = sum(1 for r in run.latest.values() if r.status.state == V1State.QUEUING)
    run.note(f"killed the dispatcher ({queuing} rollouts queuing)")
    start_v1_dispatcher(run.stack, run.chaos.gateway_url, key=KEY, name=DISPATCHER)


def pause_gateway(run: V1ChaosRun) -> None:
    """SIGSTOP the gateway for ``gateway_pause_s`` while programs run, then SIGCONT."""
    run.wait_for(lambda: len(run.running_programs()) >= 2, 60)
    gateway = run.chaos.gateway_process()
    seconds = run.chaos.options.gateway_pause_s
    assert gateway.pid is not None
    pause_group(gateway.pid, seconds)
    run.note(f"paused the gateway for {seconds:g}s")


def _management(run: V1ChaosRun, method: str, path: str, body: Any = None) -> Any:
    """A trainer's call to the gateway's key-protected routes (pause, resume, models)."""
    response = httpx.request(
        method, f"{run.chaos.gateway_url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    response.raise_for_status()
    return response.json() if response.content else None


def register_model(run: V1ChaosRun, version: int) -> None:
    """As 1.0's trainer after a weight update: the model's endpoint again, with the training step as its version."""
    endpoint = run.stack.llm_base_url
    _management(run, "POST", "/api/models", [{"model": GATEWAY_MODEL, "endpoint": endpoint, "version": version}])
    run.versions.append((time.time(), version))


def pause_proxy(run: V1ChaosRun) -> None:
    """Two weight updates as 1.0's trainer makes them while programs run: ``POST /proxy/pause`` (every model call
    then answers 429 with ``X-Agl-Paused``), ``proxy_pause_s`` seconds, the model registered with the next
    version, ``POST /proxy/resume``; the second a second after the first resume, while the programs it let go
    still run. Notes an error for any rollout re-run (its current attempt is not the first)."""
    seconds = run.chaos.options.proxy_pause_s
    run.wait_for(lambda: len(run.running_programs()) >= 2, 60)
    for version in (1, 2):
        running = len(run.running_programs())
        _management(run, "POST", "/proxy/pause", {"retry_after_seconds": 5, "reason": f"weight update {version}"})
        time.sleep(seconds)
        register_model(run, version)
        _management(run, "POST", "/proxy/resume")
        run.note(
            f"paused the gateway's proxy for {seconds:g}s with {running} programs running; model version {version}"
        )
        time.sleep(1.0)
    run.wait_for(lambda: run.complete, run.chaos.options.deadline_s)
    rerun = sorted(rid for rid, view in run.latest.items() if (view.status.last_attempt_id or "0") != "0")
    if rerun:
        run.note(f"error: {len(rerun)} rollouts ran again after a pause: {rerun[:3]}")


FORGOTTEN_PROGRAM_S = 90.0  # a forgotten rollout's program runs this long unless the worker ends it
FORGOTTEN_BOUND_S = 5.0  # a watch interval (HEARTBEAT_INTERVAL_S, 1 s here), a read timeout and the group kill


def restart_gateway(run: V1ChaosRun) -> None:
    """Restart the gateway (SIGTERM, then the same command) while programs run: it comes back empty, as 1.0's
    in-memory gateway does. The scenario's rollouts run ``FORGOTTEN_PROGRAM_S``, so only the worker's watch ends
    their programs. The trainer enqueues a new batch on the new gateway, which becomes the run's rollouts (audited
    as any other). Notes an error when a program of a forgotten rollout still runs ``FORGOTTEN_BOUND_S`` after the
    gateway answers again, or when a forgotten rollout keeps a slot in flight."""
    run.wait_for(lambda: len(run.running_programs()) >= 2, 60)
    forgotten = list(run.rollout_ids)
    pids = alive(program_pids(run, forgotten))  # read before the restart: the gateway forgets the start events
    run.stack.restart("agl-v1-gateway")
    back = time.monotonic()
    register_model(run, 0)
    run.note(f"restarted the gateway with {len(pids)} programs running")
    run.replace_rollouts(run.chaos.enqueue(f"{run.name}-after"))
    _forgotten_end(run, forgotten, pids, back, "the gateway's restart")


def delete_rollouts(run: V1ChaosRun) -> None:
    """The trainer deletes the scenario's long rollouts (every other one, ``FORGOTTEN_PROGRAM_S``) once two of them
    run (``DELETE /api/rollouts/{id}``): they leave the run, as nothing can be audited of a rollout the gateway no
    longer has, and the others are audited as any. Notes an error when a deleted rollout's program still runs
    ``FORGOTTEN_BOUND_S`` later, or it keeps a slot in flight."""
    victims = [rid for rid in run.rewards if run.long.get(rid)]
    run.wait_for(lambda: len(set(run.running_programs()) & set(victims)) >= 2, 60)
    pids = alive(program_pids(run, victims))
    for rid in victims:
        _management(run, "DELETE", f"/api/rollouts/{rid}")
    deleted = time.monotonic()
    run.forget_rollouts(victims)
    run.note(f"deleted {len(victims)} rollouts, {len(pids)} of them running")
    _forgotten_end(run, victims, pids, deleted, "their deletion")


def _forgotten_end(run: V1ChaosRun, rollout_ids: list[str], pids: dict[str, int], since: float, what: str) -> None:
    """Wait (bounded) until none of the programs ``pids`` of the forgotten ``rollout_ids`` runs and no slot is in
    flight for them; note how long the programs took, and an error past ``FORGOTTEN_BOUND_S``, or for a slot still
    in flight after 30 s."""
    if not pids:
        run.note(f"error: no program of the forgotten rollouts ran at {what}: nothing was checked")
    gone = run.wait_for(lambda: not alive(pids), 30)
    took = time.monotonic() - since
    if not gone or took > FORGOTTEN_BOUND_S:
        run.note(f"error: programs of forgotten rollouts ran {took:.1f}s after {what}: {alive(pids)}")
    else:
        run.note(f"the forgotten rollouts' programs ended {took:.1f}s after {what}")
    keys_of = {f"v1-{rid}-" for rid in rollout_ids}

    def held() -> list[str]:
        entries = capacity.inflight_entries(run.redis, run.stack.scope, QUEUE)
        return [key for key in entries if any(key.startswith(prefix) for prefix in keys_of)]

    if not run.wait_for(lambda: not held(), 30):
        run.note(f"error: slots still in flight for forgotten rollouts: {held()}")


def program_pids(run: V1ChaosRun, rollout_ids: list[str]) -> dict[str, int]:
    """Rollout id -> the pid of its current attempt's program (its start event names it), for those that started."""
    pids: dict[str, int] = {}
    for rid in rollout_ids:
        with contextlib.suppress(GatewayError):
            starts = run.gateway.events(rid, event_type=START_EVENT)
            if starts:
                pids[rid] = int(starts[-1]["data"]["pid"])
    return pids


def alive(pids: dict[str, int]) -> dict[str, int]:
    """Those of ``pids`` whose process still runs (a zombie does not)."""
    running: dict[str, int] = {}
    for rid, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running[rid] = pid
    return running


def drain_worker(run: V1ChaosRun) -> None:
    """SIGTERM a worker's main process (``WORKER_SHUTDOWN_GRACE_S``) while it runs programs: it hands them over and
    exits within its grace; a new node replaces it. Notes how many of the run's attempts were handed over."""
    victim = run.worker_running_programs(1)
    if victim is None or victim.proc is None:
        return
    victim.signal(signal.SIGTERM)  # the main process only, as Kubernetes does
    victim.proc.wait(30)
    run.stack.workers.remove(victim)
    run.stack.add_worker(wait=False)
    scope = run.stack.scope
    run.wait_for(lambda: run.complete, run.chaos.options.deadline_s)
    handed = sum(bool(run.redis.scard(keys.v1_handovers(scope, rid))) for rid in run.rewards)
    run.note(f"drained worker {victim.name} mid-program: {handed} rollouts handed over and run again")
    if handed == 0:
        run.note("error: the drained worker handed nothing over")


def no_fault(run: V1ChaosRun) -> None:
    """The fault is in the rollouts themselves."""


def _malformed(_trap: str) -> list[Refused]:
    return [
        Refused("no agent class", None, {}, "missing config.local.agent_class"),
        Refused(
            "env_map path missing",
            {"agent_class": PROGRAM, "env_map": {**ENV_MAP, "CHAOS_EXTRA": "input.absent"}},
            {},
            "is not in the rollout's input",
        ),
        Refused(
            "agent class not a path",
            {"agent_class": "not a class; rm -rf", "env_map": ENV_MAP},
            {},
            "is not module:Class",
        ),
        Refused(
            "env_map name not a variable",
            {"agent_class": PROGRAM, "env_map": {**ENV_MAP, "A=B": "input.sleep"}},
            {},
            "env_map may not set A=B",
        ),
    ]


def _attack(trap: str) -> list[Refused]:
    return [
        Refused(
            "AGL_EVENT_URL",
            {"agent_class": PROGRAM, "env_map": {**ENV_MAP, "AGL_EVENT_URL": "input.trap"}},
            {"trap": trap},
            "env_map may not set AGL_EVENT_URL",
        ),
        Refused(
            "LD_PRELOAD",
            {"agent_class": PROGRAM, "env_map": {**ENV_MAP, "LD_PRELOAD": "input.library"}},
            {"library": "/tmp/chaos-v1-preload.so"},
            "env_map may not set LD_PRELOAD",
        ),
    ]


@dataclass
class V1Scenario:
    """A fault on the shared stack, the rollouts among the others that must be refused (``refused(trap_url)``), and
    how long the ``i``-th program runs (``sleep_s(i, default)``)."""

    name: str
    fault: Callable[[V1ChaosRun], None]
    refused: Callable[[str], list[Refused]] = field(default=lambda trap: [])
    sleep_s: Callable[[int, float], float] = field(default=lambda i, default: default)


V1_SCENARIOS: dict[str, V1Scenario] = {
    scenario.name: scenario
    for scenario in (
        V1Scenario("v1-kill-worker", kill_worker),
        V1Scenario("v1-kill-dispatcher", kill_dispatcher),
        V1Scenario("v1-gateway-pause", pause_gateway),
        V1Scenario("v1-drain-worker", drain_worker),
        V1Scenario("v1-proxy-pause", pause_proxy),
        V1Scenario("v1-gateway-restart", restart_gateway, sleep_s=lambda i, default: FORGOTTEN_PROGRAM_S),
        V1Scenario(
            "v1-rollouts-deleted",
            delete_rollouts,
            sleep_s=lambda i, default: FORGOTTEN_PROGRAM_S if i % 2 == 0 else default,
        ),
        V1Scenario("v1-malformed", no_fault, _malformed),
        V1Scenario("v1-env-map-attack", no_fault, _attack),
    )
}


# --- run and audit -------------------------------------------------------------------------------


class _Trap:
    """An HTTP listener a hijacked ``AGL_EVENT_URL`` would reach: it counts what it hears."""

    def __init__(self) -> None:
        heard: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                heard.append(self.path)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.heard = heard
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_v1_scenario(chaos: V1ChaosStack, scenario: V1Scenario) -> ScenarioResult:
    """Enqueue ``options.rollouts`` rollouts (the refused ones among them), inject the fault, wait, audit."""
    options = chaos.options
    assert chaos.gateway is not None
    started = time.monotonic()
    chaos.ensure_serving()
    trap = _Trap()
    try:
        sleeps = [scenario.sleep_s(i, options.sleep_s) for i in range(options.rollouts)]
        rewards, bad = chaos.enqueue(scenario.name, scenario.refused(trap.url), sleep_s=sleeps.__getitem__)
        run = V1ChaosRun(chaos, scenario.name, rewards, bad)
        run.long = {rid: sleeps[i] == FORGOTTEN_PROGRAM_S for i, rid in enumerate(rewards)}
        observer = threading.Thread(target=run.observe, name="chaos-v1-observer", daemon=True)
        observer.start()
        fault = threading.Thread(target=_guarded, args=(scenario.fault, run), name="chaos-v1-fault", daemon=True)
        fault.start()
        run.wait_for(lambda: run.complete and not fault.is_alive(), options.deadline_s)
        time.sleep(3.0)  # a late report would land now: give it the chance to flip something
        run.observe_once()
        run.stop.set()
        fault.join(30)
        observer.join(10)
        if trap.heard:
            run.note(f"error: the trap heard {len(trap.heard)} requests: {trap.heard[:3]}")
        result = audit_v1(run)
    finally:
        trap.close()
    result.name = scenario.name
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _guarded(fault: Callable[[V1ChaosRun], None], run: V1ChaosRun) -> None:
    try:
        fault(run)
    except Exception as exc:  # a fault that breaks must show in the report, not end the run silently
        run.note(f"error: fault injection failed: {exc!r}")


def audit_v1(run: V1ChaosRun) -> ScenarioResult:
    """The four counts from the gateway (states, the current attempt's events) and Redis (done markers)."""
    result = ScenarioResult(name=run.name, enqueued=run.enqueued, forgotten=run.forgotten, notes=run.notes)
    if run.forgotten:
        run.note(f"{run.forgotten} of the {run.enqueued} rollouts left the gateway: their programs' end is audited")
    scope = run.stack.scope
    for rid in run.rollout_ids:
        first = run.first_final.get(rid)
        final = run.latest.get(rid)
        if first is None or final is None:
            result.lost += 1
            continue
        events = run.gateway.events(rid)
        versions_wrong = _wrong_versions(run, events)
        if versions_wrong:
            run.note(f"error: model calls of {rid} carry another model version than the one serving: {versions_wrong}")
        executions = {e["data"].get("execution") for e in events if e["event_type"] == START_EVENT}
        rewards = [e["data"].get("value") for e in events if e["event_type"] == "reward"]
        state = final.status.state
        if state == V1State.SUCCEEDED:
            result.succeeded += 1
        else:
            result.failed[_failure_class(final.status.error_message or "")] += 1
        why_twice = _second_execution(run, final, executions, rewards, scope)
        if why_twice is not None:
            result.executed_twice += 1
            run.note(f"{why_twice} in {rid}")
        refused = run.refused.get(rid)
        if refused is not None:
            error = final.status.error_message or ""
            if state != V1State.FAILED or refused.reason not in error:
                run.note(f"error: {refused.label} rollout {rid} is {state.value}, not failed with {refused.reason!r}")
            if executions or rewards:
                run.note(f"error: {refused.label} rollout {rid} ran")
        elif state == V1State.SUCCEEDED and rewards != [run.rewards[rid]]:
            result.bad_reward += 1
            run.note(f"reward {rewards} for {rid}, its input says {run.rewards[rid]}")
    result.flipped = len(run.flipped)
    return result


def _wrong_versions(run: V1ChaosRun, events: list[dict[str, Any]]) -> list[tuple[Any, int]]:
    """The model calls among ``events`` whose ``model_version`` is not the version registered when the gateway
    recorded them: (theirs, the registered one)."""
    wrong: list[tuple[Any, int]] = []
    for event in events:
        if event["event_type"] != "model_request":
            continue
        serving = max((v for v in run.versions if v[0] <= float(event["timestamp"])), default=(0.0, 0))[1]
        if event["data"].get("model_version") != serving:
            wrong.append((event["data"].get("model_version"), serving))
    return wrong


def _second_execution(
    run: V1ChaosRun, final: V1Rollout, executions: set[Any], rewards: list[Any], scope: str
) -> str | None:
    """Why the attempt the trainer reads counts as executed twice, or None."""
    if len(executions) > 1:
        return f"{len(executions)} executions"
    if len(rewards) > 1:
        return f"{len(rewards)} rewards"
    attempt = final.status.last_attempt_id or "0"
    done = run.redis.get(keys.done(scoped_attempt_key(scope, final, attempt)))
    if done in REPORTED and done != final.status.state.value:
        return f"two final reports (Redis says {done}, the gateway {final.status.state.value})"
    return None


def _failure_class(error: str) -> str:
    """The class a failed rollout's ``error_message`` names (``failure_class_of``), else ``input`` for a refused
    config, else ``failed``."""
    named = failure_class_of(error)
    if named is not None:
        return named
    if "invalid rollout" in error:
        return "input"
    return "failed"


# --- CLI -----------------------------------------------------------------------------------------


def main_v1(args: argparse.Namespace) -> int:
    """``python -m bridge chaos --agl v1``: the stack once, the scenarios one by one, the table; exit 1 unless clean."""
    from bridge_lab.chaos.audit import format_table

    names = args.scenario or list(V1_SCENARIOS)
    unknown = [name for name in names if name not in V1_SCENARIOS]
    if unknown:
        print(
            f"error: not a 1.0 scenario: {', '.join(unknown)} (choose from {', '.join(V1_SCENARIOS)})", file=sys.stderr
        )
        return 2
    options = V1Options(
        rollouts=args.rollouts,
        sleep_s=args.program_s,
        gateway_pause_s=args.gateway_pause_s,
        proxy_pause_s=args.proxy_pause_s,
        deadline_s=args.deadline,
        workers=args.workers,
        concurrency=args.concurrency,
    )
    services = LocalStack(StackConfig(store=False, workers=0, bridge=False, log_dir=args.log_dir))
    services.start_services(lambda message: print(message, flush=True))
    results: list[ScenarioResult] = []
    try:
        with V1ChaosStack(services, services.log_dir / "v1", options).running() as chaos:
            for name in names:
                print(f"running {name} ...", flush=True)
                results.append(run_v1_scenario(chaos, V1_SCENARIOS[name]))
                print(format_table(results[-1:]), flush=True)
    finally:
        services.stop()
    print(format_table(results))
    print(f"logs: {services.log_dir}")
    print(json.dumps({"scenarios": [_summary(r) for r in results]}))
    return 0 if all(clean(r) for r in results) else 1


def clean(result: ScenarioResult) -> bool:
    """The four zeros, and no note that says error."""
    return result.clean and not any(note.startswith("error") for note in result.notes)


def _summary(result: ScenarioResult) -> dict[str, Any]:
    return {
        "name": result.name,
        "rollouts": result.enqueued,
        "succeeded": result.succeeded,
        "failed": dict(result.failed),
        "lost": result.lost,
        "twice": result.executed_twice,
        "flipped": result.flipped,
        "bad_reward": result.bad_reward,
        "seconds": result.seconds,
    }
