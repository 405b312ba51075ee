"""The end of one attempt: the state a delivery carries, the fence re-check and the final report.

``workers.execution.AttemptRun`` builds on this with the run itself. Kept apart because this is the
path the trainer's guarantees rest on (docs/store-protocol.md 6.2, 10): spans are flushed before the
final status, the fence is re-checked right before reporting (the Store never refuses a stale report),
a report that lost its fence is withheld, and a delivered report is marked done in Redis so that a
redelivery of the message never runs the attempt again. The report itself is decided once and kept in
Redis until the Store took it: a Celery retry or a redelivery delivers that report, it never judges an
attempt whose episode has run a second time (docs/architecture.md, "Guarantees"; tests/integration/test_report_path.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import redis
from celery.exceptions import SoftTimeLimitExceeded

from bridge.core import keys
from bridge.core.backoff import backoff_delay, retry_until
from bridge.core.errors import LeaseUnproven, StoreError, StoreUnavailable, Superseded, UnknownIdError
from bridge.core.logs import RolloutLogger
from bridge.core.models import AttemptedRollout, AttemptStatus
from workers import metrics as worker_metrics
from workers.failures import FailureClass
from workers.fence_board import fence
from workers.heartbeat import AttemptWatch, watchdog_may_act
from workers.lease import Lease, executor_id, mark_done
from workers.resources import WorkerResources
from workers.telemetry import AttemptTelemetry, current_trace_id

REPORT_GRACE_S = 300.0


@dataclass
class Outcome:
    """What happened to one delivery of a task (returned by the Celery task, shown in Flower)."""

    status: str  # succeeded | failed | skipped
    reason: str = ""
    failure_class: str | None = None
    reward: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


class RunResult(Protocol):
    """What a finished agent run reports: the WebShop ``EpisodeResult`` or a LitAgent's ``AgentRunResult``.

    ``blame`` is the failure class of a result the Store cannot take (a value that is not JSON).
    """

    blame: ClassVar[FailureClass]

    @property
    def reward(self) -> float | None: ...

    def metadata(self) -> dict[str, object]: ...


class ReportPending(StoreUnavailable):
    """The final report is kept in Redis, but the Store did not take it in time: a Celery retry delivers it."""


@dataclass(frozen=True)
class PendingReport:
    """A final report, decided once per attempt: every delivery of the attempt sends exactly this."""

    status: AttemptStatus
    metadata: dict[str, Any]
    deadline: float  # epoch s: delivery is retried until then (the attempt's own deadline)

    def to_json(self) -> str:
        data = {"status": str(self.status), "metadata": self.metadata, "deadline": self.deadline}
        return json.dumps(data, allow_nan=False)

    @classmethod
    def from_json(cls, raw: object) -> PendingReport | None:
        """The kept report, or None when there is none (or it is unreadable: then the attempt is judged anew)."""
        if not isinstance(raw, (bytes, str)):
            return None
        try:
            data = json.loads(raw)
            return cls(AttemptStatus(data["status"]), dict(data["metadata"]), float(data["deadline"]))
        except (ValueError, KeyError, TypeError):
            return None

    def outcome(self) -> Outcome:
        """What the task returns once this report was delivered."""
        if self.status == AttemptStatus.SUCCEEDED:
            return Outcome("succeeded", reward=self.metadata.get("reward"))
        return Outcome("failed", str(self.metadata.get("error", "")), self.metadata.get("failure_class"))


class AttemptReporter:
    """One delivery's state and the report that ends it; ``AttemptRun`` subclasses it with the run."""

    rid: str  # set once the payload named its ids
    aid: str
    log: RolloutLogger

    def __init__(self, payload: Any, *, celery_task_id: str, res: WorkerResources) -> None:
        self.payload = payload
        self.celery_task_id = celery_task_id
        self.res = res
        self.settings = res.settings
        self.executor = executor_id()
        self.started = time.time()
        self.trace_id = current_trace_id()
        self.rollout: AttemptedRollout | None = None
        self.lease: Lease | None = None
        self.watch: AttemptWatch | None = None
        self.telemetry: AttemptTelemetry | None = None
        self.dequeued_at = self.started  # the attempt's start_time once the payload is parsed
        self.viewed_at = 0.0  # epoch s of the freshest view of the rollout that passed the fence

    @property
    def attempted(self) -> AttemptedRollout:
        """The validated payload; only used after ``execute`` validated it."""
        assert self.rollout is not None
        return self.rollout

    # --- reporting ---------------------------------------------------------------------------

    def _report_success(self, result: RunResult, telemetry: AttemptTelemetry) -> Outcome:
        metadata = {**self._base_metadata(telemetry), **result.metadata()}
        bad = not_json(metadata)
        if bad is not None:  # checked before the report is kept: the Store could never take it
            return self._report_failure(result.blame, f"the result cannot be reported: {bad}", telemetry)
        outcome = self._report(AttemptStatus.SUCCEEDED, metadata)
        if outcome is None:
            return Outcome("succeeded", reward=result.reward)
        return outcome

    def _report_failure(self, failure: FailureClass, error: str, telemetry: AttemptTelemetry | None = None) -> Outcome:
        metadata = {**self._base_metadata(telemetry), "error": error[:2000], "failure_class": str(failure)}
        self.log.warning("failed (%s): %s", failure, error)
        outcome = self._report(AttemptStatus.FAILED, metadata)
        if outcome is not None:
            return outcome
        return Outcome("failed", error, str(failure))

    def _disable_retries(self) -> None:
        """Bad input fails the same way every time: make this attempt the rollout's last before reporting it.

        Setting ``max_attempts`` to this attempt's sequence id makes the Store derive ``failed`` from the
        report instead of requeuing (docs/store-protocol.md 6.2). Done before the report, so no retry attempt can
        be dequeued in between, and the latest attempt keeps the error in its metadata.
        """
        if self.rollout is None:
            return
        config = self.rollout.config.model_dump(mode="json")
        config["max_attempts"] = max(1, self.rollout.attempt.sequence_id)
        try:
            self.res.store.update_rollout(self.rid, config=config)
        except StoreError as exc:
            self.log.warning("could not stop retries after an input error (the Store may retry it): %s", exc)

    def _report(self, status: AttemptStatus, metadata: dict[str, Any]) -> Outcome | None:
        """Decide the report once, keep it, deliver it; returns an Outcome unless ours was delivered as given.

        The report is kept in Redis before the first try (``keys.pending_report``): if the Store stays away
        longer than this delivery can wait, a Celery retry or a redelivery of the message sends exactly this
        report instead of running the attempt again, which would find it ``running`` and fail an episode whose
        spans and reward are already stored. A report kept by an earlier delivery wins over ours, so one
        attempt never gets two different outcomes.
        """
        report = PendingReport(status, metadata, self._report_deadline())
        kept = self._keep(report)
        outcome = self._deliver(kept)
        if kept is report or outcome is not None:
            return outcome
        return kept.outcome()

    def _deliver_kept(self, report: PendingReport) -> Outcome:
        """A retry or redelivery after the episode ran: deliver the kept report, never judge the attempt again."""
        self.log.warning("delivering the %s report kept by an earlier delivery of this attempt", report.status)
        self.viewed_at = 0.0  # no view of our own: the fence is read from the Store before reporting
        return self._deliver(report) or report.outcome()

    def _keep(self, report: PendingReport) -> PendingReport:
        """Store ``report`` unless one is pending already, and return the one to deliver."""
        key = keys.pending_report(self.aid)
        ttl = int(max(60.0, report.deadline - time.time() + REPORT_GRACE_S))
        try:
            if self.res.redis.set(key, report.to_json(), nx=True, ex=ttl):
                return report
            kept = PendingReport.from_json(self.res.redis.get(key))
        except (redis.RedisError, TypeError, ValueError) as exc:
            self.log.warning("could not keep the %s report in Redis (%r); delivering it now", report.status, exc)
            return report
        if kept is None:
            return report
        if kept.status != report.status:
            self.log.warning("a %s report was already decided for this attempt; delivering it", kept.status)
        return kept

    def _discard_kept(self) -> None:
        """Drop the kept report (one whose delivery raised an unexpected error), so a failure replaces it."""
        try:
            self.res.redis.delete(keys.pending_report(self.aid))
        except redis.RedisError as exc:
            self.log.warning("could not drop the kept report (%r)", exc)

    def _pending_report(self) -> PendingReport | None:
        """The report an earlier delivery decided and could not deliver, if any."""
        try:
            return PendingReport.from_json(self.res.redis.get(keys.pending_report(self.aid)))
        except redis.RedisError as exc:
            self.log.warning("could not look for a kept report (%r)", exc)
            return None

    def _deliver(self, report: PendingReport) -> Outcome | None:
        """Fence re-check and report, retried while the Store is unavailable, until the report's deadline.

        Each round renews the lease first and waits on the Store at most half a lease, so a delivery that
        outlasts a long outage keeps its lease. Past the deadline (or at Celery's soft time limit) it raises
        ``ReportPending``, a StoreUnavailable: the task's retry then delivers the kept report.
        """
        attempt = 0
        while True:
            try:  # around the wait too: Celery's soft limit may strike there
                try:
                    return self._deliver_once(report)
                except UnknownIdError:
                    return self._skip("the Store no longer knows this rollout (it restarted?); report dropped")
                except (StoreUnavailable, LeaseUnproven) as exc:
                    error: StoreError | LeaseUnproven = exc
                except StoreError as exc:
                    self.log.error("the Store refused the %s report: %s", report.status, exc)
                    raise
                delay = backoff_delay(attempt, base_s=1.0, cap_s=10.0)
                if time.time() + delay > report.deadline:
                    self.log.error(
                        "could not deliver the %s report before the attempt's deadline: %s", report.status, error
                    )
                    raise ReportPending(f"the {report.status} report is kept for a retry: {error}") from error
                self.log.warning(
                    "the Store did not take the %s report (%s); retry in %.1fs", report.status, error, delay
                )
                time.sleep(delay)
                attempt += 1
            except SoftTimeLimitExceeded as exc:
                raise ReportPending(f"time limit reached while delivering the {report.status} report") from exc

    def _deliver_once(self, report: PendingReport) -> Outcome | None:
        status, metadata = report.status, report.metadata
        bound = self._write_bound()
        try:
            reason = self._lease_lost()
        except redis.RedisError as exc:  # _deliver retries until the report's deadline
            raise LeaseUnproven(f"could not confirm the lease before reporting: {exc!r}") from exc
        if reason is None and self._must_read_before_report():
            current = self.res.store.get_rollout(self.rid, retries=0, timeout=bound)
            if self._reported_already(current, status):  # an earlier delivery of this very report landed
                self._finished(status)
                return None
            reason = fence(current, self.aid)
            self.viewed_at = time.time()
        if reason is not None:
            # The kept report stays (it expires): a later delivery withholds it just the same.
            self.log.warning("withholding the %s report: %s", status, reason)
            return Outcome("skipped", f"report withheld: {reason}", FailureClass.CANCELLED)
        if status == AttemptStatus.FAILED and metadata.get("failure_class") == FailureClass.INPUT:
            self._disable_retries()
        self.res.store.update_attempt(
            self.rid,
            self.aid,
            status=status,
            worker_id=self.executor,
            metadata=metadata,
            deadline=min(report.deadline, time.time() + bound),
            timeout=bound,
        )
        worker_metrics.observe_report(status, metadata, self.rollout.mode if self.rollout else None)
        self._finished(status)
        self.log.info("reported %s reward=%s steps=%s", status, metadata.get("reward"), metadata.get("steps"))
        return None

    def _reported_already(self, current: object, status: AttemptStatus) -> bool:
        return (
            isinstance(current, AttemptedRollout)
            and current.attempt.attempt_id == self.aid
            and current.attempt.status == status
        )

    def _finished(self, status: str) -> None:
        """Mark the attempt done (a redelivery skips it) and drop its kept report."""
        try:
            mark_done(self.res.redis, self.aid, str(status), self.settings.done_marker_ttl_s)
            self.res.redis.delete(keys.pending_report(self.aid))
        except redis.RedisError as exc:
            self.log.warning("could not record the finished marker: %r", exc)

    def _base_metadata(self, telemetry: AttemptTelemetry | None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "worker_id": self.executor,
            "celery_task_id": self.celery_task_id,
            "trace_id": self.trace_id,
            "duration_s": round(time.time() - self.started, 3),
            "started_at": round(self.started, 3),  # task start, epoch s: `bridge bench` splits dispatch with it
        }
        if telemetry is not None:
            data["spans_exported"] = telemetry.spans_exported
            data["span_bytes_exported"] = telemetry.bytes_exported
            data["span_export_ms"] = round(telemetry.export_seconds * 1000, 2)
        return {k: v for k, v in data.items() if v is not None}

    # --- fencing -----------------------------------------------------------------------------

    def _view_is_fresh(self, viewed_at: float, *, alive_at: float) -> bool:
        """A view of the rollout taken at ``viewed_at`` still holds: recent enough, and no watchdog since."""
        if self.rollout is None:
            return False
        now = time.time()
        if now - viewed_at > self.settings.fence_max_age_s:
            return False
        return not watchdog_may_act(self.rollout.config, self.dequeued_at, alive_at, now)

    def _must_read_before_report(self) -> bool:
        viewed, alive = self.viewed_at, self.dequeued_at
        if self.watch is not None:
            viewed, alive = max(viewed, self.watch.viewed_at), max(alive, self.watch.alive_at)
        if self.telemetry is not None:
            alive = max(alive, self.telemetry.delivered_at)
        return not self._view_is_fresh(viewed, alive_at=alive)

    def _write_bound(self) -> float:
        """Seconds one write into the attempt may take after a renewal: it must land while the lease is ours."""
        bound = self.settings.store_timeout_s
        return bound if self.lease is None else min(bound, max(1.0, self.settings.lease_ttl_s / 2))

    def _prove_lease(self, until: float) -> None:
        """Return once Redis confirms the attempt is still ours (renewing the lease); retry until ``until``.

        Raises ``Superseded`` when another executor took it over, ``LeaseUnproven`` when Redis could not tell
        in time. Nothing is written into an attempt on the strength of an unknown lease: a host cut off by a
        partition would otherwise deliver spans or a report into an attempt another host runs, once its link
        is back (docs/cluster.md).
        """

        def first_warning(tries: int, exc: BaseException) -> None:
            if tries == 0:
                self.log.warning("could not confirm the lease (%r); writing nothing until Redis answers", exc)

        try:
            reason = retry_until(self._lease_lost, redis.RedisError, until, on_retry=first_warning)
        except redis.RedisError as exc:
            raise LeaseUnproven(f"could not confirm the lease: {exc!r}") from exc
        if reason is not None:
            raise Superseded(reason)

    def _lease_lost(self) -> str | None:
        """Why we no longer execute this attempt (another executor took it over), or None.

        Raises RedisError when Redis cannot tell; the caller then reads the Store instead.
        """
        if self.lease is None or self.lease.renew():
            return None
        return "another executor took this attempt over (the lease is not ours)"

    # --- helpers -----------------------------------------------------------------------------

    def _skip(self, reason: str) -> Outcome:
        self.log.warning("%s", reason)
        return Outcome("skipped", reason)

    def _report_deadline(self) -> float:
        if self.rollout is None:  # an unparsable payload: report it within the grace period
            return time.time() + REPORT_GRACE_S
        timeout = self.rollout.config.timeout_seconds
        if timeout:
            return max(self.dequeued_at + timeout, time.time() + 5)
        return time.time() + REPORT_GRACE_S


def not_json(value: Any, path: str = "metadata") -> str | None:
    """Where ``value`` holds something the Store's JSON cannot carry (a NaN or infinite float, a non-string
    key, an object), named with its path and value; None when it is plain JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {float(value)!r}, not a finite number"
    if value is None or isinstance(value, (str, int, float)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} has a key {key!r} that is not a string"
            found = not_json(item, f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next((f for i, item in enumerate(value) if (f := not_json(item, f"{path}[{i}]")) is not None), None)
    return f"{path} is a {type(value).__name__}, not JSON"
