"""The benchmark's figures: a phase's summary, the ideal rate it is held against, and the printed table."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.table import Table

from bridge_lab.bench.metrics import DEQUEUE
from bridge_lab.render import cell, key_value_table, show
from bridge_lab.stats import mean, percentile, rounded


def summarize(
    views: list[dict[str, Any]], wall_s: float, cpu: dict[str, float], requests: dict[str, float] | None
) -> dict[str, Any]:
    """The figures of one phase from the Store's rollout views, the CPU it cost and the requests it made."""
    n = len(views)
    metas = [(v.get("attempt") or {}).get("metadata") or {} for v in views]
    durations = [
        (v["attempt"]["end_time"] - v["attempt"]["start_time"]) * 1000
        for v in views
        if (v.get("attempt") or {}).get("end_time") and v["attempt"].get("start_time")
    ]
    statuses: dict[str, int] = {}
    for view in views:
        statuses[view["status"]] = statuses.get(view["status"], 0) + 1
    total_requests = sum(requests.values()) if requests is not None else None
    return {
        "rollouts": n,
        "statuses": statuses,
        "wall_s": round(wall_s, 2),
        "rollouts_per_s": round(n / wall_s, 3) if wall_s else None,
        "store_requests_per_rollout": round(total_requests / n, 2) if n and total_requests is not None else None,
        "store_requests_by_endpoint": {k: round(v / n, 3) for k, v in sorted((requests or {}).items())} if n else {},
        "mean_steps": rounded(mean([float(m["steps"]) for m in metas if "steps" in m])),
        "mean_llm_calls": rounded(mean([float(m["llm_calls"]) for m in metas if "llm_calls" in m])),
        "spans_per_rollout": rounded(mean([float(m["spans_exported"]) for m in metas if "spans_exported" in m])),
        "span_bytes_per_rollout": rounded(
            mean([float(m["span_bytes_exported"]) for m in metas if "span_bytes_exported" in m])
        ),
        "rollout_duration_p50_ms": rounded(percentile(durations, 50)),
        "rollout_duration_p99_ms": rounded(percentile(durations, 99)),
        **{f"{name}_cpu_ms_per_rollout": round(seconds * 1000 / n, 2) if n else None for name, seconds in cpu.items()},
        "cpu_ms_per_rollout_total": round(sum(cpu.values()) * 1000 / n, 2) if n else None,
        "store_ceiling_rollouts_per_s": store_ceiling(cpu.get("store"), n),
    }


def store_ceiling(store_cpu_s: float | None, rollouts: int) -> float | None:
    """Rollouts/s one Store core sustains at this Store CPU per rollout: ``1000 / Store CPU ms per rollout``.

    The Store serves from one Python process, so one core is its ceiling whatever the machine has; None when
    the Store's CPU was not measured (``--store-url``) or no rollout finished.
    """
    if store_cpu_s is None or store_cpu_s <= 0 or rollouts <= 0:
        return None
    return round(rollouts / store_cpu_s, 1)


def cpu_ratio(ours_ms: float | None, theirs_ms: float | None) -> float | None:
    """Our worker CPU per rollout over another executor's (its runner or executor processes), to 3 places.

    Below 1 our workers spend less CPU per rollout than that executor does on the same workload; None when
    either figure is missing or the other executor's is not positive.
    """
    if ours_ms is None or theirs_ms is None or theirs_ms <= 0:
        return None
    return round(ours_ms / theirs_ms, 3)


def ideal(summary: dict[str, Any], args: argparse.Namespace, store_rps: float) -> tuple[float | None, str]:
    """C / (time one rollout needs at the given latencies); at 0 ms, the Store-bound rate instead."""
    calls, steps = summary.get("mean_llm_calls"), summary.get("mean_steps")
    if args.llm_latency_ms <= 0 and args.env_latency_ms <= 0:
        per = summary.get("store_requests_per_rollout")
        return (round(store_rps / per, 2), "store-bound") if per else (None, "store-bound")
    seconds = ideal_seconds(calls, steps, args)
    return (round(args.concurrency / seconds, 3), "latency-bound") if seconds else (None, "latency-bound")


def ideal_seconds(calls: float | None, steps: float | None, args: argparse.Namespace) -> float | None:
    """One rollout's time when nothing but the stand-ins' latencies takes any (the reset is an env call)."""
    if calls is None or steps is None:
        return None
    return float(calls) * args.llm_latency_ms / 1000 + (float(steps) + 1) * args.env_latency_ms / 1000


