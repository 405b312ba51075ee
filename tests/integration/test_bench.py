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

from bridge.tools.stack import LocalStack
from tests.helpers import cancel_unfinished

pytestmark = pytest.mark.integration

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
}
PEER = {"peer_rollouts_per_s", "ratio_vs_peer", "peer_store_requests_per_rollout", "peer_cpu_ms_per_rollout"}


def _bench(services: LocalStack, log_dir: Path, *extra: str, timeout_s: float = 420) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "bridge",
        "bench",
        "--store-url",
        services.store_url,
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
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_bench_prints_every_figure_as_json(services: LocalStack, tmp_path: Path) -> None:
    result = _bench(services, tmp_path, "--rollouts", "20", "--concurrency", "4", "--probes", "4")
    assert result.keys() >= REQUIRED, REQUIRED - result.keys()
    assert result["rollouts"] == 20 and result["statuses"] == {"succeeded": 20}
    assert isinstance(result["rollouts_per_s"], float) and result["rollouts_per_s"] > 0
    # The counters come from the Store itself: our workers' traces and final reports must be among them.
    by_endpoint = result["store_requests_by_endpoint"]
    assert isinstance(by_endpoint, dict)
    assert any("/v1/traces" in key for key in by_endpoint), by_endpoint
    assert any("attempts" in key for key in by_endpoint), by_endpoint
    assert result["worker_cpu_ms_per_rollout"] > 0 and result["worker_rss_mb_total"] > 0
    assert result["dispatch_probes"] == 4
    # Dispatch split in two with the worker's own start time: the bridge's Store poll, then the hand-off.
    # Each is a real interval on a quiet local stack: positive, and far below the run's own deadline.
    for figure in ("dispatch_enqueue_to_dequeue_p50_ms", "dispatch_dequeue_to_start_p50_ms", "dequeue_to_start_p50_ms"):
        assert 0 < result[figure] < 30_000, (figure, result[figure])


def test_bench_runs_the_agent_lightning_runner_side_by_side(services: LocalStack, tmp_path: Path) -> None:
    result = _bench(
        services, tmp_path, "--rollouts", "10", "--concurrency", "2", "--probes", "0", "--peer", "agl-runner"
    )
    assert result.keys() >= (REQUIRED | PEER), (REQUIRED | PEER) - result.keys()
    assert result["peer_statuses"] == {"succeeded": 10}
    assert result["ratio_vs_peer"] > 0
    assert result["dispatch_p99_ms"] is None  # no probes asked for
