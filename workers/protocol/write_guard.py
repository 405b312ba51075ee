"""``WriteGuard``: whether this executor may still write into its attempt: the lease proof and the freshness of
its fence (the rule itself: ``workers.protocol.fencing.fence``).

Nothing is written into an attempt (spans or the final report) on the strength of an unknown lease, and the
rollout is read from the Store before a write whenever the last view of it that passed the fence could be
stale: older than ``FENCE_MAX_AGE_S``, or the Store's watchdog could have acted since (docs/cluster.md;
docs/architecture.md, "Guarantees").
"""

from __future__ import annotations

import time

import redis

from bridge.core.infra import LeaseUnproven, Superseded, TelemetryError, retry_until
from bridge.core.settings import WorkerSettings
from workers.protocol.attempt import Attempt
from workers.protocol.heartbeat import AttemptWatch, watchdog_may_act
from workers.protocol.lease import Lease
from workers.telemetry.spans import AttemptTelemetry


class WriteGuard:
    """The lease (None: a rejected payload, never leased) and the freshest evidence about the rollout.

    ``viewed`` records the latest read of the rollout that passed the fence; ``follow`` adds the running
    attempt's heartbeats (each renews the view) and span deliveries (each proves the attempt alive).
    """

    def __init__(self, attempt: Attempt, lease: Lease | None, settings: WorkerSettings) -> None:
        self.attempt = attempt
        self.lease = lease
        self.settings = settings
        self._viewed_at = 0.0  # epoch s of the freshest view of the rollout that passed the fence
        self._watch: AttemptWatch | None = None
        self._telemetry: AttemptTelemetry | None = None

    @property
    def viewed_at(self) -> float:
        return self._viewed_at

    def viewed(self, at: float) -> None:
        """A view of the rollout taken at ``at`` (epoch s) passed the fence: the latest one counts."""
        self._viewed_at = at

    def follow(self, watch: AttemptWatch, telemetry: AttemptTelemetry) -> None:
        """Count the running attempt's heartbeats and span deliveries as evidence from now on."""
        self._watch, self._telemetry = watch, telemetry

    def view_is_fresh(self, viewed_at: float, *, alive_at: float) -> bool:
        """A view of the rollout taken at ``viewed_at`` still holds: recent enough, and no watchdog since."""
        rollout = self.attempt.rollout
        if rollout is None:
            return False
        now = time.time()
        if now - viewed_at > self.settings.fence_max_age_s:
            return False
        return not watchdog_may_act(rollout.config, self.attempt.dequeued_at, alive_at, now)

    def must_read_before_write(self) -> bool:
        """Whether no view or sign of life is fresh enough: the rollout must be read before the next write."""
        viewed, alive = self._viewed_at, self.attempt.dequeued_at
        if self._watch is not None:
            viewed, alive = max(viewed, self._watch.viewed_at), max(alive, self._watch.alive_at)
        if self._telemetry is not None:
            alive = max(alive, self._telemetry.delivered_at)
        return not self.view_is_fresh(viewed, alive_at=alive)

    def write_bound(self) -> float:
        """Seconds one write into the attempt may take after a renewal: it must land while the lease is ours."""
        bound = self.settings.store_timeout_s
        return bound if self.lease is None else min(bound, max(1.0, self.settings.lease_ttl_s / 2))

    def prove_lease(self, until: float) -> None:
        """Return once Redis confirms the attempt is still ours (renewing the lease); retry until ``until``.

        Raises ``Superseded`` when another executor took it over, ``LeaseUnproven`` when Redis could not tell
        in time. A host cut off by a partition would otherwise deliver spans or a report into an attempt
        another host runs, once its link is back (docs/cluster.md).
        """

        def first_warning(tries: int, exc: BaseException) -> None:
            if tries == 0:
                self.attempt.log.warning("could not confirm the lease (%r); writing nothing until Redis answers", exc)

        try:
            reason = retry_until(self.lease_lost, redis.RedisError, until, on_retry=first_warning)
        except redis.RedisError as exc:
            raise LeaseUnproven(f"could not confirm the lease: {exc!r}") from exc
        if reason is not None:
            raise Superseded(reason)

    def lease_lost(self) -> str | None:
        """Why we no longer execute this attempt (another executor took it over), or None.

        Raises RedisError when Redis cannot tell; the caller then reads the Store instead.
        """
        if self.lease is None or self.lease.renew():
            return None
        return "another executor took this attempt over (the lease is not ours)"

    def flush_while_ours(self, telemetry: AttemptTelemetry, until: float) -> None:
        """Deliver the attempt's spans in rounds that each prove the lease first and end before it could lapse.

        A stalled executor whose attempt was taken over writes nothing into it, and a batch held up by a
        partition is never delivered after another host could have taken the attempt over. A failed round
        is retried (a Store outage) until ``until``; the last error is raised.
        """

        def one_round() -> None:
            self.prove_lease(until)
            bound = self.write_bound()
            telemetry.flush(deadline=min(until, time.time() + bound), timeout=bound, together=True)

        # Without a lease nothing can lapse: one round, whose own deadline covers the retries.
        retry_until(one_round, TelemetryError, until if self.lease is not None else 0.0)
