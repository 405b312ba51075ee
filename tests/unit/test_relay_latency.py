"""``python -m bridge_lab.bench.relay_latency`` runs both ways and prints every figure it names (docs/performance.md,
"The attempt relay"); the figures themselves are the benchmark's, not a test's."""

from __future__ import annotations

import json

import pytest

from bridge_lab.bench import relay_latency


def test_it_times_calls_direct_and_through_the_relay_and_prints_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert relay_latency.main(["--calls", "40", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["calls"] == 40
    for row in ("direct", "relayed"):
        assert set(result[row]) == {"p50_ms", "p99_ms", "mean_ms"} and result[row]["p50_ms"] > 0
    assert set(result["added"]) == {"p50_ms", "p99_ms", "mean_ms"} and result["relay_cpu_ms_per_call"] >= 0
    assert relay_latency.main(["--calls", "5"]) == 0
    table = capsys.readouterr().out
    assert "relayed" in table and "relay CPU per call" in table
