"""The bounded drain's start (``WORKER_SHUTDOWN_GRACE_S``; what a drain does: ``workers.lifecycle.drain``).

A worker bootstep (``DrainStart``), included where the grace is set: the warm shutdown's signal reaches the node's
main process only. Its ``start`` hooks ``worker_shutting_down``, sent at the signal itself, where the drain's stop time
and this process's exit deadline are counted from; no step's ``stop`` comes that early. It requires
``SlotAdvertising``, whose hook withdraws the adverts first (Celery calls a signal's receivers in the order they were
connected, which is the order the steps start in) and whose advert names the node and the Redis the stop time is
published in: a node that never advertised (not ready yet) does not drain. Its ``stop`` unhooks it; its state is this
process's ``DrainClock`` (``state.process.drain_clock``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps, signals

from bridge.core.settings import get_settings
from workers.lifecycle import drain, state
from workers.lifecycle.steps.advertising import SlotAdvertising, current_advert

log = logging.getLogger(__name__)


class DrainStart(bootsteps.StartStopStep):
    """Starts the bounded drain at ``worker_shutting_down``, after the adverts' withdrawal."""

    label = "bounded drain"
    requires = (SlotAdvertising,)

    def include_if(self, w: Any) -> bool:
        return get_settings().worker_shutdown_grace_s is not None

    def start(self, w: Any) -> None:
        signals.worker_shutting_down.connect(begin_drain, weak=False, dispatch_uid=__name__)

    def stop(self, w: Any) -> None:
        signals.worker_shutting_down.disconnect(dispatch_uid=__name__)

    terminate = stop


def begin_drain(**_: Any) -> None:
    """Record the stop time for every process of the node, and this one's exit deadline."""
    grace = get_settings().worker_shutdown_grace_s
    advert = current_advert()
    if grace is None or advert is None:
        return
    clock = state.process.drain_clock
    clock.incarnation = state.node.incarnation
    if clock.draining:
        return
    stop_at = clock.begin(advert.client, advert.scope, advert.hostname, grace)
    drain.exit_by(time.time() + grace - drain.EXIT_EARLY_S)
    log.warning(
        "draining: episodes still running in %.1f s are stopped and handed over; exiting within %g s",
        stop_at - time.time(),
        grace,
    )
