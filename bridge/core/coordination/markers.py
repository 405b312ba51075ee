"""What Redis says of an attempt's execution: the markers its executor keeps (``workers.protocol.lease``).

An executor holds the attempt's lease while it runs it (renewed by the heartbeat), sets its ``started`` marker
when it first starts it and its ``done`` marker (the final status it reported) when it reports. The dispatchers'
reconcile reads them to tell an attempt someone runs, or ran, from a stranded one; each line names its attempts
by its own key (a 0.3 attempt id, a 1.0 attempt's scoped key), and the markers are the same for both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from bridge.core.coordination import keys


@dataclass(frozen=True)
class LeaseMarkers:
    """One attempt's execution markers."""

    leased: bool  # an executor holds it now
    started: bool  # an executor started it at some point
    reported: str | None  # the final status it was reported with (its ``done`` marker), if any

    @property
    def done(self) -> bool:
        return self.reported is not None


NO_TRACE = LeaseMarkers(leased=False, started=False, reported=None)
"""An attempt Redis holds no marker of: no lease, never started, never reported."""


def queue_reads(pipe: redis.client.Pipeline, key: str) -> None:
    """Add the three reads of attempt ``key``'s markers to ``pipe``; ``from_answers`` reads them back."""
    pipe.exists(keys.lease(key))
    pipe.exists(keys.started(key))
    pipe.get(keys.done(key))


def from_answers(leased: object, started: object, reported: str | None) -> LeaseMarkers:
    """The markers from the three answers ``queue_reads`` asked for, in order."""
    return LeaseMarkers(bool(leased), bool(started), reported)


def read_markers(client: redis.Redis, attempt_keys: Iterable[str]) -> dict[str, LeaseMarkers]:
    """Each attempt's markers, in one round trip."""
    names = list(attempt_keys)
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for key in names:
        queue_reads(pipe, key)
    answers = pipe.execute()
    return {key: from_answers(*answers[3 * i : 3 * i + 3]) for i, key in enumerate(names)}
