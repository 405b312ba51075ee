"""measure scale-up and scale-down: a burst of rollouts, workers started by `python -m bridge autoscale`

A local stack (Store, Redis, WebShop server, LLM stand-in with --llm-latency-ms, the bridge with its metrics)
starts with no worker at all. --rollouts rollouts are enqueued at once and `python -m bridge autoscale`
follows agl_bridge_desired_slots from the bridge's /metrics, starting up to --max-workers `-P threads`
workers of --slots-per-worker slots. Sampled every 0.5 s from Redis (slot adverts, in-flight entries) and the
Store: seconds from the enqueue until the bridge's desired slots show the burst, the autoscaler starts its first
worker, the first slot is advertised, the first and then every target slot is taken (a rollout published to
it), every rollout finished, and until the last worker left after the backlog drained (it
scales down one worker per --scale-down-after). The audit: every rollout succeeded once (none lost or run
twice). Figures and recipes: docs/operations.md, "Autoscaling".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bridge.core.coordination import capacity, coordination_client
from bridge.core.store import FINISHED_ROLLOUT, RolloutStatus, StoreClient
from bridge.ops.autoscale import scrape_desired
from bridge_lab.bench.run import load_inputs
from bridge_lab.procs import PYTHON
from bridge_lab.render import key_value_table, show
from bridge_lab.stack import LocalStack, StackConfig

QUEUE = "rollouts"
SAMPLE_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add = parser.add_argument
    add("--rollouts", type=int, default=200, help="rollouts in the burst (default 200)")
    add("--slots-per-worker", type=int, default=16, help="slots per worker process (default 16)")
    add("--max-workers", type=int, default=4, help="the autoscaler's maximum (default 4)")
    add("--llm-latency-ms", type=float, default=500.0, help="stand-in latency per LLM call (default 500)")
    add("--scale-down-after", type=float, default=10.0, help="the autoscaler's scale-down window (default 10 s)")
    add("--timeout-s", type=float, default=900.0, help="give up after this long (default 900)")
    add("--log-dir", type=Path, default=None, help="where component logs go (default: a temp dir)")
    add("--json", action="store_true", help="print the figures as one JSON object on the last line")


def main(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.slots_per_worker < 1 or args.max_workers < 1:
        print("error: --rollouts, --slots-per-worker and --max-workers must be at least 1", file=sys.stderr)
        return 2
    config = StackConfig(
        workers=0,
        pool="threads",
        concurrency=args.slots_per_worker,
        bridge_metrics_port=0,
        policy_latency_ms=args.llm_latency_ms,
        log_dir=args.log_dir,
    )
    with LocalStack(config) as stack:
        print(f"logs of every process: {stack.log_dir}", file=sys.stderr)
        figures = measure(stack, args)
    show(key_value_table(figures.items(), title="scale-up and scale-down"), sys.stdout)
    if args.json:
        print(json.dumps(figures))
    return 0 if figures["succeeded"] == args.rollouts and figures["attempts"] == args.rollouts else 1


def measure(stack: LocalStack, args: argparse.Namespace) -> dict[str, Any]:
    assert stack.bridge_metrics_url, "the bridge serves its metrics"
    argv = [PYTHON, "-m", "bridge", "autoscale", "--metrics-url", stack.bridge_metrics_url, "--queue", QUEUE]
    argv += ["--slots-per-worker", str(args.slots_per_worker), "--max-workers", str(args.max_workers)]
    argv += ["--interval", "1", "--scale-down-after", str(args.scale_down_after)]
    redis = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=5)
    target = min(args.max_workers * args.slots_per_worker, args.rollouts)
    marks: dict[str, float] = {}
    with StoreClient(stack.store_url, timeout_s=30.0, retries=3) as store, httpx.Client(timeout=2.0) as http:
        burst = [{"input": task, "mode": "train"} for task in load_inputs("train", args.rollouts)]
        ids = [r.rollout_id for r in store.enqueue(burst)]
        started = time.monotonic()
        stack.spawn("autoscale", argv, lambda: True)
        deadline = started + args.timeout_s
        finished = 0
        while time.monotonic() < deadline:
            desired = scrape_desired(http, stack.bridge_metrics_url, QUEUE)
            slots = capacity.total_slots(redis, stack.scope, QUEUE)
            busy = capacity.inflight_count(redis, stack.scope, QUEUE)
            if finished < len(ids):
                finished = store.list_rollouts(status_in=sorted(FINISHED_ROLLOUT), limit=1)[1]
            elapsed = round(time.monotonic() - started, 1)
            for name, reached in (
                (f"the bridge's desired slots at {target}+", desired is not None and desired >= target),
                ("the autoscaler's first worker", "started worker" in _log(stack)),
                ("first slot advertised", slots > 0),
                ("first slot taken", busy > 0),
                (f"{target} slots taken", busy >= target),
                ("every rollout finished", finished >= len(ids)),
                ("every worker gone", finished >= len(ids) and slots == 0),
            ):
                if reached:
                    marks.setdefault(name, elapsed)
            if "every worker gone" in marks:
                break
            time.sleep(SAMPLE_S)
        rollouts, _ = store.list_rollouts(rollout_ids=ids)
        attempts = sum(len(store.list_attempts(r.rollout_id)) for r in rollouts)
    figures: dict[str, Any] = {f"s to {name}": marks.get(name) for name in marks}
    figures.update(
        rollouts=len(ids),
        succeeded=sum(r.status == RolloutStatus.SUCCEEDED for r in rollouts),
        attempts=attempts,
        workers_started=_log(stack).count("started worker"),
        target_slots=target,
    )
    return figures


def _log(stack: LocalStack) -> str:
    return stack.process("autoscale").log_path.read_text(errors="replace")
