"""What a test needs from the machine, and what becomes of it when that is missing.

Off CI, a missing prerequisite skips the test and says which one (``pytest -rs`` lists every reason; the
project's addopts turn that on). On CI (``CI=true``), whose ``.ci/run`` installs and starts each of them
(Redis, RabbitMQ, the Store, root for network namespaces, socat), the same test fails instead: a broken
install step can no longer hide behind a green run of skips. No tests live here.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ON_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def missing(reason: str) -> NoReturn:
    """Skip with ``reason``; on CI fail with it, because CI provides every prerequisite."""
    if ON_CI:
        pytest.fail(f"a prerequisite CI provides is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def require(why_not: str | None) -> None:
    """``missing(why_not)`` unless ``why_not`` is None (a probe that returns the reason it cannot run)."""
    if why_not is not None:
        missing(why_not)
