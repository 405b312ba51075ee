"""A task of a line this worker is not configured for goes back to the broker at once, for a worker that can run it.

The two lines share queues (``rollouts`` by default), so a worker set up for one line can be handed the other's
task: a 1.0 task on a worker without AGL_V1_SERVER_URL, a 0.3 task on one without AGENT_LIGHTNING_STORE_URL. Such a
worker can neither run nor report it. It rejects the message with requeue before touching anything (no lease, no
slot, no report; the dispatcher's in-flight mark stays, as the attempt is still published), so the rollout runs on
a capable worker within seconds, instead of waiting for the dispatcher's reconcile. It says so in its log once per
line and process (an ERROR naming the missing setting) and counts each hand-back in a metric.

Where no capable worker is free, the message comes straight back: each hand-back in a streak waits a little longer
before it is made (``wait_before``: none for the first, then doubling to ``CAP_S``), so a misconfigured node does
not spin on the broker and leaves the message to others for those seconds. A quiet ``RESET_S`` ends the streak.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from celery.exceptions import Reject

from workers.lifecycle import metrics, state

log = logging.getLogger("workers.unserved")

BASE_S = 0.1
CAP_S = 1.0  # holding a message this long delays it at most this much when a capable slot frees
RESET_S = 30.0
MAX_STREAK = 16  # bounds the count; the wait stops growing long before


@dataclass
class Refusals:
    """This process's hand-backs: the lines already named in its log, and the current streak."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    logged: set[str] = field(default_factory=set)
    streak: int = 0
    last: float = float("-inf")

    def wait_before(self, now: float) -> float:
        """Seconds to wait before this hand-back: 0 for the first of a streak, then ``BASE_S`` doubling to ``CAP_S``."""
        with self.lock:
            if now - self.last > RESET_S:
                self.streak = 0
            wait = 0.0 if self.streak == 0 else min(CAP_S, BASE_S * 2 ** (self.streak - 1))
            self.streak = min(self.streak + 1, MAX_STREAK)
            self.last = now
            return wait

    def first_time(self, line: str) -> bool:
        with self.lock:
            if line in self.logged:
                return False
            self.logged.add(line)
            return True


def hand_back(line: str, task_id: str, missing: str) -> Reject:
    """The Reject (requeue) that hands ``task_id`` of ``line`` back to the broker, after the streak's wait; logged
    once per line and process. ``missing`` names the setting this worker lacks for the line."""
    refusals = state.process.refusals
    if refusals.first_time(line):
        log.error(
            "this worker is not configured for Agent Lightning %s rollouts (%s is not set): it hands each such task "
            "back to the broker for a worker that is (first: %s); set %s on the workers of this queue, or keep "
            "this worker off it (-Q)",
            line,
            missing,
            task_id,
            missing,
        )
    metrics.UNSERVED_HANDBACKS.labels(line).inc()
    wait = refusals.wait_before(time.monotonic())
    if wait:
        time.sleep(wait)
    return Reject(f"not configured for Agent Lightning {line} rollouts ({missing} is not set)", requeue=True)
