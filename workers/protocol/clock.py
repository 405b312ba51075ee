"""The Store's clock as this worker sees it: measured once at start, logged, and corrected for afterwards.

The Store stamps attempts and runs its watchdog on its own clock (docs/store-protocol.md 6.3), and a worker
judges budgets and the freshness of its view against those stamps, so at start it measures the offset from a
few readings of the Store's ``Date`` header, logs it, corrects Store timestamps by it (``to_local``), and
refuses to start when the clocks are certainly further apart than ``CLOCK_SKEW_TOLERANCE_S``. Times the worker
sends (heartbeats) stay on its own clock: the tolerance bounds their error. Precision and operator's view:
docs/operations.md, "Clocks".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx

from bridge.core.infra import service_client
from bridge.core.settings import WorkerSettings
from bridge.core.store import API
from workers.lifecycle import state

log = logging.getLogger("workers.protocol.clock")

DATE_WINDOW_S = 2.0  # a Date header of D means the Store's time was in [D, D + 2): whole seconds, refreshed each second
SAMPLES = 4
SPACING_S = 0.25
EXIT_CODE = 2  # as a bad setting: the process cannot run correctly here


@dataclass(frozen=True)
class ClockReading:
    """The Store's clock minus this host's, known to lie within ``offset_s ± error_s`` seconds."""

    offset_s: float
    error_s: float

    def certainly_beyond(self, tolerance_s: float) -> bool:
        return abs(self.offset_s) - self.error_s > tolerance_s


def measure(client: httpx.Client, path: str = API + "/health", samples: int = SAMPLES) -> ClockReading | None:
    """Bound the offset from the ``Date`` headers of a few requests; None when the Store gives none.

    Each answer was produced between our send (t0) and receipt (t1) while the Store's clock read
    [D, D + DATE_WINDOW_S): the offset lies in [D - t1, D + DATE_WINDOW_S - t0]. The readings are intersected.
    """
    low, high = float("-inf"), float("inf")
    for i in range(samples):
        if i:
            time.sleep(SPACING_S)
        t0 = time.time()
        response = client.get(path)
        t1 = time.time()
        header = response.headers.get("date")
        if not header:
            return None
        try:
            stamp = parsedate_to_datetime(header).timestamp()
        except (TypeError, ValueError):
            return None
        sample_low, sample_high = stamp - t1, stamp + DATE_WINDOW_S - t0
        if max(low, sample_low) > min(high, sample_high):  # a clock stepped meanwhile: keep the latest reading
            low, high = sample_low, sample_high
        else:
            low, high = max(low, sample_low), min(high, sample_high)
    return ClockReading((low + high) / 2, (high - low) / 2)


def check_store_clock(settings: WorkerSettings) -> ClockReading | None:
    """Measure, log and adopt the Store's clock offset at worker start; exit beyond the tolerance.

    A Store that cannot be reached now does not stop the worker (it may start before the Store): the offset
    is then taken as 0 and a warning says so.
    """
    try:
        with service_client(settings.store_base, token=settings.store_token, timeout_s=5.0, max_connections=1) as c:
            reading = measure(c)
    except httpx.HTTPError as exc:
        log.warning("could not measure the Store's clock (%r); assuming it agrees with this host's", exc)
        return None
    if reading is None:
        log.warning("the Store sent no Date header; assuming its clock agrees with this host's")
        return None
    tolerance = settings.clock_skew_tolerance_s
    if tolerance and reading.certainly_beyond(tolerance):
        log.critical(
            "this host's clock is %+.1f s (±%.1f) off the Store's, beyond CLOCK_SKEW_TOLERANCE_S=%g: "
            "synchronise the clocks (NTP) before starting workers",
            -reading.offset_s,
            reading.error_s,
            tolerance,
        )
        raise SystemExit(EXIT_CODE)
    adopt(reading.offset_s)
    log.info(
        "Store clock offset %+.2f s (±%.2f); Store timestamps are corrected by it", reading.offset_s, reading.error_s
    )
    return reading


def adopt(offset_s: float) -> None:
    """Use ``offset_s`` (Store minus worker) from now on (``workers.lifecycle.state``: forked pool processes
    inherit it)."""
    state.node.clock_offset_s = offset_s


def store_offset_s() -> float:
    return state.node.clock_offset_s


def to_local(store_time: float) -> float:
    """A Store timestamp (epoch s on the Store's clock) on this host's clock."""
    return store_time - state.node.clock_offset_s
