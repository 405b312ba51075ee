"""What the tools print: plain, unwrapped tables when captured; chaos verdicts from facts, not log lines."""

from __future__ import annotations

import argparse
import collections
import io
from typing import Any

import pytest

from bridge.core.store import Attempt
from bridge_lab import demo
from bridge_lab.chaos.audit import _episode_roots, format_table
from bridge_lab.chaos.state import FinalReport, ScenarioResult
from bridge_lab.render import console, key_value_table, to_text

SUMMARY: dict[str, Any] = {
    "rollouts": 10,
    "succeeded": 9,
    "failed": 1,
    "cancelled": 0,
    "unfinished": 0,
    "success_rate": 0.9,
    "mean_reward": 0.5,
    "p50_rollout_s": 1.25,
    "p95_rollout_s": None,
    "elapsed_s": 12.0,
    "rollouts_per_s": 0.833,
    "failures_by_class": {"env": 1},
    "urls": {"flower": "http://127.0.0.1:5555", "worker_metrics": ["http://127.0.0.1:9101/metrics"]},
}


def test_captured_tables_have_no_escape_codes_and_show_brackets_literally() -> None:
    stream = io.StringIO()
    console(stream).print(key_value_table([("error", "[bold]not markup[/bold] " + "x" * 150)]))
    text = stream.getvalue()
    assert "\x1b[" not in text
    assert "[bold]not markup[/bold]" in text
    assert len(text.strip().splitlines()) == 1  # a long value does not wrap in a pipe


def test_demo_summary_table_has_every_label() -> None:
    text = to_text(demo.render(SUMMARY))
    for label in ("succeeded", "mean reward", "rollout duration", "throughput", "failures by class", "Flower"):
        assert label in text
    assert "p50 1.25s  p95 -" in text and "9 (90.0%)" in text and "env 1" in text
    assert "worker metrics http://127.0.0.1:9101/metrics" in [" ".join(line.split()) for line in text.splitlines()]
    assert not any(line.startswith("{") for line in text.splitlines())


def test_demo_agl_v1_without_python_3_12_exits_2_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "find_python312", lambda: None)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.main(parser.parse_args(["--agl", "v1", "--rollouts", "1"])) == 2
    assert "--agl v1 needs Python >= 3.12" in capsys.readouterr().err


def test_demo_summarises_1_0_rollouts_like_0_3_ones() -> None:
    ended = [
        demo.Ended("succeeded", 2.0, 1.0),
        demo.Ended("succeeded", 4.0, 0.5),
        demo.Ended("failed", 1.0, failure_class=demo._v1_failure_class("timed out after 10s; the agent's processes")),
        demo.Ended("failed", None, failure_class=demo._v1_failure_class("the agent exited with code 1:\nTraceback")),
    ]
    finished = {str(i): e.status for i, e in enumerate(ended)}
    summary = demo._summary(ended, 5, finished, 2.0)
    assert summary["succeeded"] == 2 and summary["failed"] == 2 and summary["unfinished"] == 1
    assert summary["mean_reward"] == 0.75 and summary["p50_rollout_s"] == 2.0 and summary["rollouts_per_s"] == 2.0
    assert summary["failures_by_class"] == {"timed out after 10s": 1, "the agent exited with code 1": 1}


def test_chaos_table_lists_counts_and_notes() -> None:
    result = ScenarioResult("redeliver", enqueued=100, succeeded=99, failed=collections.Counter({"env": 1}))
    result.notes.append("re-published 25 messages")
    lines = format_table([result]).splitlines()
    assert lines[0].split() == [
        "scenario",
        "enq",
        "ok",
        "failed",
        "by",
        "class",
        "lost",
        "twice",
        "flip",
        "badrw",
        "secs",
    ]
    assert lines[1].split() == ["redeliver", "100", "99", "env=1", "0", "0", "0", "0", "0"]
    assert lines[2] == "  redeliver note: re-published 25 messages"


def test_a_final_report_is_identified_by_the_execution_that_sent_it() -> None:
    meta = {"worker_id": "h:1:1", "started_at": 10.0, "duration_s": 1.5, "reward": 1.0}
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", status="succeeded", metadata=meta)
    again = attempt.model_copy(update={"end_time": 99.0})  # the same report applied twice (HTTP retry)
    other = attempt.model_copy(update={"metadata": {**meta, "worker_id": "h:2:1", "started_at": 12.0}})
    assert FinalReport.of(attempt) == FinalReport.of(again)
    assert FinalReport.of(attempt) != FinalReport.of(other)
    assert FinalReport.of(attempt.model_copy(update={"status": "timeout"})) is None  # the watchdog, not a report


def test_episode_roots_count_executions_seen_directly_or_through_their_children() -> None:
    one = [{"name": "webshop.episode", "span_id": "a"}, {"name": "webshop.step", "span_id": "b", "parent_id": "a"}]
    assert _episode_roots(one) == 1
    assert _episode_roots([*one, {"name": "webshop.step", "span_id": "c", "parent_id": "z"}]) == 2
