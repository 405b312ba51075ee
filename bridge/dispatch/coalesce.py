"""How long the bridge lets freed slots gather before it dequeues again, once every slot was busy.

With every slot busy, slots free one at a time as episodes end, and a dequeue per freed slot costs the
Store one request per rollout (1.03 per rollout measured at 128 slots of 12 s episodes). Waiting a
little lets several freed slots share one dequeue. The wait is a small share (``SHARE``, 2%) of the
mean episode time, which Little's law gives from the slots and the recent dispatch rate (at full capacity
rollouts are dispatched as fast as they finish), so a freed slot idles at most about 2% of an episode
longer; ``BRIDGE_COALESCE_MAX_S`` caps it (0 turns it off). Short episodes get a wait of a few
milliseconds. Below the cap (1.5 s: episodes up to 75 s) about ``SHARE * slots`` slots free during a wait
whatever the episode length (Little's law again), so a dequeue claims that many plus one; a lower cap made
long episodes pay a dequeue for nearly every rollout (0.25 s at 60 s episodes on 128 slots: 0.5 freed
slots a wait).

The same share bounds the polls of an empty queue (``idle_poll_s``): while a batch's last wave runs, slots
free one by one and the queue is empty until the trainer enqueues the next batch. Polling it every
``BRIDGE_POLL_MAX_S`` (0.2 s) cost the Store about 0.5 empty dequeues per rollout at 30 s episodes, as many
as every other request of the bridge; polling every 2% of the episode time last measured at capacity lets
a new batch's first rollout wait that much longer, like a coalescing wait. Figures: docs/performance.md.
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
