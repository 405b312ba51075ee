"""The chaos scenarios: each a fault injected into a running stack, placed by the run's progress.

``bridge_lab.chaos.run`` starts a stack per scenario, calls its fault in a thread and audits the result.
A fault reads facts to aim (the Store's rollout views, the attempt leases in Redis, the workers' own
list of the tasks they run) and notes what it did, which the tests assert on.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bridge.core.coordination import capacity
from bridge.core.store import ACTIVE_ROLLOUT, FINISHED_ROLLOUT, AttemptedRollout
from bridge.core.task import DEFAULT_AGENT, TASK_NAME, task_kwargs
from bridge_lab.chaos.state import ChaosRun
from bridge_lab.procs import pause_group

CHAOS_DISPATCHER_ID = "chaos-bridge"
CHAOS_QUEUE = "rollouts"  # the default queue
HELD_QUEUE = "rollouts-val"  # cancel-while-held routes val rollouts here
RETRY_CONFIG: dict[str, Any] = {
    "max_attempts": 3,
    "retry_condition": ["failed", "unresponsive", "timeout"],
    "unresponsive_seconds": 30,
    "timeout_seconds": 150,
}
# Short intervals so the heartbeat, the lease and the Store's watchdog all react within a scenario.
CHAOS_ENV = {
    "HEARTBEAT_INTERVAL_S": "1",
    "LEASE_TTL_S": "4",
    "SPAN_FLUSH_INTERVAL_S": "1",
    "STORE_TIMEOUT_S": "5",
    "WEBSHOP_TIMEOUT_S": "2",
    "LLM_MAX_BACKOFF_S": "4",
    "MAX_STEPS": "8",
    "ROLLOUT_DEFAULT_TIMEOUT_S": "150",
    "BRIDGE_MAX_QUEUE_WAIT_S": "60",
    "BROKER_VISIBILITY_TIMEOUT_S": "300",
    "BRIDGE_POLL_MIN_S": "0.3",
    "BRIDGE_POLL_MAX_S": "1.0",
    "LOG_LEVEL": "INFO",
    # Every process shares this host's clock, so the start-up skew check can only misfire: it reads the Store's
    # Date header, which a Store busy with the scenario's load serves seconds stale, and then refuses the worker
    # a fault starts (cancel-while-held's val worker, kill-workers' replacements).
    "CLOCK_SKEW_TOLERANCE_S": "0",
}
# Faults must land mid-episode: at 0 ms an episode lasts a few hundred ms and 100 rollouts finish in seconds,
# before a fault can find one running. 200 ms per LLM call makes episodes last about 1.5 s.
MID_EPISODE: dict[str, Any] = {"policy_latency_ms": 200.0}
MALFORMED: list[Any] = [
    "a string",
    42,
    None,
    [1, 2],
    {},
    {"task_id": "x"},
    {"instruction": 7},
    {"instruction": ["buy"]},
    {"instruction": ""},
    {"instruction": "   "},
    {"instruction": "x" * 1_000_000},
    {"instruction": "buy a shirt", "task_id": 5},
    {"instruction": "buy a shirt", "goal_id": "abc"},
    {"instruction": "buy a shirt", "goal_id": -1},
    {"instruction": "buy a shirt", "goal_id": True},
    {"instruction": {"nested": "object"}},
    {"instruction": "buy a shirt", "task_id": ""},
    {"instruction": "buy a shirt", "task_id": "t" * 500},
    {"instruction": None},
    "",
]


@dataclass
class Scenario:
    """A named fault, the inputs it runs on, and the stack and rollout settings it needs."""

    name: str
    fault: Callable[[ChaosRun], None]
    inputs: Callable[[list[dict[str, Any]]], list[Any]] = lambda tasks: list(tasks)
    stack_overrides: dict[str, Any] = field(default_factory=dict)
    rollout_config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # settings of its workers and bridge, over CHAOS_ENV
    mode_of: Callable[[int], str] = lambda index: "test"  # the mode of the index-th rollout


# --- faults --------------------------------------------------------------------------------------


def _kill_an_executor(run: ChaosRun, killed: set[int], timeout_s: float = 30.0) -> int | None:
    """SIGKILL a pool process while it runs an episode; returns its pid once a kill really landed.

    The observer's view is up to half a second old (an episode here lasts about two), so each candidate
    is read back from the Store right before the kill: its attempt must still be active, leased in Redis,
    and listed by the workers as running in that same process (asked once more, right before the kill).
    A pid already gone (killed in an earlier round) is skipped.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = run.executor_pids()
        candidates = [
            r
            for r in run.latest.values()
            if r.status in ACTIVE_ROLLOUT and pids.get(r.attempt.attempt_id) not in killed | {None}
        ]
        random.shuffle(candidates)
        for seen in candidates:
            aid = seen.attempt.attempt_id
            try:
                now = run.store.get_rollout(seen.rollout_id, retries=0, timeout=2)
            except Exception:  # the Store is busy: try the next candidate
                continue
            if not isinstance(now, AttemptedRollout) or now.status not in ACTIVE_ROLLOUT:
                continue
            if now.attempt.attempt_id != aid or not run.leased(aid):
                continue
            pid = run.executor_pids().get(aid)
            if pid is None or pid in killed:
                continue
            killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return pid
        time.sleep(0.3)
    run.note("no running pool process to kill")
    return None


