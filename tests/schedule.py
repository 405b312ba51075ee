"""How the parallel suite hands tests to its worker processes: whole groups, the longest first.

A group is a test module (its module-scoped stacks start once) or a single test marked
``@pytest.mark.cost(seconds)``, which runs alone so that one long scenario never queues another behind it
on the same worker. A module may carry ``pytestmark = pytest.mark.cost(seconds)`` for the whole of it; an
unmarked test counts ``DEFAULT_COST_S``. The figures are rough wall-clock seconds of a test run alone on
the 2-core machine (``--durations`` prints the real ones); they only order the groups, so a stale figure
costs some wall time and never a result. Longest first, each worker taking the next group when it has
less than two tests left, keeps the slowest scenario from starting last.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

DEFAULT_COST_S = 0.1  # most unmarked tests are unit tests of a few milliseconds to a second


def _own_cost(node: pytest.Item | pytest.Collector | None) -> float | None:
    for mark in getattr(node, "own_markers", []):
        if mark.name == "cost":
            return float(mark.args[0])
    return None


def group_of(item: pytest.Item) -> tuple[str, float, bool]:
    """``(group name, seconds, whether they are the whole group's cost or what the item adds to it)``."""
    module = item.getparent(pytest.Module)
    module_name = module.path.stem if module is not None else item.nodeid.split("::")[0]
    alone = _own_cost(item)
    if alone is not None:
        return f"{module_name}.{item.name}", alone, True
    declared = _own_cost(module)
    if declared is not None:
        return module_name, declared, True
    return module_name, DEFAULT_COST_S, False


def order(items: list[pytest.Item], *, name_groups: bool = True) -> None:
    """Sort ``items`` group by group, costliest group first; ``name_groups``: mark each item's group for xdist."""
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    cost: dict[str, float] = defaultdict(float)
    for item in items:
        name, seconds, whole = group_of(item)
        groups[name].append(item)
        cost[name] = seconds if whole else cost[name] + seconds
        if name_groups:
            item.add_marker(pytest.mark.xdist_group(name))
    first_seen = {name: index for index, name in enumerate(groups)}
    ranked = sorted(groups, key=lambda name: (-cost[name], first_seen[name]))
    items[:] = [item for name in ranked for item in groups[name]]


class LongestFirst(LoadGroupScheduling):
    """xdist's group scheduling in the order collected (no reordering by test count), one group ahead."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        # A worker runs a test once it knows the next one (fixture teardown depends on it): two pending
        # keep it busy, and a third would be a long group taken from a worker that frees up sooner.
        if self._pending_of(self.assigned_work[node]) >= 2:
            return
        self._assign_work_unit(node)
