"""Chaos scenarios against a real local stack: kill, pause and corrupt things, then audit the Store.

`python -m bridge chaos` starts Redis, the Store, WebShop, the LLM stand-in, two workers and the bridge,
runs each scenario on at least 100 rollouts (``max_attempts`` 3, retry on failed/unresponsive/timeout)
and prints one line per scenario:

* lost: rollouts not finished by the scenario's deadline;
* twice: attempts executed twice in effect: spans of two episode executions in one attempt (two
  distinct ``webshop.episode`` roots), or two final reports for one attempt in the worker logs;
* flipped: rollouts whose status changed after they were first seen finished (a late report);
* bad reward: succeeded attempts whose reward is not what the WebShop server's purchase ledger says.

All four must be 0 (counted by ``bridge.tools.chaos.audit``). The tests in ``tests/test_chaos.py`` drive the
same scenarios and assert it.
Everything listens on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bridge.core import keys
from bridge.core.models import ACTIVE_ROLLOUT, FINISHED_ROLLOUT, AttemptedRollout
from bridge.core.store import StoreClient
from bridge.tools.chaos.audit import ScenarioResult, audit, format_table
from bridge.tools.stack import LocalStack, ManagedProcess, StackConfig

TASK_NAME = "workers.run_rollout"  # workers.app.TASK_NAME; not imported: that module needs worker settings
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
    name: str
    fault: Callable[[ChaosRun], None]
    inputs: Callable[[list[dict[str, Any]]], list[Any]] = lambda tasks: list(tasks)
    stack_overrides: dict[str, Any] = field(default_factory=dict)
    rollout_config: dict[str, Any] = field(default_factory=dict)


class ChaosRun:
    """One scenario in progress: its stack, its rollouts, and an observer that records flips."""

    def __init__(
        self,
        services: LocalStack,
        stack: LocalStack,
        rollout_ids: list[str],
        borrowed: dict[str, ManagedProcess] | None = None,
    ) -> None:
        self.services = services
        self.borrowed = borrowed or {}
        self.stack = stack
        self.rollout_ids = rollout_ids
        self.store = StoreClient(stack.store_url, retries=3, timeout_s=20)
        self.redis = redis.Redis.from_url(stack.broker_url, socket_timeout=2)
        self.first_final: dict[str, str] = {}
        self.flipped: set[str] = set()
        self.latest: dict[str, AttemptedRollout] = {}
        self.stop = threading.Event()
        self.notes: list[str] = []

    def observe_once(self) -> None:
        with contextlib.suppress(Exception):  # the Store may be paused on purpose: try again next round
            rollouts, _ = self.store.list_rollouts(rollout_ids=self.rollout_ids)
            for item in rollouts:
                if isinstance(item, AttemptedRollout):
                    self.latest[item.rollout_id] = item
                first = self.first_final.get(item.rollout_id)
                if first is None and item.status in FINISHED_ROLLOUT:
                    self.first_final[item.rollout_id] = item.status
                elif first is not None and item.status != first:
                    self.flipped.add(item.rollout_id)

    def observe(self) -> None:
        while not self.stop.wait(0.5):
            self.observe_once()

    @property
    def finished(self) -> int:
        return len(self.first_final)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if predicate():
                return True
            time.sleep(0.3)
        return False

    def wait_progress(self, finished: int, timeout_s: float, *, running: bool = True) -> bool:
        """Until ``finished`` rollouts are done (and, if asked, some attempt is running): a fault hits mid-run."""
        return self.wait_for(lambda: self.finished >= finished and (not running or bool(self.running())), timeout_s)

    def share(self, fraction: float) -> int:
        """How many finished rollouts make ``fraction`` of this run: faults are placed by progress, not time."""
        return max(1, int(len(self.rollout_ids) * fraction))

    def running(self) -> list[AttemptedRollout]:
        """Rollouts whose latest attempt an executor holds right now (workers send no `running` mark)."""
        return [r for r in self.latest.values() if r.status in ACTIVE_ROLLOUT and self.executor_pid(r) is not None]

    def executor_pid(self, rollout: AttemptedRollout) -> int | None:
        """The process holding the attempt's lease, whose token starts ``host:pid:thread`` (workers.lease)."""
        try:
            token = self.redis.get(keys.lease(rollout.attempt.attempt_id))
        except redis.RedisError:  # restarting on purpose: nothing to pick this round
            return None
        parts = token.decode().split(":") if isinstance(token, bytes) else []
        return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None

    def process(self, name: str) -> ManagedProcess | None:
        """A service process this run may pause or restart (its own, or one borrowed from the caller)."""
        return self.services.processes.get(name) or self.borrowed.get(name)

    def note(self, text: str) -> None:
        self.notes.append(text)