def kill_workers(run: ChaosRun) -> None:
    """SIGKILL a pool process mid-episode 3 times, then a serving worker's main process 3 times, each replaced by
    a new node that starts while the run goes on (awaiting it would let a short run end before the last rounds).
    A round the run outlives is skipped, with a note."""
    killed: set[int] = set()
    for round_ in range(3):
        if not _progress(run, run.share(0.1 * (round_ + 1)), f"pool kill {round_ + 1}"):
            continue
        pid = _kill_an_executor(run, killed)
        if pid is not None:
            run.note(f"killed pool process {pid}")
    for round_ in range(3):
        if not _progress(run, run.share(0.4 + 0.15 * round_), f"main kill {round_ + 1}"):
            continue
        victim = next((w for w in run.stack.workers if w.alive() and w.healthy()), None)
        if victim is None or victim.pid is None:
            run.note(f"main kill {round_ + 1} skipped: no worker was serving")
            continue
        os.kill(victim.pid, signal.SIGKILL)
        run.stack.workers.remove(victim)
        run.note(f"killed worker main process {victim.pid} ({victim.name})")
        run.stack.add_worker(wait=False)


def _progress(run: ChaosRun, finished: int, fault: str) -> bool:
    """``run.wait_progress``, noting why the fault is skipped when it returns False."""
    if run.wait_progress(finished, 90):
        return True
    run.note(f"{fault} skipped: {'the run had finished' if run.complete else 'no progress within 90 s'}")
    return False


def restart_redis(run: ChaosRun) -> None:
    """Restart the broker (Redis with its append-only file kept, or a private RabbitMQ node the caller lent as
    ``rabbitmq``: durable queues, persistent messages) while rollouts are in flight."""
    rabbit = run.process("rabbitmq")
    if rabbit is not None:
        run.wait_progress(run.share(0.3), 120)
        rabbit.stop(timeout_s=30.0)  # SIGTERM: the node writes its queues' state before it exits
        rabbit.start()
        rabbit.wait_healthy()
        run.note("restarted RabbitMQ")
        return
    if "redis" not in run.services.processes:
        run.note("skipped: the broker was not started by this stack")
        return
    run.wait_progress(run.share(0.3), 120)
    run.services.restart("redis")  # SIGTERM: Redis syncs its append-only file first
    run.note("restarted Redis")


