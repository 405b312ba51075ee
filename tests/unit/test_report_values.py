"""A report is checked before it is kept: the Store's JSON cannot carry NaN, infinities or objects."""

from __future__ import annotations

import math

import numpy
import pytest

from workers.protocol.reporting import not_json


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({"reward": math.nan}, "metadata.reward is nan"),
        ({"reward": numpy.float64("-inf")}, "metadata.reward is -inf"),  # a float subclass, as np.mean gives
        ({"reward_info": {"r_att": [0.5, math.inf]}}, "metadata.reward_info.r_att[1] is inf"),
        ({"agent": object()}, "metadata.agent is a object, not JSON"),
        ({"info": {3: "x"}}, "metadata.info has a key 3"),
    ],
)
def test_a_value_json_cannot_carry_is_named_with_its_path(metadata: dict[str, object], named: str) -> None:
    found = not_json(metadata)
    assert found is not None and found.startswith(named), found


def test_plain_json_passes() -> None:
    assert not_json({"reward": 0.5, "steps": 3, "done": True, "info": {"a": [1, "b", None]}, "t": (1.0,)}) is None
