"""Where the suite's CPU goes, test by test: ``python -m pytest -p tests.cpu_per_test``.

Each test process adds up, around every test (setup, call and teardown), its own CPU time and that of the children it
reaped meanwhile (``RUSAGE_CHILDREN``: a worker node, its pool, a Store, once stopped); at the end the controlling
process prints the tests and the modules that cost most. A process a module-scoped fixture started is counted
where it is stopped, and a session's services at the last test of their process, so read single figures with care
and totals with confidence. docs/test-suite.md ("What it costs") shows what this found.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import pytest

SHOWN = 15
_ROWS: list[tuple[str, float, float]] = []  # node id, CPU seconds (own and reaped children), wall seconds


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _folder(config: pytest.Config) -> Path:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return Path(workerinput["cpu_per_test_dir"])
    folder: Path | None = getattr(config, "_cpu_per_test_dir", None)
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="cpu-per-test-"))
        config._cpu_per_test_dir = folder  # type: ignore[attr-defined]
    return folder


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """xdist: each test process writes its figures where the controlling process reads them."""
    node.workerinput["cpu_per_test_dir"] = str(_folder(node.config))  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    cpu, wall = _cpu(), time.monotonic()
    yield
    _ROWS.append((item.nodeid, _cpu() - cpu, time.monotonic() - wall))


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = _folder(session.config)
    if _ROWS:
        (folder / f"{os.getpid()}.json").write_text(json.dumps(_ROWS))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    rows = [row for path in _folder(config).glob("*.json") for row in json.loads(path.read_text())]
    if not rows:
        return
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for nodeid, cpu, wall in rows:
        module = modules[nodeid.split("::")[0]]
        module[0] += cpu
        module[1] += wall
    write = terminalreporter.write_line
    terminalreporter.section("CPU per test (own and reaped children)")
    write(f"{sum(cpu for _, cpu, _ in rows):.0f} s of CPU over {len(rows)} tests")
    for nodeid, cpu, wall in sorted(rows, key=lambda row: -row[1])[:SHOWN]:
        write(f"{cpu:7.1f} s CPU {wall:7.1f} s wall  {nodeid}")
    write("by module:")
    for name, (cpu, wall) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
        write(f"{cpu:7.1f} s CPU {wall:7.1f} s wall  {name}")