def pause_store(run: ChaosRun, seconds: float = 15.0) -> None:
    """Stop the Store's traffic for 15 s (SIGSTOP), then let it through (SIGCONT)."""
    store = run.process("store")
    if store is None or store.pid is None:
        run.note("skipped: the Store was not started by this stack")
        return
    run.wait_progress(run.share(0.3), 120)
    pause_group(store.pid, seconds)
    run.note(f"paused the Store for {seconds:.0f}s")


def kill_bridge(run: ChaosRun) -> None:
    """SIGKILL the bridge, leave rollouts claimed but never published (as a crash right after a dequeue
    would) and rollouts claimed and recorded in flight whose message never reached the broker (a crash
    inside the publish, whose broker retries last seconds), start the bridge again: its reconciliation
    must publish the first kind and, once their entries pass ``BRIDGE_MAX_QUEUE_WAIT_S``, free the
    second kind's slots and hand them back (a fault-injection error is noted if their slots stay taken)."""
    stranded: set[str] = set()
    for round_ in range(2):
        run.wait_progress(run.share(0.25 + 0.35 * round_), 120, running=False)
        bridge = run.stack.processes["bridge"]
        bridge.signal(signal.SIGKILL)
        if bridge.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                bridge.proc.wait(timeout=10)
        claimed = run.store.dequeue(5, CHAOS_DISPATCHER_ID)
        in_window = run.store.dequeue(5, CHAOS_DISPATCHER_ID)
        for rollout in in_window:  # what ``Dispatcher.dispatch`` records before the publish that never ended
            capacity.mark_inflight(run.redis, run.stack.scope, CHAOS_QUEUE, rollout.attempt.attempt_id)
            stranded.add(rollout.attempt.attempt_id)
        run.note(
            f"killed the bridge; {len(claimed)} rollouts left claimed and unpublished, "
            f"{len(in_window)} recorded in flight with no message"
        )
        run.stack.start_bridge()
    # The longest queue wait, two reconcile scans, the hand-back: well within two minutes.
    started = time.monotonic()
    run.wait_for(lambda: not stranded & capacity.inflight_ids(run.redis, run.stack.scope, CHAOS_QUEUE), 120)
    left = stranded & capacity.inflight_ids(run.redis, run.stack.scope, CHAOS_QUEUE)
    if left:
        run.note(f"error: {len(left)} of {len(stranded)} in-flight entries with no message still hold a slot")
    else:
        run.note(f"{len(stranded)} in-flight entries with no message freed {time.monotonic() - started:.0f}s later")


def redeliver_running(run: ChaosRun) -> None:
    """Publish the message of running (and of finished) attempts again, same task id, while they run."""
    app = run.celery()
    sent = 0

    def publish(rollout: AttemptedRollout) -> None:
        nonlocal sent
        kwargs = task_kwargs(rollout, CHAOS_QUEUE, run.stack.config.extra_env.get("AGENT", DEFAULT_AGENT))
        app.send_task(TASK_NAME, kwargs=kwargs, task_id=rollout.attempt.attempt_id, queue=CHAOS_QUEUE)
        sent += 1

    for _ in range(4):
        run.wait_for(lambda: len(run.running()) >= 3, 60)
        for rollout in run.running()[:5]:
            publish(rollout)
        time.sleep(2.0)
    for rollout in [r for r in run.latest.values() if r.status in FINISHED_ROLLOUT][:5]:
        publish(rollout)
    run.note(f"re-published {sent} messages of running or finished attempts")


def cancel_while_held(run: ChaosRun) -> None:
    """Cancel half of the val rollouts while the bridge holds them (no worker consumes their queue yet),
    then start a val worker: the cancelled ones must stay cancelled, the rest run."""

    def held() -> list[AttemptedRollout]:
        views = [run.latest.get(rid) for rid in run.rollout_ids]
        return [r for r in views if isinstance(r, AttemptedRollout) and r.mode == "val" and r.status == "preparing"]

    run.wait_for(lambda: len(held()) >= 4, 60)
    cancelled = [r.rollout_id for r in held()][::2]
    for rid in cancelled:
        run.store.update_rollout(rid, status="cancelled")
    run.note(f"cancelled {len(cancelled)} of {len(held()) + len(cancelled)} held val rollouts")
    time.sleep(3.0)  # a reconcile scan (BRIDGE_RECONCILE_INTERVAL_S below) drops them from the hold
    run.stack.config.queues = HELD_QUEUE
    run.stack.add_worker()
    run.wait_for(lambda: run.complete, 120)
    ran = [rid for rid in cancelled if (view := run.latest.get(rid)) is not None and view.status != "cancelled"]
    if ran:
        run.note(f"error: {len(ran)} cancelled rollouts did not stay cancelled")


