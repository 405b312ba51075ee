"""A pytest plugin that writes every collected test's markers to the JSON file ``COLLECTED_MARKS_TO`` names.

``python -m pytest --collect-only -m "" -p tests.collected_marks`` then shows which run takes each test (the default
one, ``-m nightly``, ``-m deployed``); tests/unit/test_runs.py reads it.
"""

from __future__ import annotations

import json
import os

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    target = os.environ.get("COLLECTED_MARKS_TO")
    if not target:
        return
    found = {}
    for item in session.items:
        nightly = item.get_closest_marker("nightly")
        found[item.nodeid] = {
            "marks": sorted({mark.name for mark in item.iter_markers()}),
            "nightly": (nightly.args[0] if nightly.args else "") if nightly is not None else None,
        }
    with open(target, "w") as out:
        json.dump(found, out)