# --- faults --------------------------------------------------------------------------------------


def _kill_an_executor(run: ChaosRun, killed: set[int], timeout_s: float = 30.0) -> int | None:
    """SIGKILL a pool process while it runs an episode; returns its pid once a kill really landed.

    The observer's view is up to half a second old (an episode here lasts about two), so each candidate
    is read back from the Store right before the kill, and its lease from Redis: its attempt must still be
    active and held by that process. A pid already gone (killed in an earlier round) is skipped.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        candidates = [
            r for r in run.latest.values() if r.status in ACTIVE_ROLLOUT and run.executor_pid(r) not in killed | {None}
        ]
        random.shuffle(candidates)
        for seen in candidates:
            try:
                now = run.store.get_rollout(seen.rollout_id, retries=0, timeout=2)
            except Exception:  # the Store is busy: try the next candidate
                continue
            if not isinstance(now, AttemptedRollout) or now.status not in ACTIVE_ROLLOUT:
                continue
            pid = run.executor_pid(now)
            if pid is None or now.attempt.attempt_id != seen.attempt.attempt_id or pid in killed:
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
    """SIGKILL a pool process mid-episode 3 times, then a worker's main process 3 times (replaced each time)."""
    killed: set[int] = set()
    for round_ in range(3):
        run.wait_progress(run.share(0.1 * (round_ + 1)), 90)
        pid = _kill_an_executor(run, killed)
        if pid is not None:
            run.note(f"killed pool process {pid}")
    for round_ in range(3):
        run.wait_progress(run.share(0.4 + 0.15 * round_), 90)
        victim = next((w for w in run.stack.workers if w.alive()), None)
        if victim is None or victim.pid is None:
            break
        os.kill(victim.pid, signal.SIGKILL)
        run.stack.workers.remove(victim)
        run.note(f"killed worker main process {victim.pid} ({victim.name})")
        run.stack.add_worker()


def restart_redis(run: ChaosRun) -> None:
    """Restart the broker's Redis (append-only file kept) while rollouts are in flight."""
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
    os.killpg(store.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.killpg(store.pid, signal.SIGCONT)
    run.note(f"paused the Store for {seconds:.0f}s")


def kill_bridge(run: ChaosRun) -> None:
    """SIGKILL the bridge, leave rollouts claimed but never published (as a crash right after a dequeue
    would), start the bridge again: its reconciliation must publish them."""
    for round_ in range(2):
        run.wait_progress(run.share(0.25 + 0.35 * round_), 120, running=False)
        bridge = run.stack.processes["bridge"]
        bridge.signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            bridge.proc.wait(timeout=10)  # type: ignore[union-attr]
        claimed = run.store.dequeue(5, CHAOS_DISPATCHER_ID)
        run.note(f"killed the bridge; {len(claimed)} rollouts left claimed and unpublished")
        run.stack.start_bridge()


def redeliver_running(run: ChaosRun) -> None:
    """Publish the message of running (and of finished) attempts again, same task id, while they run."""
    from celery import Celery

    app = Celery("chaos", broker=run.stack.broker_url)
    sent = 0
    try:
        for _ in range(4):
            run.wait_for(lambda: len(run.running()) >= 3, 60)
            for rollout in run.running()[:5]:
                payload = rollout.model_dump(mode="json")
                app.send_task(
                    TASK_NAME,
                    kwargs={"rollout": payload, "queue": "rollouts"},
                    task_id=rollout.attempt.attempt_id,
                    queue="rollouts",
                )
                sent += 1
            time.sleep(2.0)
        done = [r for r in run.latest.values() if r.status in FINISHED_ROLLOUT][:5]
        for rollout in done:
            app.send_task(
                TASK_NAME,
                kwargs={"rollout": rollout.model_dump(mode="json"), "queue": "rollouts"},
                task_id=rollout.attempt.attempt_id,
                queue="rollouts",
            )
            sent += 1
    finally:
        app.close()
    run.note(f"re-published {sent} messages of running or finished attempts")


def no_fault(run: ChaosRun) -> None:
    """Faults come from the environment and the LLM (stack overrides) or from the inputs."""


def with_malformed(tasks: list[dict[str, Any]]) -> list[Any]:
    mixed: list[Any] = list(tasks[: max(0, len(tasks) - len(MALFORMED))])
    for i, bad in enumerate(MALFORMED):
        mixed.insert((i * 5) % (len(mixed) + 1), bad)
    return mixed


CHAOS_DISPATCHER_ID = "chaos-bridge"
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
    "kill-bridge": Scenario("kill-bridge", kill_bridge, stack_overrides=MID_EPISODE),
    "redeliver": Scenario("redeliver", redeliver_running, stack_overrides=MID_EPISODE),
    "malformed": Scenario("malformed", no_fault, inputs=with_malformed),
}


