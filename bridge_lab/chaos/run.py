"""Chaos scenarios against a real local stack: kill, pause and corrupt things, then audit the Store.

`python -m bridge chaos` starts Redis, the Store, WebShop, the LLM stand-in, two workers and the bridge,
runs each scenario on at least 100 rollouts (``max_attempts`` 3, retry on failed/unresponsive/timeout)
and prints one line per scenario:

* lost: rollouts not finished by the scenario's deadline;
* twice: attempts executed twice in effect (two episode executions in one attempt, or two final reports);
* flipped: rollouts whose status changed after they were first seen finished (a late report);
* bad reward: succeeded attempts whose reward is not what the WebShop server's purchase ledger says.

All four must be 0, else it exits 1 (counted by ``bridge_lab.chaos.audit``; the faults are
``bridge_lab.chaos.scenarios``; ``tests/integration/test_chaos.py`` drives the same scenarios).
Everything listens on 127.0.0.1 and every wait is bounded. ``--agl v1`` runs the Agent Lightning 1.0 line's
scenarios instead, on a real 1.0 gateway (``bridge_lab.chaos.v1``). See docs/operations.md, "Failure classes
and chaos runs".
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bridge.core.store import StoreClient
from bridge_lab.chaos.audit import conclude, format_table
from bridge_lab.chaos.scenarios import (
    CHAOS_DISPATCHER_ID,
    CHAOS_ENV,
    CHAOS_QUEUE,
    HELD_QUEUE,
    MALFORMED,
    RETRY_CONFIG,
    SCENARIOS,
    Scenario,
)
from bridge_lab.chaos.state import ChaosRun, ScenarioResult
from bridge_lab.chaos.v1 import V1_SCENARIOS, main_v1
from bridge_lab.procs import ManagedProcess
from bridge_lab.rabbitmq import is_amqp_url, purge
from bridge_lab.stack import LocalStack, StackConfig

__all__ = [  # what the chaos tests drive, in one import
    "MALFORMED",
    "SCENARIOS",
    "ChaosRun",
    "Scenario",
    "ScenarioResult",
    "format_table",
    "run_scenario",
    "run_with_fault",
]


def scenario_stack(
    services: LocalStack, scenario: Scenario, log_dir: Path, workers: int, concurrency: int, agent: str | None = None
) -> LocalStack:
    """Workers and a bridge over the shared services; a scenario with fault knobs gets its own WebShop/LLM.
    ``agent``: the ``AGENT`` of workers and bridge (default: the built-in WebShop agent)."""
    overrides = dict(scenario.stack_overrides)
    agent_env = {"AGENT": agent} if agent else {}
    own_env = any(k.startswith(("env_", "policy_")) for k in overrides)
    return LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            redis_url=services.redis_url or None,
            webshop_url=None if own_env else services.webshop_url,
            llm_base_url=None if own_env else services.llm_base_url,
            workers=workers,
            concurrency=concurrency,
            log_dir=log_dir,
            extra_env={**CHAOS_ENV, "BRIDGE_DISPATCHER_ID": CHAOS_DISPATCHER_ID, **agent_env, **scenario.env},
            **overrides,
        )
    )


def reset_between_scenarios(services: LocalStack) -> None:
    """No unfinished rollout and no broker state leaks from one scenario into the next."""
    with StoreClient(services.store_url, retries=3) as store:
        unfinished, _ = store.list_rollouts(status_in=["queuing", "requeuing", "preparing", "running"])
        for item in unfinished:
            with contextlib.suppress(Exception):
                store.update_rollout(item.rollout_id, status="cancelled")
    redis.Redis.from_url(services.redis_url or services.broker_url).flushdb()
    if is_amqp_url(services.broker_url):  # Redis lists went with the flush; RabbitMQ queues are emptied here
        purge(services.broker_url, [CHAOS_QUEUE, HELD_QUEUE])


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
    agent: str | None = None,
) -> ScenarioResult:
    """Start workers and bridge, enqueue, inject the fault, wait (bounded), tear down, audit."""
    reset_between_scenarios(services)
    started = time.monotonic()
    stack = scenario_stack(services, scenario, log_dir, workers, concurrency, agent)
    stack.start()
    try:
        with StoreClient(stack.store_url, retries=3) as store:
            config = {**RETRY_CONFIG, **scenario.rollout_config}
            inputs = scenario.inputs(tasks)
            rollouts = store.enqueue(
                [{"input": item, "mode": scenario.mode_of(i), "config": config} for i, item in enumerate(inputs)]
            )
        run = ChaosRun(services, stack, [r.rollout_id for r in rollouts], borrowed)
        result = run_with_fault(run, scenario.fault, deadline_s)
        run.close()
    finally:
        stack.stop()
    result.name = scenario.name
    result.seconds = round(time.monotonic() - started, 1)
    return result


def run_with_fault(run: ChaosRun, fault: Callable[[ChaosRun], None], deadline_s: float) -> ScenarioResult:
    """Observe ``run``'s rollouts while ``fault`` runs beside them, wait (bounded) until every rollout finished and
    the fault returned, and audit. A fault that raises is noted ("fault injection error"), never lost."""
    observer = threading.Thread(target=run.observe, name="chaos-observer", daemon=True)
    observer.start()
    faulting = threading.Thread(target=_guarded, args=(fault, run), name="chaos-fault", daemon=True)
    faulting.start()
    run.wait_for(lambda: run.complete and not faulting.is_alive(), deadline_s)
    return conclude(run, faulting, observer)


def _guarded(fault: Callable[[ChaosRun], None], run: ChaosRun) -> None:
    try:
        fault(run)
    except Exception as exc:  # a fault that breaks must show in the report, not kill the run silently
        run.note(f"fault injection error: {exc!r}")


# --- CLI -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument(
        "--agl",
        choices=["03", "v1"],
        default="03",
        help="the line to shake: 03 (the Store and the bridge, default) or v1 (1.0's gateway and `bridge v1`)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted({*SCENARIOS, *V1_SCENARIOS}),
        help="run only these (repeatable; the v1-* ones with --agl v1)",
    )
    parser.add_argument(
        "--rollouts", type=int, default=None, help="rollouts per scenario (default 100; 20 with --agl v1)"
    )
    parser.add_argument(
        "--program-s", type=float, default=4.0, help="--agl v1: how long each agent program runs (default 4)"
    )
    parser.add_argument(
        "--gateway-pause-s",
        type=float,
        default=20.0,
        help="--agl v1: how long the gateway's process is stopped (SIGSTOP) in v1-gateway-pause (default 20)",
    )
    parser.add_argument(
        "--proxy-pause-s",
        type=float,
        default=30.0,
        help="--agl v1: how long each of v1-proxy-pause's two weight-update pauses (/proxy/pause) lasts (default 30)",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=None, help="slots per worker (default 8; 4 with --agl v1)")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds a scenario may take (default 240)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument(
        "--broker-url", default=None, help="use this broker (Redis, or RabbitMQ: amqp://...) instead of starting Redis"
    )
    parser.add_argument("--redis-url", default=None, help="coordination Redis beside a RabbitMQ broker (else started)")
    parser.add_argument(
        "--agent", default=None, help="AGENT of the workers and the bridge, e.g. a LitAgent path (default: webshop)"
    )


def main(args: argparse.Namespace) -> int:
    """Start the services once, run the scenarios one by one, print the table; exit 1 if any zero is not."""
    from webshop_env.goals import load_tasks

    # SIGTERM unwinds like Ctrl-C, so every process started here is stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.agl == "v1":
        args.rollouts = 20 if args.rollouts is None else args.rollouts
        args.concurrency = 4 if args.concurrency is None else args.concurrency
        return main_v1(args)
    args.rollouts = 100 if args.rollouts is None else args.rollouts
    args.concurrency = 8 if args.concurrency is None else args.concurrency
    names = args.scenario or list(SCENARIOS)
    wrong = [name for name in names if name not in SCENARIOS]
    if wrong:
        print(f"error: {', '.join(wrong)} run with --agl v1", file=sys.stderr)
        return 2
    services = LocalStack(
        StackConfig(
            broker_url=args.broker_url,
            redis_url=args.redis_url,
            broker_persistent=True,
            workers=0,
            bridge=False,
            log_dir=args.log_dir,
        )
    )
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
                    agent=args.agent,
                )
            )
            print(format_table(results[-1:]), flush=True)
    finally:
        services.stop()
    print(format_table(results))
    print(f"logs: {services.log_dir}")
    return 0 if all(r.clean for r in results) else 1