def print_table(result: dict[str, Any]) -> None:
    """The figures a person reads, on stdout before the JSON line (which carries them all)."""
    rows: list[tuple[str, object]] = [
        ("rollouts (succeeded)", f"{result['rollouts']} ({result['statuses'].get('succeeded', 0)})"),
        ("rollouts/s", result["rollouts_per_s"]),
        (f"ideal rollouts/s ({result['ideal_basis']})", result["ideal_rollouts_per_s"]),
        ("efficiency", result["efficiency"]),
        ("sustained rollouts/s, efficiency", f"{result['sustained_rollouts_per_s']}, {result['sustained_efficiency']}"),
        ("slot time: ideal/overhead/hand-off/free %", _shares(result.get("slot_time_shares"))),
        ("Store requests/rollout", result["store_requests_per_rollout"]),
        ("spans, bytes exported/rollout", f"{result['spans_per_rollout']}, {result['span_bytes_per_rollout']}"),
        (
            "stored spans, token ids/rollout (sample)",
            f"{result.get('stored_spans_per_rollout')}, {result.get('stored_token_ids_per_rollout')}",
        ),
        ("bridge CPU ms/rollout", result["bridge_cpu_ms_per_rollout"]),
        ("worker CPU ms/rollout", result["worker_cpu_ms_per_rollout"]),
        ("Store CPU ms/rollout", result["store_cpu_ms_per_rollout"]),
        ("Store ceiling rollouts/s (one core)", result.get("store_ceiling_rollouts_per_s")),
        ("CPU ms/rollout in all", result.get("cpu_ms_per_rollout_total")),
        (
            "env, LLM stand-in CPU ms/rollout",
            f"{result.get('env_cpu_ms_per_rollout')}, {result.get('llm_stand_in_cpu_ms_per_rollout')}",
        ),
        (
            "dequeue -> task start ms p50/p99",
            f"{result['dequeue_to_start_p50_ms']}/{result['dequeue_to_start_p99_ms']}",
        ),
        ("worker RSS MB total (peak process)", f"{result['worker_rss_mb_total']} ({result['worker_rss_mb_peak']})"),
        ("dispatch ms p50/p95/p99 (free slots)", "/".join(str(result[f"dispatch_p{q}_ms"]) for q in (50, 95, 99))),
        ("rollout duration ms p50/p99", f"{result['rollout_duration_p50_ms']}/{result['rollout_duration_p99_ms']}"),
        ("mean steps / LLM calls", f"{result['mean_steps']} / {result['mean_llm_calls']}"),
    ]
    if "memory_mb_at_1000" in result:
        rows.append(("worker RSS MB at 1000 / end", f"{result['memory_mb_at_1000']} / {result['memory_mb_at_end']}"))
        rows.append(
            (
                "Store CPU ms/rollout at 1000-1500 / 4400-4900",
                f"{result.get('store_cpu_ms_per_rollout_early')} / {result.get('store_cpu_ms_per_rollout_late')}"
                f" ({result.get('store_cpu_growth_pct')}%)",
            )
        )
    for kind, worker in (("peer", "worker (runner)"), ("floor", "executor")):
        if f"{kind}_rollouts_per_s" in result:
            rows += _executor_rows(result, kind, worker)
    if result.get("ratio_floor_vs_peer") is not None:
        rows.append(("floor rollouts/s over peer's", result["ratio_floor_vs_peer"]))
    show(key_value_table(rows, title=f"workload: {result['config']}"), sys.stdout)
    endpoints = Table(title="Store requests per rollout, by endpoint", title_justify="left", box=None)
    endpoints.add_column("endpoint")
    endpoints.add_column("per rollout", justify="right")
    for key, value in result["store_requests_by_endpoint"].items():
        endpoints.add_row(cell(key), cell(value))
        empty = result.get("empty_dequeues_per_rollout")
        if key == DEQUEUE and empty is not None:
            endpoints.add_row("  of which found no rollout (polls while slots were free)", cell(empty))
    show(endpoints, sys.stdout)


def _executor_rows(result: dict[str, Any], kind: str, worker: str) -> list[tuple[str, Any]]:
    """The rows of the peer's or the floor's phase (``--peer``, ``--floor``)."""

    def figure(key: str) -> Any:
        return result.get(f"{kind}_{key}")

    return [
        (f"{kind} rollouts/s", figure("rollouts_per_s")),
        (f"ratio vs {kind}", result.get(f"ratio_vs_{kind}")),
        (f"{kind} Store requests/rollout", figure("store_requests_per_rollout")),
        (f"{kind} {worker} CPU ms/rollout", figure("cpu_ms_per_rollout")),
        (f"worker CPU ratio vs {kind} (ours / {kind}'s)", result.get(f"worker_cpu_ratio_vs_{kind}")),
        (
            f"{kind} env, LLM stand-in CPU ms/rollout",
            f"{figure('env_cpu_ms_per_rollout')}, {figure('llm_stand_in_cpu_ms_per_rollout')}",
        ),
        (f"{kind} Store CPU ms/rollout", figure("store_cpu_ms_per_rollout")),
        (f"{kind} Store ceiling rollouts/s (one core)", figure("store_ceiling_rollouts_per_s")),
        (f"{kind} CPU ms/rollout in all", figure("cpu_ms_per_rollout_total")),
        (f"{kind} RSS MB total", figure("rss_mb_total")),
        (
            f"{kind} stored spans, token ids/rollout (sample)",
            f"{figure('stored_spans_per_rollout')}, {figure('stored_token_ids_per_rollout')}",
        ),
    ]


def _shares(shares: dict[str, float] | None) -> str | None:
    if not shares:
        return None
    return " / ".join(f"{shares[k] * 100:.1f}" for k in ("ideal", "overhead", "hand_off", "free"))
