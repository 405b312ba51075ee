"""The benchmark's summary prints our worker CPU per rollout over the peer's, so a regression shows at once."""

from __future__ import annotations

from typing import Any

import pytest

from bridge_lab.bench.report import cpu_ratio, print_table
from bridge_lab.bench.run import executor_figures


class _Figures(dict[str, Any]):
    """A result where every figure the table does not need here is absent (printed as empty)."""

    def __missing__(self, key: str) -> None:
        return None


def _peer_summary(runner_cpu_ms: float | None) -> dict[str, Any]:
    return {
        "rollouts_per_s": 2.0,
        "store_requests_per_rollout": 6.0,
        "store_requests_by_endpoint": {},
        "peer_cpu_ms_per_rollout": runner_cpu_ms,
        "store_cpu_ms_per_rollout": 20.0,
        "store_ceiling_rollouts_per_s": 50.0,
        "cpu_ms_per_rollout_total": 90.0,
        "rss_mb_total": 300.0,
        "statuses": {"succeeded": 8},
        "rollout_duration_p50_ms": 14_000.0,
        "stored_spans_per_rollout": 25.0,
        "stored_token_ids_per_rollout": 6_000.0,
    }


def test_the_worker_cpu_ratio_is_ours_over_the_peers() -> None:
    figures = executor_figures("peer", _peer_summary(50.0), ours_rps=2.2, ours_worker_cpu_ms=27.5)
    assert figures["worker_cpu_ratio_vs_peer"] == 0.55
    assert figures["peer_worker_cpu_ms_per_rollout"] == 50.0
    assert figures["ratio_vs_peer"] == pytest.approx(1.1)


def test_no_ratio_without_both_figures() -> None:
    assert cpu_ratio(None, 50.0) is None and cpu_ratio(30.0, None) is None and cpu_ratio(30.0, 0.0) is None
    figures = executor_figures("peer", _peer_summary(None), ours_rps=2.0, ours_worker_cpu_ms=30.0)
    assert figures["worker_cpu_ratio_vs_peer"] is None


def test_the_summary_prints_the_ratio_beside_both_cpu_figures(capsys: pytest.CaptureFixture[str]) -> None:
    result = _Figures(
        config={"rollouts": 8},
        rollouts=8,
        statuses={"succeeded": 8},
        store_requests_by_endpoint={},
        worker_cpu_ms_per_rollout=41.0,
    )
    result.update(executor_figures("peer", _peer_summary(53.4), ours_rps=2.0, ours_worker_cpu_ms=41.0))
    print_table(result)
    lines = capsys.readouterr().out.splitlines()
    ratio = [line for line in lines if "worker CPU ratio vs peer" in line]
    assert len(ratio) == 1, lines
    assert ratio[0].split()[-1] == "0.768", ratio
    assert any("peer worker (runner) CPU ms/rollout" in line and "53.4" in line for line in lines), lines


def test_each_phase_shows_what_the_stand_ins_cost_in_it() -> None:
    """The stand-ins do the same work whichever executor runs: their CPU in each phase shows how far the machine
    drifted between the phases, beside the ratio it moves."""
    summary = _peer_summary(80.0) | {"env_cpu_ms_per_rollout": 12.0, "llm_stand_in_cpu_ms_per_rollout": 24.0}
    figures = executor_figures("peer", summary, ours_rps=2.0, ours_worker_cpu_ms=22.0)
    assert figures["peer_env_cpu_ms_per_rollout"] == 12.0 and figures["peer_llm_stand_in_cpu_ms_per_rollout"] == 24.0
