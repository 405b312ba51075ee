"""``--cpu-load N``: N CPU-bound busy loops beside the whole test run, the way the suite is checked on a busy machine.

A trainer's cluster is never quiet, and the guarantees must hold there (docs/test-suite.md, "Under load"). The
loops are started by the controlling pytest process only (not by each xdist worker), run in sessions of their own,
die with it however it dies (``bridge_lab.reaper``) and are stopped when the run ends.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bridge_lab.procs import ManagedProcess, stop_all

_loops: list[ManagedProcess] = []


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-load",
        type=int,
        default=0,
        metavar="N",
        help="run N CPU-bound busy loops beside the suite for its whole run (docs/test-suite.md, 'Under load')",
    )


def start(config: pytest.Config) -> None:
    """Start the loops ``--cpu-load`` asks for, in the controlling process only."""
    count = int(config.getoption("--cpu-load") or 0)
    if count < 0:
        raise pytest.UsageError("--cpu-load takes a number of busy loops, 0 or more")
    if hasattr(config, "workerinput"):  # an xdist worker: the controller runs them for the whole run
        return
    for index in range(count):
        loop = ManagedProcess(
            f"cpu-load-{index}",
            [sys.executable, "-c", "while True: pass"],
            log_path=Path(os.devnull),
            healthy=lambda: True,
        )
        loop.start()
        _loops.append(loop)


def stop() -> None:
    """Stop the loops this process started."""
    stop_all(_loops, timeout_s=5)
    _loops.clear()


def running() -> int:
    """How many loops this process runs now."""
    return sum(loop.alive() for loop in _loops)