# --- running and auditing ------------------------------------------------------------------------


def scenario_stack(
    services: LocalStack, scenario: Scenario, log_dir: Path, workers: int, concurrency: int
) -> LocalStack:
    """Workers and a bridge over the shared services; a scenario with fault knobs gets its own WebShop/LLM."""
    overrides = dict(scenario.stack_overrides)
    own_env = any(k.startswith(("env_", "policy_")) for k in overrides)
    return LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=None if own_env else services.webshop_url,
            llm_base_url=None if own_env else services.llm_base_url,
            workers=workers,
            concurrency=concurrency,
            log_dir=log_dir,
            extra_env={**CHAOS_ENV, "BRIDGE_DISPATCHER_ID": CHAOS_DISPATCHER_ID},
            **overrides,
        )
    )


def reset_between_scenarios(services: LocalStack) -> None:
    """No unfinished rollout and no broker state leaks from one scenario into the next."""
    import redis

    with StoreClient(services.store_url, retries=3) as store:
        unfinished, _ = store.list_rollouts(status_in=["queuing", "requeuing", "preparing", "running"])
        for item in unfinished:
            with contextlib.suppress(Exception):
                store.update_rollout(item.rollout_id, status="cancelled")
    redis.Redis.from_url(services.broker_url).flushdb()


def run_scenario(
    services: LocalStack,
    scenario: Scenario,
    tasks: list[dict[str, Any]],
    log_dir: Path,
    *,
    workers: int = 2,
    concurrency: int = 8,
    deadline_s: float = 240.0,
    borrowed: dict[str, ManagedProcess] | None = None,
) -> ScenarioResult:
    """Start workers and bridge, enqueue, inject the fault, wait (bounded), tear down, audit."""
    reset_between_scenarios(services)
    started = time.monotonic()
    stack = scenario_stack(services, scenario, log_dir, workers, concurrency)
    stack.start()
    try:
        with StoreClient(stack.store_url, retries=3) as store:
            config = {**RETRY_CONFIG, **scenario.rollout_config}
            inputs = scenario.inputs(tasks)
            rollouts = store.enqueue([{"input": item, "mode": "test", "config": config} for item in inputs])
        run = ChaosRun(services, stack, [r.rollout_id for r in rollouts], borrowed)
        observer = threading.Thread(target=run.observe, name="chaos-observer", daemon=True)
        observer.start()
        fault = threading.Thread(target=_guarded, args=(scenario.fault, run), name="chaos-fault", daemon=True)
        fault.start()
        run.wait_for(lambda: run.finished >= len(run.rollout_ids) and not fault.is_alive(), deadline_s)
        time.sleep(3.0)  # a late report would land now: give it the chance to flip something
        run.observe_once()
        run.stop.set()
        fault.join(timeout=30)
        observer.join(timeout=10)
        result = audit(run, stack)
        run.redis.close()
        run.store.close()
    finally:
        stack.stop()
    result.name = scenario.name
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _guarded(fault: Callable[[ChaosRun], None], run: ChaosRun) -> None:
    try:
        fault(run)
    except Exception as exc:  # a fault that breaks must show in the report, not kill the run silently
        run.note(f"fault injection error: {exc!r}")


# --- CLI -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="run only these (repeatable)")
    parser.add_argument("--rollouts", type=int, default=100, help="rollouts per scenario (default 100)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="slots per worker (default 8)")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds a scenario may take (default 240)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")


def main(args: argparse.Namespace) -> int:
    """Start the services once, run the scenarios one by one, print the table; exit 1 if any zero is not."""
    from webshop_env.goals import load_tasks

    names = args.scenario or list(SCENARIOS)
    # SIGTERM unwinds like Ctrl-C, so every process started here is stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    services = LocalStack(StackConfig(broker_persistent=True, workers=0, bridge=False, log_dir=args.log_dir))
    services.start_services(lambda message: print(message, flush=True))
    results: list[ScenarioResult] = []
    try:
        tasks = load_tasks("test", args.rollouts, 0)
        for name in names:
            print(f"running {name} ...", flush=True)
            results.append(
                run_scenario(
                    services,
                    SCENARIOS[name],
                    tasks,
                    services.log_dir / name,
                    workers=args.workers,
                    concurrency=args.concurrency,
                    deadline_s=args.deadline,
                )
            )
            print(format_table(results[-1:]), flush=True)
    finally:
        services.stop()
    print(format_table(results))
    print(f"logs: {services.log_dir}")
    return 0 if all(r.clean for r in results) else 1
