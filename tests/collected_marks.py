"""Every collected test's markers, before ``-m`` deselects any: which run takes each test (the default one,
``-m nightly``, ``-m deployed``); tests/unit/test_runs.py reads them.

* ``tests/conftest.py`` records them in every session (``record``), so a run that collected the whole suite (the
  default run's workers do) answers from memory: ``whole_suite``;
* as a plugin, ``python -m pytest --collect-only -m "" -p tests.collected_marks`` writes them to the JSON file
  ``COLLECTED_MARKS_TO`` names, for a session that collected less (one module run alone).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

Marks = dict[str, dict[str, Any]]
RECORDED = pytest.StashKey[Marks]()
TESTS = Path(__file__).resolve().parent


def marks_of(items: list[pytest.Item]) -> Marks:
    """Each item's node id -> its marker names and its nightly reason (None when it is not nightly)."""
    found: Marks = {}
    for item in items:
        nightly = item.get_closest_marker("nightly")
        found[item.nodeid] = {
            "marks": sorted({mark.name for mark in item.iter_markers()}),
            "nightly": (nightly.args[0] if nightly.args else "") if nightly is not None else None,
        }
    return found


def record(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep ``items``' marks in ``config`` (call it before ``-m`` deselects)."""
    config.stash[RECORDED] = marks_of(items)


def whole_suite(config: pytest.Config) -> Marks | None:
    """The marks this session recorded when it collected the whole suite (no path but ``tests`` asked for, no
    ``-k``), else None."""
    asked = {Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args}
    if asked - {TESTS, TESTS.parent} or config.option.keyword:
        return None
    return config.stash.get(RECORDED, None)


def pytest_collection_finish(session: pytest.Session) -> None:
    target = os.environ.get("COLLECTED_MARKS_TO")
    if target:
        with open(target, "w") as out:
            json.dump(session.config.stash[RECORDED], out)