def no_fault(run: ChaosRun) -> None:
    """Faults come from the environment and the LLM (stack overrides) or from the inputs."""


def with_malformed(tasks: list[dict[str, Any]]) -> list[Any]:
    """The tasks with every malformed input spread among them, the total count unchanged."""
    mixed: list[Any] = list(tasks[: max(0, len(tasks) - len(MALFORMED))])
    for i, bad in enumerate(MALFORMED):
        mixed.insert((i * 5) % (len(mixed) + 1), bad)
    return mixed


SCENARIOS: dict[str, Scenario] = {
    "kill-workers": Scenario("kill-workers", kill_workers, stack_overrides=MID_EPISODE),
    "restart-redis": Scenario("restart-redis", restart_redis, stack_overrides=MID_EPISODE),
    "store-outage": Scenario("store-outage", pause_store, stack_overrides=MID_EPISODE),
    "flaky-env-llm": Scenario(
        "flaky-env-llm",
        no_fault,
        stack_overrides={
            "env_error_rate": 0.10,
            "env_timeout_rate": 0.05,
            "env_stall_s": 3.0,
            "policy_error_rate": 0.4,
        },
    ),
    # A queue wait of 25 s instead of 60: the stranded entries it frees are what the scenario waits for.
    "kill-bridge": Scenario(
        "kill-bridge", kill_bridge, stack_overrides=MID_EPISODE, env={"BRIDGE_MAX_QUEUE_WAIT_S": "25"}
    ),
    "redeliver": Scenario("redeliver", redeliver_running, stack_overrides=MID_EPISODE),
    "malformed": Scenario("malformed", no_fault, inputs=with_malformed),
    # The WebShop server answers a NaN reward for a fifth of the purchases: those attempts fail (env) and retry.
    # Episodes of 200 ms per LLM call, as for the other faults: at 0 ms, 16 slots of instant episodes and their
    # retries kept a Store on a loaded 2-core machine slower than STORE_TIMEOUT_S (5 s here) for minutes.
    "non-finite-reward": Scenario(
        "non-finite-reward", no_fault, stack_overrides={**MID_EPISODE, "env_nan_reward_rate": 0.2}
    ),
    # A quarter of the rollouts are val, routed to a queue no worker consumes until the fault starts one.
    "cancel-while-held": Scenario(
        "cancel-while-held",
        cancel_while_held,
        stack_overrides=MID_EPISODE,
        env={"QUEUE_BY_MODE": f"val={HELD_QUEUE}", "BRIDGE_RECONCILE_INTERVAL_S": "1"},
        mode_of=lambda index: "val" if index % 4 == 0 else "test",
    ),
    # Under -P threads, 1% of WebShop requests stall for an hour with no client timeout: an agent blocked
    # outside its LLM calls. Each is abandoned at its deadline (failed, timeout, retried); at 2 stuck threads
    # a worker drains and re-executes itself.
    "blocking-agent": Scenario(
        "blocking-agent",
        no_fault,
        stack_overrides={"pool": "threads", "env_timeout_rate": 0.01, "env_stall_s": 3600.0},
        rollout_config={"timeout_seconds": 20},
        env={"WEBSHOP_TIMEOUT_S": "3600", "WEBSHOP_RETRIES": "0", "MAX_STUCK_AGENT_THREADS": "2"},
    ),
}
