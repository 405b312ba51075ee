"""The end of one attempt: the final report, decided once, kept, fenced and delivered.

This is the path the trainer's guarantees rest on (docs/store-protocol.md 6.2, 10): spans are flushed before
the final status, the fence is re-checked right before reporting (the Store never refuses a stale report),
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

from bridge.core.coordination import keys
from bridge.core.infra import LeaseUnproven, StoreError, StoreUnavailable, UnknownIdError, backoff_delay
from bridge.core.store import AttemptedRollout, AttemptStatus
from bridge.core.task import Outcome, OutcomeStatus, error_text, skipped
from workers.lifecycle import metrics as worker_metrics
from workers.lifecycle.resources import WorkerResources
from workers.protocol.attempt import Attempt
from workers.protocol.failures import FailureClass
from workers.protocol.fencing import fence
from workers.protocol.lease import mark_done
from workers.protocol.write_guard import WriteGuard
from workers.telemetry.spans import AttemptTelemetry

REPORT_GRACE_S = 300.0


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
    """A 0.3 attempt's final report to the Store, decided once: every delivery of the attempt sends exactly this.
    Line-specific (the Store's status and metadata, the delivery deadline); ``outcome`` is the shared record."""

    status: AttemptStatus
    metadata: dict[str, Any]
    deadline: float  # epoch s: delivery is retried until then (the attempt's own deadline)

    @property
    def failure_class(self) -> FailureClass | None:
        raw = self.metadata.get("failure_class")
        return None if raw is None else FailureClass(raw)

    def to_json(self) -> str:
        data = {"status": str(self.status), "metadata": self.metadata, "deadline": self.deadline}
        return json.dumps(data, allow_nan=False)

    @classmethod
    def from_json(cls, raw: object) -> PendingReport | None:
        """The kept report, or None when there is none (or it is unreadable: then the attempt is judged anew)."""
        if not isinstance(raw, str):
            return None
        try:
            data = json.loads(raw)
            return cls(AttemptStatus(data["status"]), dict(data["metadata"]), float(data["deadline"]))
        except (ValueError, KeyError, TypeError):
            return None

    def outcome(self) -> Outcome:
        """What the task returns once this report was delivered."""
        if self.status == AttemptStatus.SUCCEEDED:
            reward = self.metadata.get("reward")
            return Outcome(OutcomeStatus.SUCCEEDED, reward=reward if isinstance(reward, (int, float)) else None)
        return Outcome(OutcomeStatus.FAILED, str(self.metadata.get("error", "")), self.failure_class)


class AttemptReporter:
    """Decides, keeps and delivers one attempt's final report; never writes without its ``WriteGuard``."""

    def __init__(self, attempt: Attempt, res: WorkerResources, guard: WriteGuard) -> None:
        self.attempt = attempt
        self.res = res
        self.settings = res.settings
        self.guard = guard
        self.log = attempt.log

    # --- the report --------------------------------------------------------------------------

    def success(self, result: RunResult, telemetry: AttemptTelemetry) -> Outcome:
        """Report the finished run ``succeeded`` (``failed`` when its result is not JSON, blamed on its source)."""
        metadata = {**self._base_metadata(telemetry), **result.metadata()}
        bad = not_json(metadata)
        if bad is not None:  # checked before the report is kept: the Store could never take it
            return self.failure(result.blame, f"the result cannot be reported: {bad}", telemetry)
        outcome = self._report(AttemptStatus.SUCCEEDED, metadata)
        if outcome is None:
            return Outcome(OutcomeStatus.SUCCEEDED, reward=result.reward)
        return outcome

    def failure(self, failure: FailureClass, error: str, telemetry: AttemptTelemetry | None = None) -> Outcome:
        """Report the attempt ``failed`` with its class and error (``input`` first ends the rollout's retries)."""
        failed = Outcome(OutcomeStatus.FAILED, error, failure)  # masked and bounded once, here
        metadata = {**self._base_metadata(telemetry), "error": error_text(failed.detail), "failure_class": str(failure)}
        self.log.warning("failed (%s): %s", failure, failed.detail)
        return self._report(AttemptStatus.FAILED, metadata) or failed

    def deadline(self) -> float:
        """Epoch s until which the report is retried: the attempt's own deadline, or a grace period."""
        rollout = self.attempt.rollout
        if rollout is None:  # an unparsable payload: report it within the grace period
            return time.time() + REPORT_GRACE_S
        timeout = rollout.config.timeout_seconds
        if timeout:
            return max(self.attempt.dequeued_at + timeout, time.time() + 5)
        return time.time() + REPORT_GRACE_S

    # --- the report kept in Redis ------------------------------------------------------------

    def pending(self) -> PendingReport | None:
        """The report an earlier delivery decided and could not deliver, if any."""
        try:
            return PendingReport.from_json(self.res.redis.get(keys.pending_report(self.attempt.attempt_id)))
        except redis.RedisError as exc:
            self.log.warning("could not look for a kept report (%r)", exc)
            return None

    def deliver_kept(self, report: PendingReport) -> Outcome:
        """A retry or redelivery after the episode ran: deliver the kept report, never judge the attempt again.

        Called before this delivery viewed the rollout, so the fence is read from the Store before reporting.
        """
        self.log.warning("delivering the %s report kept by an earlier delivery of this attempt", report.status)
        return self._deliver(report) or report.outcome()

    def discard_kept(self) -> None:
        """Drop the kept report (one whose delivery raised an unexpected error), so a failure replaces it."""
        try:
            self.res.redis.delete(keys.pending_report(self.attempt.attempt_id))
        except redis.RedisError as exc:
            self.log.warning("could not drop the kept report (%r)", exc)

    def _disable_retries(self) -> None:
        """Bad input fails the same way every time: make this attempt the rollout's last before reporting it.

        Setting ``max_attempts`` to this attempt's sequence id makes the Store derive ``failed`` from the
        report instead of requeuing (docs/store-protocol.md 6.2). Done before the report, so no retry attempt can
        be dequeued in between, and the latest attempt keeps the error in its metadata.
        """
        rollout = self.attempt.rollout
        if rollout is None:
            return
        config = rollout.config.model_dump(mode="json")
        config["max_attempts"] = max(1, rollout.attempt.sequence_id)
        try:
            self.res.store.update_rollout(self.attempt.rollout_id, config=config)
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
        report = PendingReport(status, metadata, self.deadline())
        try:
            kept = self._keep(report)
        except SoftTimeLimitExceeded as exc:  # struck mid-keep: keep it all the same (idempotent); a retry delivers it
            self._keep(report)
            raise ReportPending(f"time limit reached while keeping the {status} report") from exc
        outcome = self._deliver(kept)
        if kept is report or outcome is not None:
            return outcome
        return kept.outcome()

    def _keep(self, report: PendingReport) -> PendingReport:
        """Store ``report`` unless one is pending already, and return the one to deliver."""
        key = keys.pending_report(self.attempt.attempt_id)
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

    # --- delivery ----------------------------------------------------------------------------

    def _deliver(self, report: PendingReport) -> Outcome | None:
        """Fence re-check and report, retried while the Store is unavailable, until the report's deadline.

        Each round renews the lease first and waits on the Store at most half a lease, so a delivery that
        outlasts a long outage keeps its lease. Past the deadline (or at Celery's soft time limit) it raises
        ``ReportPending``, a StoreUnavailable: the task's retry then delivers the kept report.
        """
        tries = 0
        while True:
            try:  # around the wait too: Celery's soft limit may strike there
                try:
                    return self._deliver_once(report)
                except UnknownIdError:
                    return skipped(self.log, "the Store no longer knows this rollout (it restarted?); report dropped")
                except (StoreUnavailable, LeaseUnproven) as exc:
                    error: StoreError | LeaseUnproven = exc
                except StoreError as exc:
                    self.log.error("the Store refused the %s report: %s", report.status, exc)
                    raise
                delay = backoff_delay(tries, base_s=1.0, cap_s=10.0)
                if time.time() + delay > report.deadline:
                    self.log.error(
                        "could not deliver the %s report before the attempt's deadline: %s", report.status, error
                    )
                    raise ReportPending(f"the {report.status} report is kept for a retry: {error}") from error
                self.log.warning(
                    "the Store did not take the %s report (%s); retry in %.1fs", report.status, error, delay
                )
                time.sleep(delay)
                tries += 1
            except SoftTimeLimitExceeded as exc:
                raise ReportPending(f"time limit reached while delivering the {report.status} report") from exc

    def _deliver_once(self, report: PendingReport) -> Outcome | None:
        status, metadata = report.status, report.metadata
        bound = self.guard.write_bound()
        try:
            reason = self.guard.lease_lost()
        except redis.RedisError as exc:  # _deliver retries until the report's deadline
            raise LeaseUnproven(f"could not confirm the lease before reporting: {exc!r}") from exc
        if reason is None and self.guard.must_read_before_write():
            current = self.res.store.get_rollout(self.attempt.rollout_id, retries=0, timeout=bound)
            if self._reported_already(current, status):  # an earlier delivery of this very report landed
                self._finished(status)
                return None
            reason = fence(current, self.attempt.attempt_id)
            self.guard.viewed(time.time())
        if reason is not None:
            # The kept report stays (it expires): a later delivery withholds it just the same.
            self.log.warning("withholding the %s report: %s", status, reason)
            return Outcome(OutcomeStatus.SKIPPED, f"report withheld: {reason}", FailureClass.CANCELLED)
        if status == AttemptStatus.FAILED and report.failure_class is FailureClass.INPUT:
            self._disable_retries()
        self.res.store.update_attempt(
            self.attempt.rollout_id,
            self.attempt.attempt_id,
            status=status,
            worker_id=self.attempt.executor,
            metadata=metadata,
            deadline=min(report.deadline, time.time() + bound),
            timeout=bound,
        )
        rollout = self.attempt.rollout
        worker_metrics.observe_report(status, metadata, rollout.mode if rollout else None)
        self._finished(status)
        self.log.info("reported %s reward=%s steps=%s", status, metadata.get("reward"), metadata.get("steps"))
        return None

    def _reported_already(self, current: object, status: AttemptStatus) -> bool:
        return (
            isinstance(current, AttemptedRollout)
            and current.attempt.attempt_id == self.attempt.attempt_id
            and current.attempt.status == status
        )

    def _finished(self, status: AttemptStatus) -> None:
        """Mark the attempt done (a redelivery skips it) and drop its kept report."""
        try:
            mark_done(self.res.redis, self.attempt.attempt_id, str(status), self.settings.done_marker_ttl_s)
            self.res.redis.delete(keys.pending_report(self.attempt.attempt_id))
        except redis.RedisError as exc:
            self.log.warning("could not record the finished marker: %r", exc)

    def _base_metadata(self, telemetry: AttemptTelemetry | None) -> dict[str, Any]:
        attempt = self.attempt
        data: dict[str, Any] = {
            "worker_id": attempt.executor,
            "celery_task_id": attempt.celery_task_id,
            "trace_id": attempt.trace_id,
            "duration_s": round(time.time() - attempt.started, 3),
            "started_at": round(attempt.started, 3),  # task start, epoch s: `bridge bench` splits dispatch with it
        }
        if telemetry is not None:
            data["spans_exported"] = telemetry.spans_exported
            data["span_bytes_exported"] = telemetry.bytes_exported
            data["span_export_ms"] = round(telemetry.export_seconds * 1000, 2)
        return {k: v for k, v in data.items() if v is not None}


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
