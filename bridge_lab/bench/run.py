"""measure throughput, Store requests, CPU, memory and dispatch latency on a local stack

Starts (or reuses, with the --*-url options) a real `agl store --tracker prometheus`, Redis, the
WebShop server and the LLM stand-in, plus K Celery workers and the bridge; runs a fixed WebShop
workload and prints a table (with --json, one JSON object as the last line). It exits 0 when every
rollout succeeded. Every figure is measured: Store requests from the Store's own Prometheus counters,
CPU and RSS from /proc of each process tree, latencies and durations from the Store's timestamps.

Phases: (1) dispatch probes: rollouts enqueued one by one while slots are free, enqueue -> task start;
(2) the workload: N rollouts enqueued at once; (3) with --peer agl-runner, the same workload run by
Agent Lightning's own runner (n_runners = C) on the same Store, after our workers are stopped; (4) with
--floor, the same workload run by the floor: the same episode in our layout of processes and slots with
only the Store calls it needs (no broker, lease or heartbeat). [ratio_vs_floor] is what our guarantees
cost in throughput net of what our batching saves; [ratio_floor_vs_peer] what dropping the runner's
machinery alone gains on this host.

CPU figures are per rollout over the workload: worker, Store, "Store ceiling" (1000 / Store CPU ms,
the rate one Store core sustains for this executor) and "in all" (every measured process; a service
reused with --*-url is not measured and is left out). "Sustained" figures count only the time every slot
had work; with latency, the sustained efficiency is the slots' share of ideal work (a perfect executor
scores 1) and "slot time" splits the rest into overhead, hand-off and free slots.

Every figure and its JSON key: docs/performance.md, "Reading the figures"; which pool to choose:
docs/operations.md, "Choosing a pool". Numbers on a shared machine are noisy: compare ratios from one
run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bridge_lab.bench import metrics as bm
from bridge_lab.bench.client import BenchClient
from bridge_lab.bench.report import cpu_ratio, ideal, ideal_seconds, print_table, summarize
from bridge_lab.procs import PYTHON, ManagedProcess
from bridge_lab.stack import LocalStack, StackConfig
from bridge_lab.stats import rounded

SOAK_ROLLOUTS = 5000
SOAK_EARLY = 1000
# Windows of finished rollouts over which the Store's CPU per rollout is compared (early vs late in a soak);
# both lie in the steady state, before the last wave drains.
SOAK_WINDOWS = {"early": (1000, 1500), "late": (4400, 4900)}
SOAK_EDGES = sorted({edge for window in SOAK_WINDOWS.values() for edge in window})
STAND_IN_MODEL = "webshop-heuristic"
EXECUTORS = {
    "peer": "Agent Lightning's runner",
    "floor": "the floor (bridge_lab.bench.floor: no broker, lease, heartbeat or report journal)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    add = parser.add_argument
    add("--rollouts", type=int, default=200, help="rollouts in the workload (default 200)")
    add("--llm-latency-ms", type=float, default=0.0, help="stand-in latency per LLM call (default 0)")
    add("--env-latency-ms", type=float, default=0.0, help="WebShop server latency per call (default 0)")
    add("--concurrency", "-c", type=int, default=8, help="total execution slots C (default 8)")
    add("--workers", type=int, default=1, help="worker processes K; each gets C/K slots (default 1)")
    add("--pool", default="prefork", help="Celery pool: prefork (a process per slot) or threads (default prefork)")
    add("--peer", choices=["agl-runner"], default=None, help="also run the workload with Agent Lightning's runner")
    add("--peer-spans", action="store_true", help="the peer ships its episode spans too (same trace volume)")
    add(
        "--floor",
        action="store_true",
        help="also run the workload with the floor: the episode and the Store calls it needs, nothing else",
    )
    add("--probes", type=int, default=20, help="dispatch-latency probes while slots are free (0: skip)")
    add(
        "--soak",
        action="store_true",
        help=f"{SOAK_ROLLOUTS} rollouts; worker RSS at {SOAK_EARLY} vs the end, and the Store's CPU per rollout "
        "over rollouts 1,000-1,500 vs 4,400-4,900 (does its cost grow as it fills?)",
    )
    add("--split", default="train", help="WebShop task split to draw inputs from (default train)")
    add("--log-level", default="INFO", help="LOG_LEVEL of the workers and the bridge (default INFO)")
    add("--no-task-events", action="store_true", help="CELERY_TASK_EVENTS=false (no Flower task list)")
    add("--timeout-s", type=float, default=1800.0, help="give up a phase after this long (default 1800)")
    add("--store-url", default=None, help="reuse this Store (should run with --tracker prometheus)")
    add("--broker-url", default=None, help="reuse this Redis (default: start a private one)")
    add("--webshop-url", default=None, help="reuse this WebShop server (then --env-latency-ms is its own)")
    add("--llm-url", default=None, help="reuse this LLM base URL (then --llm-latency-ms is its own)")
    add("--log-dir", type=Path, default=None, help="where component logs go (default: a temp dir)")
    add("--json", action="store_true", help="print the figures as one JSON object on the last line")


def load_inputs(split: str, count: int, offset: int = 0) -> list[dict[str, Any]]:
    from webshop_env.goals import load_tasks

    tasks = load_tasks(split, None, 0)
    chosen = [tasks[(offset + i) % len(tasks)] for i in range(count)]
    return [{"task_id": t["task_id"], "instruction": t["instruction"]} for t in chosen]


def probe_dispatch(client: BenchClient, args: argparse.Namespace, resources_id: str) -> list[dict[str, Any]]:
    """Enqueue rollouts one by one, never more than half the slots in flight: enqueue -> task start."""
    wave = max(1, args.concurrency // 2)
    inputs = load_inputs(args.split, args.probes, offset=SOAK_ROLLOUTS + 1)
    views: list[dict[str, Any]] = []
    for start in range(0, len(inputs), wave):
        ids = []
        for item in inputs[start : start + wave]:
            ids += client.enqueue([item], resources_id)
            time.sleep(0.2)
        client.wait(ids, args.timeout_s)
        views += client.rollouts(ids)
    return views


def run_workload(
    client: BenchClient,
    args: argparse.Namespace,
    resources_id: str,
    groups: dict[str, list[int]],
    memory_group: str,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, float]]:
    """Enqueue the workload at once, wait for it, and return the summary, the views and memory marks."""
    inputs = load_inputs(args.split, args.rollouts)
    client.own.clear()
    before = _counters(client.url)
    sampler = bm.MemorySampler(groups).start()
    marks: dict[str, float] = {}

    cpu_at: dict[int, tuple[int, float]] = {}  # window edge -> (rollouts finished, Store CPU s) when crossed

    def progress(finished: int) -> None:
        if args.soak and finished >= SOAK_EARLY and "early" not in marks:
            marks["early"] = sampler.sample()[memory_group]
        if args.soak and "store" in groups:
            for edge in SOAK_EDGES:
                if finished >= edge and edge not in cpu_at:
                    cpu_at[edge] = (finished, watch.cpu()["store"])

    watch = bm.Stopwatch(groups)
    finished_before = client.finished_count()
    ids = client.enqueue(inputs, resources_id)
    done = client.wait_counted(ids, finished_before, args.timeout_s, progress)
    wall, cpu = watch.elapsed(), watch.cpu()
    marks["end"] = sampler.sample()[memory_group]
    sampler.stop()
    after = _counters(client.url)
    requests = None
    if before is not None and after is not None:
        diff = bm.diff_counts(after, before, client.own)
        requests = {k: v for k, v in diff.items() if not k.startswith("GET /v1/prometheus")}
    views = client.rollouts(ids)
    summary = summarize(views, wall, cpu, requests) | client.stored_trace(ids)
    summary["unfinished"] = len(ids) - len(done)
    dequeues = (requests or {}).get(bm.DEQUEUE)
    summary["empty_dequeues_per_rollout"] = (
        round(max(0, dequeues - bm.claiming_dequeues(views)) / len(views), 3) if dequeues and views else None
    )
    summary["sustained_rollouts_per_s"] = rounded(bm.sustained_rate(views, args.concurrency), 3)
    summary["rss_mb_total"] = round(sampler.peak_total.get(memory_group, 0.0), 1)
    summary["rss_mb_peak_process"] = round(sampler.peak_process_mb(memory_group), 1)
    summary["dispatch_incl_queue_p50_ms"] = rounded(bm.percentile(bm.latencies_ms(views), 50))
    gaps = bm.dequeue_to_start_ms(views)  # the workload keeps every slot busy: how long a claimed rollout idles
    summary.update({f"dequeue_to_start_p{q}_ms": rounded(bm.percentile(gaps, q)) for q in (50, 99)})
    for name, (first, last) in SOAK_WINDOWS.items():
        if first in cpu_at and last in cpu_at and cpu_at[last][0] > cpu_at[first][0]:
            rollouts = cpu_at[last][0] - cpu_at[first][0]
            marks[f"store_cpu_ms_{name}"] = (cpu_at[last][1] - cpu_at[first][1]) * 1000 / rollouts
    return summary, views, marks


def _counters(store_url: str) -> dict[str, float] | None:
    try:
        return bm.store_requests(store_url)
    except bm.NoCounters as exc:
        print(f"warning: {exc}; Store requests are not reported", file=sys.stderr)
        return None


def start_executor(stack: LocalStack, client: BenchClient, args: argparse.Namespace, kind: str) -> ManagedProcess:
    """The SDK runner (``peer``) or the floor in a child process; healthy once each of its slots polled the Store."""
    workers_before = int(client.call("GET", "/statistics").get("total_workers", 0))
    # The floor mirrors our layout: a process per slot under prefork, else `--workers` processes of threads,
    # each claiming for all its slots at once.
    processes = args.concurrency if args.pool == "prefork" else max(1, args.workers)
    pollers = processes if kind == "floor" else args.concurrency

    def polled() -> bool:
        return int(client.call("GET", "/statistics").get("total_workers", 0)) >= workers_before + pollers

    slots = str(args.concurrency)
    if kind == "floor":
        per_process = str(max(1, args.concurrency // processes))
        argv = [PYTHON, "-m", "bridge_lab.bench.floor", "--processes", str(processes), "--n-slots", per_process]
    else:
        argv = [PYTHON, "-m", "bridge_lab.bench.peer", "--store-url", stack.store_url, "--n-runners", slots]
        argv += ["--poll-interval-s", "1.0"] + (["--export-spans"] if args.peer_spans else [])
    return stack.spawn(kind, argv, polled, timeout=300, waiting_for=f"the {kind} polling the Store")


def run_executor(
    stack: LocalStack,
    client: BenchClient,
    args: argparse.Namespace,
    resources_id: str,
    groups: dict[str, list[int]],
    kind: str,
) -> dict[str, Any]:
    """The workload again, run by the peer or the floor on the same Store and stand-ins."""
    process = start_executor(stack, client, args, kind)
    shared = {k: v for k, v in groups.items() if k not in ("bridge", "worker")}
    summary, _, _ = run_workload(client, args, resources_id, {kind: [process.pid or 0]} | shared, kind)
    process.stop()
    return summary


def executor_figures(
    kind: str, summary: dict[str, Any], ours_rps: float | None, ours_worker_cpu_ms: float | None = None
) -> dict[str, Any]:
    """A phase's figures under its prefix (``peer_``, ``floor_``), with our rate over its rate and our worker
    CPU per rollout over its executor's (``worker_cpu_ratio_vs_<kind>``)."""
    rate = summary["rollouts_per_s"]
    figures = {
        "rollouts_per_s": rate,
        "store_requests_per_rollout": summary["store_requests_per_rollout"],
        "store_requests_by_endpoint": summary["store_requests_by_endpoint"],
        "cpu_ms_per_rollout": summary.get(f"{kind}_cpu_ms_per_rollout"),
        "worker_cpu_ms_per_rollout": summary.get(f"{kind}_cpu_ms_per_rollout"),
        "store_cpu_ms_per_rollout": summary.get("store_cpu_ms_per_rollout"),
        "store_ceiling_rollouts_per_s": summary.get("store_ceiling_rollouts_per_s"),
        "cpu_ms_per_rollout_total": summary.get("cpu_ms_per_rollout_total"),
        "rss_mb_total": summary["rss_mb_total"],
        "statuses": summary["statuses"],
        "rollout_duration_p50_ms": summary["rollout_duration_p50_ms"],
        "stored_spans_per_rollout": summary["stored_spans_per_rollout"],
        "stored_token_ids_per_rollout": summary["stored_token_ids_per_rollout"],
        # The same work whichever executor runs: a change between the phases is the machine's drift, or the load
        # the executor's layout puts on the stand-ins (connections, context switches).
        "env_cpu_ms_per_rollout": summary.get("env_cpu_ms_per_rollout"),
        "llm_stand_in_cpu_ms_per_rollout": summary.get("llm_stand_in_cpu_ms_per_rollout"),
    }
    return {f"{kind}_{key}": value for key, value in figures.items()} | {
        f"ratio_vs_{kind}": round(ours_rps / rate, 3) if ours_rps and rate else None,
        f"worker_cpu_ratio_vs_{kind}": cpu_ratio(ours_worker_cpu_ms, figures["worker_cpu_ms_per_rollout"]),
    }


