"""Several worker hosts on one machine: Linux network namespaces on a private subnet, real network faults.

`python -m bridge cluster` (as root on Linux) builds N worker hosts and one bridge host as network
namespaces, each with its own host name and a veth link to a private 10.2xx.x.0/24 subnet it picks and
removes again; Redis, the Store, the WebShop server and the LLM stand-in listen on the subnet's root side.
Scenarios:

* scale-out: the same latency-bound workload (LLM calls of --latency-ms) on 1..N worker hosts: throughput,
  its ratio to one host's, and one distinct node name per host in Celery's ping, `status` and the Store;
* host-loss: SIGKILL every process of one worker host mid-run; time until every rollout it held runs again
  on another host, against the bound lease + reconcile interval + confirming scan;
* partition: one worker host's link down for longer than the lease, then up: its attempts are taken over,
  nothing it reports later takes effect, and it takes new work by itself;
* broker-restart, store-outage: the chaos suite's Redis restart and Store outage, across the network.

Every run is audited like `python -m bridge chaos`: lost, executed twice, flipped, bad reward must all be 0.
Short intervals by default (heartbeat 1 s, lease 4 s, reconcile 5 s); --default-intervals uses the product's
(10 s, 30 s, 20 s). Namespaces, links and addresses are removed on every exit path; a crashed run's leftovers
by the next run (or --clean-only). See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from bridge_lab.chaos.audit import format_table
from bridge_lab.cluster import scenarios
from bridge_lab.cluster.bed import BedConfig, ClusterResult, TestBed
from bridge_lab.cluster.netns import ClusterUnavailable, remove_leftovers, unavailable_reason
from bridge_lab.render import to_text

SCENARIOS = ("scale-out", "host-loss", "partition", "broker-restart", "store-outage")
FIGURES = (
    "seconds_to_finish",
    "throughput_per_s",
    "slots",
    "ratio_to_first",
    "held",
    "recovery_s",
    "bound_s",
    "partition_s",
    "node_back_after_s",
    "second_batch_on_returned_host",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable)")
    parser.add_argument("--hosts", type=int, default=3, help="worker hosts (default 3; scale-out runs 1..N)")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker node (default 4)")
    parser.add_argument("--pool", default="prefork", choices=("prefork", "threads"), help="Celery pool")
    parser.add_argument("--rollouts", type=int, default=48, help="rollouts per run (default 48)")
    parser.add_argument("--latency-ms", type=float, default=500.0, help="LLM stand-in latency per call (500)")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds a run may take (default 300)")
    parser.add_argument("--default-intervals", action="store_true", help="product lease/heartbeat/reconcile")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="a setting of workers and bridge (repeatable)"
    )
    parser.add_argument(
        "--rabbitmq",
        nargs="?",
        const="amqp://guest:guest@127.0.0.1:5672//",
        default=None,
        metavar="URL",
        help="RabbitMQ as broker (a vhost of the run's own on the server at URL, default the local one)",
    )
    parser.add_argument("--clean-only", action="store_true", help="remove leftovers of crashed runs and exit")


def run_scenario(bed: TestBed, name: str, tasks: list[dict[str, Any]], deadline_s: float) -> list[ClusterResult]:
    """One named scenario on an open bed (the integration tests call this too)."""
    count = len(bed.worker_hosts)
    if name == "scale-out":
        return scenarios.scale_out(bed, tasks, list(range(1, count + 1)), deadline_s)
    fault = {
        "host-loss": scenarios.host_loss,
        "partition": scenarios.partition,
        "broker-restart": scenarios.broker_restart,
        "store-outage": scenarios.store_outage,
    }[name]
    return [bed.run(name, count, tasks, fault, deadline_s)]


def figures_table(results: list[ClusterResult]) -> str:
    """The measured figures, one row per run, then any errors a scenario's own checks found."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("run")
    table.add_column("hosts", justify="right")
    for name in FIGURES:
        table.add_column(name.replace("_", " "), justify="right")
    for r in results:
        table.add_row(r.audit.name, str(r.hosts), *(str(r.figures.get(name, "-")) for name in FIGURES))
    lines = [to_text(table)]
    for r in results:
        lines.append(f"  {r.audit.name}: executors by host {r.figures.get('worker_ids')}")
        if "celery_nodes" in r.figures:
            lines.append(
                f"  {r.audit.name}: ping {r.figures['celery_nodes']}, status {r.figures.get('status_workers')}"
            )
        lines += [f"  {r.audit.name} error: {e}" for e in r.figures.get("errors", [])]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Build the bed, run the scenarios, print the audit and the figures; 1 if a zero or a check failed."""
    from webshop_env.goals import load_tasks

    if args.clean_only:
        print(f"removed: {remove_leftovers() or 'nothing'}")
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"cannot build a cluster here: {reason}", file=sys.stderr)
        return 2
    config = BedConfig(
        hosts=args.hosts,
        concurrency=args.concurrency,
        pool=args.pool,
        policy_latency_ms=args.latency_ms,
        default_intervals=args.default_intervals,
        log_dir=args.log_dir,
        overrides=dict(item.split("=", 1) for item in args.env),
        rabbitmq_url=args.rabbitmq,
    )
    results: list[ClusterResult] = []
    try:
        with TestBed(config).open(lambda message: print(message, flush=True)) as bed:
            tasks = load_tasks("test", args.rollouts, 0)
            for name in args.scenario or SCENARIOS:
                print(f"running {name} ...", flush=True)
                new = run_scenario(bed, name, tasks, args.deadline)
                results += new
                print(format_table([r.audit for r in new]) + "\n" + figures_table(new), flush=True)
            log_dir = bed.log_dir
    except ClusterUnavailable as error:
        print(f"cannot build a cluster here: {error}", file=sys.stderr)
        return 2
    print(format_table([r.audit for r in results]))
    print(figures_table(results))
    print(f"logs: {log_dir}")
    return 0 if all(r.clean for r in results) else 1
