"""How long the bridge lets freed slots gather before it dequeues again, once every slot was busy.

A dequeue per freed slot would cost the Store a request per rollout, so the bridge waits ``SHARE`` (2%) of
the mean episode time, which Little's law gives from the slots and the recent dispatch rate: a freed slot
idles at most about 2% of an episode longer, and about ``SHARE * slots`` slots free meanwhile, whatever the
episode length. ``BRIDGE_COALESCE_MAX_S`` caps the wait (0 turns it off). The same share bounds the polls of
an empty queue once long episodes filled every slot (``idle_poll_s``). Figures: docs/performance.md,
"Store requests per rollout".
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

SHARE = 0.02  # of the mean episode time
SAMPLES = 64  # recent dispatches the rate is read from
MIN_SAMPLES = 8  # fewer: no estimate, no wait


class Coalescer:
    def __init__(self, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s = max_s
        self._clock = clock
        self._times: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self._episode_s: float | None = None  # mean episode time, last measured with every slot busy

    def dispatched(self) -> None:
        self._times.append(self._clock())

    def wait_s(self, slots: int) -> float:
        """Seconds to wait after a slot freed while ``slots`` were all busy, before the next dequeue."""
        times = self._times
        if self.max_s <= 0 or slots <= 0 or len(times) < MIN_SAMPLES:
            return 0.0
        elapsed = max(times[-1], self._clock() - 1.0) - times[0]  # a stale rate (long idle) counts as slow
        if elapsed <= 0:
            return 0.0
        rate = (len(times) - 1) / elapsed
        self._episode_s = slots / rate
        return self.idle_poll_s()

    def idle_poll_s(self) -> float:
        """The share of the episode time last measured at capacity, capped: 0 before any measurement, or when off."""
        if self.max_s <= 0 or self._episode_s is None:
            return 0.0
        return min(self.max_s, SHARE * self._episode_s)
