"""``python -m bridge bench`` runs a tiny workload on the session's services and prints its JSON figures.

No figure is asserted against a target (the machine is shared and noisy): the test checks that the
benchmark runs end to end, with and without the Agent Lightning peer, and that every documented key is
there with a plausible value.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge_lab.stack import LocalStack
from tests.helpers import cancel_unfinished

pytestmark = [pytest.mark.integration, pytest.mark.cost(48)]

REQUIRED = {
    "rollouts",
    "rollouts_per_s",
    "ideal_rollouts_per_s",
    "efficiency",
    "store_requests_per_rollout",
    "store_requests_by_endpoint",
    "spans_per_rollout",
    "span_bytes_per_rollout",
    "bridge_cpu_ms_per_rollout",
    "worker_cpu_ms_per_rollout",
    "worker_rss_mb_total",
    "worker_rss_mb_peak",
    "dispatch_p50_ms",
    "dispatch_p95_ms",
    "dispatch_p99_ms",
    "rollout_duration_p50_ms",
    "rollout_duration_p99_ms",
    "dequeue_to_start_p50_ms",
    "dequeue_to_start_p99_ms",
    "dispatch_enqueue_to_dequeue_p50_ms",
    "dispatch_dequeue_to_start_p50_ms",
    "store_cpu_ms_per_rollout",
    "store_ceiling_rollouts_per_s",
    "cpu_ms_per_rollout_total",
}
PEER = {
    "peer_rollouts_per_s",
    "ratio_vs_peer",
    "peer_store_requests_per_rollout",
    "peer_cpu_ms_per_rollout",
    "peer_worker_cpu_ms_per_rollout",
    "peer_store_cpu_ms_per_rollout",
    "peer_store_ceiling_rollouts_per_s",
    "peer_cpu_ms_per_rollout_total",
    "worker_cpu_ratio_vs_peer",
    "peer_env_cpu_ms_per_rollout",
    "peer_llm_stand_in_cpu_ms_per_rollout",
}
FLOOR = {key.replace("peer_", "floor_").replace("vs_peer", "vs_floor") for key in PEER} | {"ratio_floor_vs_peer"}
CPU_FIGURES = ("Store CPU ms/rollout", "Store ceiling rollouts/s (one core)", "CPU ms/rollout in all")


def _bench(
    services: LocalStack, log_dir: Path, *extra: str, own_store: bool = False, timeout_s: float = 420
) -> tuple[dict[str, Any], str]:
    """The JSON figures and the printed table; ``own_store``: the benchmark starts (and measures) its own Store."""
    argv = [
        sys.executable,
        "-m",
        "bridge",
        "bench",
        *([] if own_store else ["--store-url", services.store_url]),
        "--broker-url",
        services.broker_url,
        "--webshop-url",
        services.webshop_url,
        "--llm-url",
        services.llm_base_url,
        "--log-dir",
        str(log_dir),
        "--timeout-s",
        "240",
        "--json",
        *extra,
    ]
    cancel_unfinished(services.store_url)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    finally:
        cancel_unfinished(services.store_url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1])), done.stdout


def test_bench_prints_every_figure_as_json(services: LocalStack, tmp_path: Path) -> None:
    # Its own Store: the benchmark starts it with the request counters it reads (the session's Stores run
    # without them, which would cost every other test 20-40% more Store CPU per request).
    result, _ = _bench(services, tmp_path, "--rollouts", "20", "--concurrency", "4", "--probes", "4", own_store=True)
    assert result.keys() >= REQUIRED, REQUIRED - result.keys()
    assert result["rollouts"] == 20 and result["statuses"] == {"succeeded": 20}
    assert isinstance(result["rollouts_per_s"], float) and result["rollouts_per_s"] > 0
    # The counters come from the Store itself: our workers' traces and final reports must be among them.
    by_endpoint = result["store_requests_by_endpoint"]
    assert isinstance(by_endpoint, dict)
    assert any("/v1/traces" in key for key in by_endpoint), by_endpoint
    assert any("attempts" in key for key in by_endpoint), by_endpoint
    assert result["worker_cpu_ms_per_rollout"] > 0 and result["worker_rss_mb_total"] > 0
    # The benchmark's own Store is its process to measure: its CPU, the ceiling it sets, and "in all" counts it.
    store_ms = result["store_cpu_ms_per_rollout"]
    assert store_ms > 0 and result["store_ceiling_rollouts_per_s"] == pytest.approx(1000 / store_ms, rel=0.05)
    assert result["cpu_ms_per_rollout_total"] >= result["worker_cpu_ms_per_rollout"] + store_ms - 0.05
    assert result["dispatch_probes"] == 4
    # Dispatch split in two with the worker's own start time: the bridge's Store poll, then the hand-off.
    # Each is a real interval on a quiet local stack: positive, and far below the run's own deadline.
    for figure in ("dispatch_enqueue_to_dequeue_p50_ms", "dispatch_dequeue_to_start_p50_ms", "dequeue_to_start_p50_ms"):
        assert 0 < result[figure] < 30_000, (figure, result[figure])


@pytest.mark.nightly("a figure beside Agent Lightning's runner; the bench itself runs every time, in the test above")
def test_bench_runs_the_agent_lightning_runner_and_the_floor_side_by_side(services: LocalStack, tmp_path: Path) -> None:
    # Its own Store, so that the Store's CPU is measured for every executor.
    result, table = _bench(
        services,
        tmp_path,
        *("--rollouts", "10", "--concurrency", "2", "--probes", "0", "--peer", "agl-runner", "--floor"),
        own_store=True,
    )
    assert result.keys() >= (REQUIRED | PEER | FLOOR), (REQUIRED | PEER | FLOOR) - result.keys()
    for prefix in ("", "peer_", "floor_"):
        store_ms, ceiling = result[f"{prefix}store_cpu_ms_per_rollout"], result[f"{prefix}store_ceiling_rollouts_per_s"]
        assert store_ms > 0 and ceiling == pytest.approx(1000 / store_ms, rel=0.05), (prefix, store_ms, ceiling)
        worker = result[f"{prefix}worker_cpu_ms_per_rollout"]
        assert worker > 0 and worker + store_ms <= result[f"{prefix}cpu_ms_per_rollout_total"] + 0.05
    for kind in ("peer", "floor"):  # our worker CPU over theirs, in the JSON and on the table
        ours, theirs = result["worker_cpu_ms_per_rollout"], result[f"{kind}_worker_cpu_ms_per_rollout"]
        assert result[f"worker_cpu_ratio_vs_{kind}"] == pytest.approx(ours / theirs, rel=0.01), kind
        assert f"worker CPU ratio vs {kind}" in table, kind
    for label in CPU_FIGURES:  # printed for a person too, for every executor
        assert label in table and f"peer {label}" in table and f"floor {label}" in table, label
    assert result["peer_statuses"] == {"succeeded": 10} and result["floor_statuses"] == {"succeeded": 10}
    assert result["ratio_vs_peer"] > 0 and result["ratio_vs_floor"] > 0
    # The floor runs the same episode under the same telemetry: the Store holds the same spans for it as for
    # ours (the peer without --peer-spans ships fewer), from one trace request and one report per rollout.
    assert result["floor_stored_spans_per_rollout"] == result["stored_spans_per_rollout"]
    floor_requests = result["floor_store_requests_by_endpoint"]
    assert floor_requests["POST /v1/traces"] == 1.0, floor_requests
    assert floor_requests["POST /v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}"] == 1.0, floor_requests
    assert result["ratio_floor_vs_peer"] == pytest.approx(
        result["floor_rollouts_per_s"] / result["peer_rollouts_per_s"], rel=0.01
    )
    assert result["dispatch_p99_ms"] is None  # no probes asked for
