"""``-p tests.cpu_per_test`` counts a test's CPU, its reaped children's included, across xdist's processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BURN = "import time; end = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
BURNS = f"""
import subprocess, sys, time

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", {BURN!r}], check=True)

def test_sleeps():
    time.sleep(0.3)
"""


def test_a_child_s_cpu_is_counted_to_the_test_that_reaped_it(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(BURNS)
    argv = [sys.executable, "-m", "pytest", "-p", "tests.cpu_per_test", "-n", "2", "-p", "no:cacheprovider", "-q"]
    argv += ["--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path / "test_burn.py")]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = dict(
        (name, float(cpu))
        for cpu, name in re.findall(r"^\s*([\d.]+) s CPU\s+[\d.]+ s wall  \S+::(\w+)", done.stdout, re.M)
    )
    assert figures["test_burns_in_a_child"] >= 0.5, done.stdout
    assert figures["test_sleeps"] < 0.2, done.stdout
