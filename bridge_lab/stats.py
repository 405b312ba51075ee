"""Summary statistics of the lab's measurements, written once (numpy) so demo, bench and scripts agree.

Percentiles are nearest-rank (numpy's ``inverted_cdf``): every figure reported is a value that was
actually measured, never an interpolation between two rollouts, and p99 of a small sample is its
maximum rather than an extrapolation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None without data, so an empty phase shows as missing."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q, method="inverted_cdf"))


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean; None without data (a figure that was not measured is not zero)."""
    return float(np.mean(np.asarray(values, dtype=float))) if len(values) else None


def rounded(value: float | None, digits: int = 2) -> float | None:
    """``round`` that lets a missing figure through, for JSON summaries."""
    return None if value is None else round(value, digits)
