"""The arithmetic of `python -m bridge_lab.bench.program_memory` (the measurement itself is run by hand,
docs/performance.md): what it reads of /proc, and which samples count as the steady state."""

from __future__ import annotations

import subprocess
import sys

from bridge_lab.bench.program_memory import Program, smaps_kb


def test_smaps_reads_rss_pss_and_private_pages_of_a_live_process_only() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"  # the interpreter is running
        live = smaps_kb(child.pid)
        assert live is not None and live["rss"] >= live["pss"] >= live["uss"] > 1000  # an interpreter: > 1 MiB
    finally:
        child.communicate(b"")
    assert smaps_kb(child.pid) is None  # reaped: gone from /proc


def test_steady_state_is_the_median_after_the_first_llm_answer() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    program = Program("r", done)
    start = [(float(t), {"rss": 10240 * t, "pss": 5120 * t, "uss": 4096 * t}) for t in (1, 2)]  # importing
    steady = [(t, {"rss": 90 * 1024, "pss": 74 * 1024, "uss": 72 * 1024}) for t in (3.0, 4.0, 5.0)]
    program.samples = start + steady + [(6.0, {"rss": 95 * 1024, "pss": 76 * 1024, "uss": 73 * 1024})]
    program.first_answer_at = 3.0
    figures = program.figures()
    assert figures["exit_code"] == 0 and figures["samples"] == 6
    assert (figures["steady_rss_mib"], figures["steady_pss_mib"], figures["steady_uss_mib"]) == (90.0, 74.0, 72.0)
    assert (figures["peak_rss_mib"], figures["peak_pss_mib"], figures["peak_uss_mib"]) == (95.0, 76.0, 73.0)
    program.first_answer_at = None  # no answer seen: the second half of its samples
    assert program.figures()["steady_rss_mib"] == 90.0
