"""The suite's three runs take every test exactly once: the default run (``.venv/bin/python -m pytest``), the
nightly-size run (``-m nightly``) and the deployed stage (``-m deployed``); .ci/run runs all three and the README
names each. Every test that waits for the nightly-size run says why (``@pytest.mark.nightly(why)``), and
docs/test-suite.md lists each with that reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression

from tests import collected_marks

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"nightly": "nightly", "deployed": "deployed"}  # a run asked for by name -> its -m expression
DOC = ROOT / "docs" / "test-suite.md"
ROW = re.compile(r"^\| `(tests/[^`]+)` \| (.+?) \|$", re.M)


def _default_expression() -> str:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    words = shlex.split(addopts)
    return words[words.index("-m") + 1]


@pytest.fixture(scope="module")
def collected(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every test's marks: this session's own record when it collected the whole suite (the default run), else
    one collection of the whole suite in a subprocess."""
    recorded = collected_marks.whole_suite(request.config)
    if recorded is not None:
        return recorded
    target = tmp_path_factory.mktemp("collected") / "marks.json"
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "", "-p", "tests.collected_marks"]
    argv += ["-p", "no:cacheprovider"]
    env = {**os.environ, "COLLECTED_MARKS_TO": str(target)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found: dict[str, dict[str, Any]] = json.loads(target.read_text())
    return found


def _selects(expression: str, marks: list[str]) -> bool:
    return Expression.compile(expression).evaluate(lambda name, /, **kwargs: name in marks)


def test_every_test_runs_in_exactly_one_of_the_three_runs(collected: dict[str, dict[str, Any]]) -> None:
    runs = {"default": _default_expression(), **RUNS}
    assert len(collected) > 1000  # the whole suite, not an empty collection
    for nodeid, found in collected.items():
        taken = [run for run, expression in runs.items() if _selects(expression, found["marks"])]
        assert len(taken) == 1, f"{nodeid} (marks {found['marks']}) runs in {taken or 'no run'}"
    nightly = [nodeid for nodeid, found in collected.items() if found["nightly"] is not None]
    assert nightly, "no test is left to the nightly-size run: drop the run, or mark what moved"


def test_each_nightly_test_says_why_and_docs_list_it_with_that_reason(collected: dict[str, dict[str, Any]]) -> None:
    rows = dict(ROW.findall(DOC.read_text()))
    used: set[str] = set()
    for nodeid, found in collected.items():
        why = found["nightly"]
        if why is None:
            continue
        assert why.strip(), f"{nodeid}: @pytest.mark.nightly without a reason"
        keys = [k for k in rows if nodeid == k or nodeid.startswith((k + "::", k + "["))]
        assert keys, f"{nodeid} waits for the nightly-size run, and docs/test-suite.md does not list it"
        key = max(keys, key=len)
        assert rows[key] == why, f"docs/test-suite.md gives {key} another reason than its mark: {why!r}"
        used.add(key)
    assert not set(rows) - used, f"docs/test-suite.md lists as nightly what is not: {sorted(set(rows) - used)}"


def test_ci_runs_each_named_run_and_the_readme_names_it() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    for run in RUNS:
        assert re.search(rf"^\.venv/bin/python -m pytest .*-m {run}\b", ci, re.M), f".ci/run does not run -m {run}"
        assert f"-m {run}" in readme, f"the README does not name the {run} run"
    assert re.search(r"^\.venv/bin/python -m pytest -q -p no:cacheprovider$", ci, re.M), ".ci/run's default run"
