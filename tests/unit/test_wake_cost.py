"""``python -m bridge_lab.bench.wake_cost`` runs and prints both tables, every row measured (no timing
is asserted: the figures belong to the machine)."""

from __future__ import annotations

import pytest

from bridge_lab.bench import wake_cost


def test_both_tables_have_a_measured_row_per_pause_and_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        wake_cost.main(["--pauses-ms", "5", "--budget-s", "0.05", "--threads", "1,4", "--threads-pause-ms", "20"]) == 0
    )
    single, threads = capsys.readouterr().out.strip().split("\n\n")
    rows = [line.split() for line in single.splitlines()[1:]]
    assert [row[0] for row in rows] == ["0", "5"]  # the back-to-back baseline is always measured
    assert rows[0][-1] == "1.00" and all(float(row[2]) > 0 for row in rows)
    rows = [line.split() for line in threads.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "4", "1"]  # 1 thread, 4 threads, 1 thread taking 4 in turn
    assert all(float(row[-2]) > 0 for row in rows)


def test_a_step_keeps_a_bounded_history() -> None:
    conversation = [{"role": "system", "content": "s"}]
    for _ in range(50):
        assert wake_cost.one_step(conversation) > 0
    assert len(conversation) == 9 and conversation[0]["role"] == "system"