def stop_ours(stack: LocalStack) -> None:
    for name in ["bridge", *[w.name for w in stack.workers]]:
        if name in stack.processes:
            stack.processes.pop(name).stop()
    stack.workers.clear()


def main(args: argparse.Namespace) -> int:
    if args.soak:
        args.rollouts = max(args.rollouts, SOAK_ROLLOUTS)
    config = StackConfig(
        store_url=args.store_url,
        broker_url=args.broker_url,
        webshop_url=args.webshop_url,
        llm_base_url=args.llm_url,
        workers=args.workers,
        concurrency=max(1, args.concurrency // max(1, args.workers)),
        pool=args.pool,
        policy_latency_ms=args.llm_latency_ms,
        env_latency_ms=args.env_latency_ms,
        store_tracker="prometheus",
        log_dir=args.log_dir,
        extra_env={"LOG_LEVEL": args.log_level} | ({"CELERY_TASK_EVENTS": "false"} if args.no_task_events else {}),
    )
    stack = LocalStack(config)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        stack.start(say)
        return _bench(stack, args, say)
    finally:
        stack.stop()


def _bench(stack: LocalStack, args: argparse.Namespace, say: Any) -> int:
    client = BenchClient(stack.store_url)
    resources = {"main_llm": {"resource_type": "llm", "endpoint": stack.llm_base_url, "model": STAND_IN_MODEL}}
    resources_id = client.call("POST", "/resources", json=resources)["resources_id"]
    store_pid = stack.processes["store"].pid if "store" in stack.processes else None
    groups = {"bridge": [stack.processes["bridge"].pid or 0], "worker": [w.pid or 0 for w in stack.workers]}
    if store_pid:
        groups["store"] = [store_pid]
    for name, label in (("webshop", "env"), ("policy", "llm_stand_in")):  # CPU the workload costs outside us
        if name in stack.processes:
            groups[label] = [stack.processes[name].pid or 0]
    say(f"dispatch probes: {args.probes}")
    probe_views = probe_dispatch(client, args, resources_id) if args.probes > 0 else []
    probes = bm.latencies_ms(probe_views)
    claim = [  # enqueue -> dequeue: how long the bridge took to see the rollout (its Store poll interval)
        (float(v["attempt"]["start_time"]) - float(v["start_time"])) * 1000
        for v in probe_views
        if (v.get("attempt") or {}).get("start_time") and v.get("start_time")
    ]
    store_rps = client.store_capacity_rps()
    say(f"workload: {args.rollouts} rollouts on {args.concurrency} slots")
    summary, views, marks = run_workload(client, args, resources_id, groups, "worker")
    ideal_rps, basis = ideal(summary, args, store_rps)
    shares = None
    if basis == "latency-bound":
        shares = bm.slot_time(
            views, args.concurrency, lambda meta: ideal_seconds(meta.get("llm_calls"), meta.get("steps"), args)
        )
    if shares is not None and ideal_rps:  # unbiased where the window holds few rollouts per slot
        summary["sustained_rollouts_per_s"] = round(shares["ideal"] * ideal_rps, 3)
    sustained = summary["sustained_rollouts_per_s"]
    result: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in ("rollouts", "llm_latency_ms", "env_latency_ms", "concurrency")}
        | {"workers": args.workers, "pool": args.pool, "task_events": not args.no_task_events}
        | {"peer_spans": args.peer_spans},
        **summary,
        "ideal_rollouts_per_s": ideal_rps,
        "ideal_basis": basis,
        "store_capacity_rps": round(store_rps, 1),
        "efficiency": round(summary["rollouts_per_s"] / ideal_rps, 3) if ideal_rps else None,
        "sustained_efficiency": round(sustained / ideal_rps, 3) if ideal_rps and sustained else None,
        "slot_time_shares": {k: round(v, 4) for k, v in shares.items()} if shares else None,
        "worker_rss_mb_total": summary["rss_mb_total"],
        "worker_rss_mb_peak": summary["rss_mb_peak_process"],
        "store_cpu_ms_per_rollout": summary.get("store_cpu_ms_per_rollout"),
        **{f"dispatch_p{q}_ms": rounded(bm.percentile(probes, q)) for q in (50, 95, 99)},
        "dispatch_probes": len(probes),
        "dispatch_enqueue_to_dequeue_p50_ms": rounded(bm.percentile(claim, 50)),
        "dispatch_dequeue_to_start_p50_ms": rounded(bm.percentile(bm.dequeue_to_start_ms(probe_views), 50)),
    }
    if args.soak:
        early, end = marks.get("early"), marks.get("end")
        result["memory_mb_at_1000"] = rounded(early, 1)
        result["memory_mb_at_end"] = rounded(end, 1)
        result["memory_growth_pct"] = rounded((end - early) / early * 100) if early and end else None
        cost_early, cost_late = marks.get("store_cpu_ms_early"), marks.get("store_cpu_ms_late")
        result["store_cpu_ms_per_rollout_early"] = rounded(cost_early, 2)
        result["store_cpu_ms_per_rollout_late"] = rounded(cost_late, 2)
        result["store_cpu_growth_pct"] = (
            rounded((cost_late - cost_early) / cost_early * 100) if cost_early and cost_late else None
        )
    kinds = (["peer"] if args.peer else []) + (["floor"] if args.floor else [])
    if kinds:
        say("stopping our workers and the bridge")
        stop_ours(stack)
    for kind in kinds:
        say(f"{kind}: the same workload, run by {EXECUTORS[kind]}")
        result.update(
            executor_figures(
                kind,
                run_executor(stack, client, args, resources_id, groups, kind),
                summary["rollouts_per_s"],
                summary.get("worker_cpu_ms_per_rollout"),
            )
        )
    if args.peer and args.floor:
        floor_rps, peer_rps = result["floor_rollouts_per_s"], result["peer_rollouts_per_s"]
        result["ratio_floor_vs_peer"] = round(floor_rps / peer_rps, 3) if floor_rps and peer_rps else None
    print_table(result)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    ok = summary["statuses"].get("succeeded", 0) == summary["rollouts"] and not summary["unfinished"]
    return 0 if ok else 1
