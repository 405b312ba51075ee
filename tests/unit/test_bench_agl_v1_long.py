"""The long run's arithmetic and verdict (``bridge_lab.bench.agl_v1_long``) on made-up samples and outcomes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bridge_lab.bench.agl_v1_long import (
    Bounds,
    LongRun,
    Outcome,
    Sample,
    baseline,
    expected_reward,
    growth,
    slope_per_1000,
    summary,
    verdict,
)


def sample(finished: int, worker_rss: float = 500.0, worker_fds: int = 100, **changes: object) -> Sample:
    base = Sample(
        finished=finished,
        seconds=finished / 10,
        worker_rss_mib=worker_rss,
        worker_fds=worker_fds,
        worker_threads=20,
        worker_processes=5,
        server_pid=42,
        server_rss_mib=80.0,
        server_fds=7,
        dispatcher_rss_mib=67.0,
        dispatcher_fds=10,
        programs_alive=0,
        program_dirs=1,
        inflight=0,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def outcomes(n: int) -> list[Outcome]:
    return [Outcome(f"r{i}", expected_reward(i), "succeeded", "0", (expected_reward(i),)) for i in range(n)]


def clean_run(rss: list[float], fds: list[int] | None = None) -> LongRun:
    """A run of 100 rollouts per sample, all as they should be, the worker's RSS (and fds) as given."""
    fds = fds or [100] * len(rss)
    total = 100 * (len(rss) - 1)
    samples = [sample(100 * i, r, f) for i, (r, f) in enumerate(zip(rss, fds, strict=True))]
    return LongRun(total, samples, outcomes(total), seconds=total / 20)


BOUNDS = Bounds(rss_mib=8.0, fds=2, slots=4)


def test_growth_counts_from_the_first_sample_at_the_warmup_to_the_highest_later_one() -> None:
    run = clean_run([400.0, 480.0, 500.0, 503.0, 501.0, 502.0])  # warming up until 200, then +3 at most
    assert baseline(run.samples, 200) == run.samples[2]
    grown = growth(run.samples, 200)
    assert grown["worker_rss_mib"] == 3.0
    assert grown["server_rss_mib"] == 0 and grown["worker_fds"] == 0
    assert verdict(run, 200, BOUNDS) == []


def test_a_series_that_falls_has_grown_by_nothing_and_no_later_sample_means_no_figure() -> None:
    assert growth(clean_run([500.0, 500.0, 490.0]).samples, 100)["worker_rss_mib"] == 0
    assert growth(clean_run([500.0, 500.0]).samples, 100)["worker_rss_mib"] is None
    assert growth(clean_run([500.0, 500.0]).samples, 500)["worker_rss_mib"] is None


def test_rss_growth_beyond_the_bound_fails_and_the_worker_gets_one_more_fd_per_slot() -> None:
    leaking = clean_run([400.0, 500.0, 505.0, 509.0])
    assert verdict(leaking, 100, BOUNDS) == ["worker RSS grew by 9.0 after 100 rollouts (bound 8.0)"]
    pools_filling = clean_run([500.0] * 4, fds=[90, 100, 104, 106])
    assert verdict(pools_filling, 100, BOUNDS) == []  # 2 + 4 slots
    leaking_fds = clean_run([500.0] * 4, fds=[90, 100, 104, 107])
    assert verdict(leaking_fds, 100, BOUNDS) == ["worker fds grew by 7 after 100 rollouts (bound 6)"]
    server = clean_run([500.0] * 4)
    server.samples[-1] = replace(server.samples[-1], server_fds=10)
    assert verdict(server, 100, BOUNDS) == ["program server fds grew by 3 after 100 rollouts (bound 2)"]


def test_the_trend_is_a_least_squares_slope_per_thousand_rollouts_from_the_baseline() -> None:
    run = clean_run([100.0, 500.0, 501.0, 502.0, 503.0])  # 1 MiB per 100 once past the warm-up
    assert slope_per_1000(run.samples, 100, "worker_rss_mib") == 10.0
    assert slope_per_1000(run.samples, 300, "worker_rss_mib") is None  # two points are no trend


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda r: r.outcomes.pop(), "1 of 300 rollouts did not finish"),
        (
            lambda r: r.outcomes.__setitem__(0, replace(r.outcomes[0], state="failed", error="boom")),
            "1 rollouts did not succeed (first: failed, 'boom')",
        ),
        (lambda r: r.outcomes.__setitem__(1, replace(r.outcomes[1], rewards=())), "1 rollouts' reward events"),
        (lambda r: r.outcomes.__setitem__(2, replace(r.outcomes[2], rewards=(0.002, 0.002))), "reward events"),
        (lambda r: r.outcomes.__setitem__(3, replace(r.outcomes[3], rewards=(0.5,))), "reward events"),
        (lambda r: r.outcomes.__setitem__(4, replace(r.outcomes[4], attempt_id="1")), "1 rollouts ran again"),
        (
            lambda r: r.samples.__setitem__(2, replace(r.samples[2], inflight=1)),
            "at 200: 1 in-flight entries and 0 programs left",
        ),
        (
            lambda r: r.samples.__setitem__(1, replace(r.samples[1], programs_alive=2)),
            "at 100: 0 in-flight entries and 2 programs left",
        ),
        (
            lambda r: r.samples.__setitem__(3, replace(r.samples[3], program_dirs=3)),
            "2 program directories left beside the live server's",
        ),
        (
            lambda r: r.samples.__setitem__(3, replace(r.samples[3], server_pid=43)),
            "the program server did not stay one process",
        ),
        (lambda r: r.samples.__setitem__(3, replace(r.samples[3], server_pid=None)), "did not stay one process"),
    ],
)
def test_each_invariant_is_checked(change: object, problem: str) -> None:
    run = clean_run([500.0] * 4)
    change(run)  # type: ignore[operator]
    problems = verdict(run, 100, BOUNDS)
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_run_too_short_for_its_warmup_says_growth_was_not_measured() -> None:
    assert verdict(clean_run([500.0, 500.0]), 100, BOUNDS) == [
        "no sample after the baseline at 100 rollouts: growth not measured"
    ]


def test_rewards_are_exact_through_json_and_distinct_among_neighbours() -> None:
    import json

    values = [expected_reward(i) for i in range(2000)]
    assert all(json.loads(json.dumps(v)) == v == float(str(v)) for v in values)
    assert len(set(values[:1000])) == 1000


def test_the_summary_gives_the_rate_the_samples_and_the_verdict() -> None:
    run = clean_run([400.0, 500.0, 501.0, 502.0])
    figures = summary(run, 100, BOUNDS)
    assert (figures["rollouts"], figures["succeeded"], figures["seconds"]) == (300, 300, 15.0)
    assert figures["rollouts_per_s"] == 20.0
    assert figures["baseline"]["finished"] == 100 and figures["last"]["finished"] == 300
    assert figures["growth"]["worker_rss_mib"] == 2.0
    assert (figures["verdict"], figures["problems"]) == ("pass", [])
    assert figures["bounds"] == {"rss_mib": 8.0, "fds": 2, "slots": 4}
