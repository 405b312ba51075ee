"""The parallel suite's schedule (``tests/schedule.py``): groups, their costs and their order, on a collection."""

from __future__ import annotations

import pytest

from tests import schedule

MODULES = {
    "test_short": "def test_one(): pass\ndef test_two(): pass\n",
    "test_declared": "import pytest\npytestmark = pytest.mark.cost(50)\ndef test_a(): pass\ndef test_b(): pass\n",
    "test_mixed": (
        "import pytest\n"
        "def test_quick(): pass\n"
        "@pytest.mark.cost(100)\ndef test_scenario(): pass\n"
        "@pytest.mark.cost(20)\n@pytest.mark.parametrize('n', [1, 2])\ndef test_each(n): pass\n"
    ),
}


def test_costly_tests_run_alone_and_groups_go_longest_first(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    cost(seconds): test\n")
    pytester.makepyfile(**MODULES)
    items, _ = pytester.inline_genitems()
    schedule.order(items)
    groups = [next(item.iter_markers("xdist_group")).args[0] for item in items]
    assert groups == [
        "test_mixed.test_scenario",
        "test_declared",
        "test_declared",
        "test_mixed.test_each[1]",
        "test_mixed.test_each[2]",
        "test_short",  # 2 x DEFAULT_COST_S, collected before test_mixed's one unmarked test
        "test_short",
        "test_mixed",
    ]
    assert [item.name for item in items][:3] == ["test_scenario", "test_a", "test_b"]


def test_without_xdist_no_group_is_named(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    cost(seconds): test\n")
    pytester.makepyfile(**MODULES)
    items, _ = pytester.inline_genitems()
    schedule.order(items, name_groups=False)
    assert not [item for item in items if item.get_closest_marker("xdist_group")]
    assert items[0].name == "test_scenario"
