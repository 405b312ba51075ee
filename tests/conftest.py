"""Test-session set-up shared by unit and integration tests: signals, this process's Redis, the schedule.

The suite runs in parallel (pytest-xdist, ``-n`` in pyproject's addopts). Each worker process owns its
Redis database or server (``tests/redis_for_tests.py``), its Store, WebShop server and LLM stand-in
(``tests/integration/conftest.py``), its ports and its RabbitMQ vhosts. The tests are handed out as
groups (a module, or a ``cost`` test alone) longest first, so the long scenarios start at once and
short modules fill the gaps around them (``tests/schedule.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.core.infra import process_state
from tests import collected_marks, cpu_load, redis_for_tests, schedule

pytest_plugins = ["pytester"]  # tests/unit/test_schedule.py runs collections of its own


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A CI timeout or `kill` sends SIGTERM: turn it into KeyboardInterrupt so fixtures tear down the processes
# they started (they run in their own sessions and would otherwise outlive the test run).
signal.signal(signal.SIGTERM, _interrupt)

# No network here: LiteLLM (in the Store and wherever agentlightning is imported, unit tests included) uses its
# bundled model cost map instead of fetching one (three failing fetches with 6 s of back-off otherwise); child
# processes inherit it.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Bytecode caches (git-ignored __pycache__) are written even where PYTHONDONTWRITEBYTECODE is set: without them each
# of the run's hundreds of processes compiles the project again, and each test process rewrites every test module's
# asserts (pytest caches that as bytecode too). docs/test-suite.md, "What it costs".
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns each item's group into its node id suffix
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected_marks.record(config, items)  # before -m deselects: tests/unit/test_runs.py reads every test's marks
    schedule.order(items, name_groups=config.pluginmanager.hasplugin("xdist"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return schedule.LongestFirst(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    cpu_load.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    cpu_load.start(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    cpu_load.stop()
    redis_for_tests.stop()


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    """Leave this process's state as a fresh process has it (``bridge.core.infra.process_state.reset``, which resets
    ``workers.lifecycle.state`` too): no test sees clients, caches, offsets or flags another one left."""
    yield
    process_state.reset()


@pytest.fixture
def outbox() -> Iterator[Path]:
    """A directory a boxed 1.0 program can write to (mode 1777 outside pytest's 0700 temporary directories), for
    what a test's program reports; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="agl-test-outbox-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fork_like_a_trainer() -> None:
    """Fork as a trainer's process does: without the broker connection pools other tests left in this one.

    kombu registers each pool for closing in a forked child; a pool whose connection another test left with a
    BRPOP in flight makes that child block on a socket its parent still reads, before any of the test's code
    runs. A trainer forks its runners before it opens a broker connection, so those cleanups are dropped here.
    """
    import multiprocessing.util

    from kombu.resource import _after_fork_cleanup_resource

    registry = multiprocessing.util._afterfork_registry  # type: ignore[attr-defined]
    for key in [key for key in list(registry.keys()) if key[2] is _after_fork_cleanup_resource]:
        registry.pop(key, None)
