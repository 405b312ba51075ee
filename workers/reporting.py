"""The end of one attempt: the state a delivery carries, the fence re-check and the final report.

``workers.execution.AttemptRun`` builds on this with the run itself. Kept apart because this is the
path the trainer's guarantees rest on (docs/store-protocol.md 6.2, 10): spans are flushed before the
final status, the fence is re-checked right before reporting (the Store never refuses a stale report),
a report that lost its fence is withheld, and a delivered report is marked done in Redis so that a
redelivery of the message never runs the attempt again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from bridge.core.errors import StoreError, UnknownIdError
from bridge.core.logs import RolloutLogger
from bridge.core.models import AttemptedRollout, AttemptStatus
from workers import metrics as worker_metrics
from workers.agent import EpisodeResult
from workers.failures import FailureClass
from workers.heartbeat import AttemptWatch, fence, watchdog_may_act
from workers.lease import Lease, executor_id, mark_done
from workers.resources import WorkerResources
from workers.telemetry import AttemptTelemetry, current_trace_id

DONE_MARKER_TTL_S = 7 * 24 * 3600
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

    def _report_success(self, result: EpisodeResult, telemetry: AttemptTelemetry) -> Outcome:
        metadata = {**self._base_metadata(telemetry), **result.metadata()}
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
        """Re-check the fence, then report; returns an Outcome only when the report was withheld."""
        deadline = self._report_deadline()
        try:
            try:
                reason, must_read = self._lease_lost(), self._must_read_before_report()
            except redis.RedisError as exc:
                self.log.warning("could not check the lease before reporting (%r); reading the Store", exc)
                reason, must_read = None, True
            if reason is None and must_read:
                reason = fence(self.res.store.get_rollout(self.rid), self.aid)
            if reason is not None:
                self.log.warning("withholding the %s report: %s", status, reason)
                return Outcome("skipped", f"report withheld: {reason}", FailureClass.CANCELLED)
            if status == AttemptStatus.FAILED and metadata.get("failure_class") == FailureClass.INPUT:
                self._disable_retries()
            self.res.store.update_attempt(
                self.rid, self.aid, status=status, worker_id=self.executor, metadata=metadata, deadline=deadline
            )
            worker_metrics.observe_report(status, metadata, self.rollout.mode if self.rollout else None)
        except UnknownIdError:
            return self._skip("the Store no longer knows this rollout (it restarted?); report dropped")
        except StoreError as exc:
            self.log.error("could not deliver the %s report before the attempt's deadline: %s", status, exc)
            raise
        try:
            mark_done(self.res.redis, self.aid, status, DONE_MARKER_TTL_S)
        except redis.RedisError as exc:
            self.log.warning("could not record the finished marker: %r", exc)
        self.log.info("reported %s reward=%s steps=%s", status, metadata.get("reward"), metadata.get("steps"))
        return None

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
