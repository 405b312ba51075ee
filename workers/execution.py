"""One attempt from claim to final report: lease, fence, run, flush spans, re-check, report.

The order matters for the two guarantees the trainer depends on:
* none executed twice in effect: the Redis lease admits one executor per attempt, the fence admits only
  the rollout's latest live attempt, and a takeover never mixes a second execution into an attempt
  that already has spans (it fails the attempt instead, so the Store's retry policy starts a clean one);
* the reward the episode earned: spans, the reward span last, are flushed *before* the final status,
  the fence is checked again before reporting (the Store never refuses a stale report), and if the
  reward span cannot be delivered the attempt is reported ``failed`` (telemetry), never ``succeeded``.

The fence is a view of the rollout no older than ``FENCE_MAX_AGE_S``. The dequeue answer is such a view
(the bridge publishes right after it) and every heartbeat renews it, so a short first execution makes no
Store reads at all: its requests are the bridge's share of a dequeue, one span batch and the final report.
The Store is read anyway on a takeover (another executor started the attempt), when the view is older,
and whenever the Store's watchdog could have acted on the attempt since (the only thing besides people
that changes an attempt behind its executor's back, and deterministic: ``watchdog_may_act``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
from pydantic import ValidationError

from bridge.core.errors import (
    DuplicateDelivery,
    InvalidInputError,
    StoreError,
    StoreUnavailable,
    Superseded,
    TelemetryError,
    UnknownIdError,
)
from bridge.core.logs import RolloutLogger
from bridge.core.models import AttemptedRollout, AttemptStatus
from bridge.core.redact import redact_text
from workers import llm as llm_mod
from workers import metrics as worker_metrics
from workers.agent import Episode, EpisodeResult
from workers.failures import FailureClass, classify
from workers.heartbeat import AttemptWatch, fence, watchdog_may_act
from workers.inputs import parse_task_input
from workers.lease import Lease, executor_id, mark_done
from workers.ratelimit import LLMRateLimiter, RateLimit
from workers.resources import WorkerResources
from workers.telemetry import AttemptTelemetry, current_trace_id

log = logging.getLogger("workers.execution")

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


class AttemptRun:
    """Executes one delivery of ``workers.run_rollout``."""

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

    # --- entry point -------------------------------------------------------------------------

    def execute(self) -> Outcome:
        try:
            rollout = AttemptedRollout.model_validate(self.payload)
        except ValidationError as exc:
            return self._unparsable(exc)
        self.rollout = rollout
        self.rid, self.aid = rollout.rollout_id, rollout.attempt.attempt_id
        self.log = RolloutLogger(log, {"rollout_id": self.rid, "attempt_id": self.aid, "task_id": self.celery_task_id})
        self.dequeued_at = rollout.attempt.start_time or self.started
        lease = Lease(self.res.redis, self.aid, self.settings.lease_ttl_s)
        # The started marker must outlive any redelivery of this message.
        claim = lease.claim(started_ttl_s=2 * self.settings.visibility_timeout_s)
        if claim.done_status is not None:
            return self._skip(f"attempt already finished here ({claim.done_status}); duplicate delivery ignored")
        if not claim.acquired:
            # Not dropped: if the holder died, its lease lapses and the re-check takes the attempt over.
            raise DuplicateDelivery(
                f"another executor holds the lease ({lease.holder()})", retry_in_s=lease.remaining_s()
            )
        self.lease = lease
        try:
            return self._run_leased(lease, first_start=claim.first_start)
        finally:
            try:
                lease.release()
            except redis.RedisError as exc:
                self.log.warning("could not release lease (it will expire): %r", exc)

    # --- phases ------------------------------------------------------------------------------

    def _run_leased(self, lease: Lease, *, first_start: bool) -> Outcome:
        if first_start and self._view_is_fresh(self.dequeued_at, alive_at=self.dequeued_at):
            self.viewed_at = self.dequeued_at  # the dequeue answer the bridge published moments ago
        else:
            sent_at = time.time()
            try:
                current = self.res.store.get_rollout(self.rid)
            except UnknownIdError:
                return self._skip("the Store does not know this rollout (it restarted?); dropping the task")
            reason = fence(current, self.aid)
            if reason is not None:
                return self._skip(f"not running: {reason}")
            assert isinstance(current, AttemptedRollout)
            if current.attempt.status == AttemptStatus.RUNNING:
                # A previous executor started this attempt and died (we now hold its expired lease). Its spans
                # are already in the attempt: running again would mix two executions into one trace. (One
                # that died before shipping a span left nothing behind, and its attempt is run here cleanly.)
                return self._report_failure(
                    FailureClass.INFRA, "the worker executing this attempt was lost mid-episode; not re-run in place"
                )
            self.viewed_at = sent_at
        try:
            task = parse_task_input(self.attempted.input, max_chars=self.settings.max_instruction_chars)
        except InvalidInputError as exc:
            return self._report_failure(FailureClass.INPUT, str(exc))
        try:
            resources = self.res.store.get_resources(self.attempted.resources_id)
            target = llm_mod.resolve_target(resources, self.attempted, self.settings)
        except llm_mod.LLMError as exc:
            return self._report_failure(FailureClass.LLM, str(exc))
        # No explicit `running` mark: the first stored span sets it (6.1). The bridge's reconcile tells a
        # started attempt from a stranded one by its lease in Redis, not by the Store status.
        self.log.info(
            "started on %s (llm=%s via %s, trace=%s)", self.executor, target.model, target.source, self.trace_id
        )
        return self._run_episode(lease, task, target)

    def _run_episode(self, lease: Lease, task: Any, target: llm_mod.LLMTarget) -> Outcome:
        telemetry = AttemptTelemetry(
            self.res.store,
            rollout_id=self.rid,
            attempt_id=self.aid,
            service_name=self.settings.service_name,
            traces_url=self.settings.traces_endpoint,
        )
        interval = self._heartbeat_interval()
        watch = AttemptWatch(
            self.rid,
            self.aid,
            lease,
            telemetry,
            interval_s=interval,
            flush_interval_s=self.settings.span_flush_interval_s,
            deadline=self._episode_deadline(),
            executor=self.executor,
            unresponsive_s=self.attempted.config.unresponsive_seconds,
            first_beat_in_s=interval - (time.time() - self.dequeued_at),  # the clock started at the dequeue
            viewed_at=self.viewed_at,
            alive_at=self.dequeued_at,
        )
        self.watch, self.telemetry = watch, telemetry
        self.res.monitor.watch(watch)
        limiter = self._rate_limiter(target.model)
        try:
            episode = Episode(
                task=task,
                env=self.res.webshop,
                client=llm_mod.make_client(target, self.settings.llm_timeout_s),
                target=target,
                telemetry=telemetry,
                settings=self.settings,
                check_stop=watch.check,
                before_llm_call=partial(limiter.acquire, watch.check) if limiter else None,
                after_llm_call=limiter.charge_tokens if limiter else None,
            )
            root_attributes = {
                "agentlightning.rollout_id": self.rid,
                "agentlightning.attempt_id": self.aid,
                "celery.task_id": self.celery_task_id,
                "webshop.task_id": task.task_id,
                "worker.id": self.executor,
            }
            with telemetry.span("webshop.episode", root_attributes) as root:
                result = episode.run()
                root.set_attribute("episode.reward", result.reward)
                root.set_attribute("episode.steps", result.steps)
            self._check_lease()  # a stalled executor whose attempt was taken over writes nothing into it
            # Within the episode's budget: retrying past Celery's soft limit would turn a telemetry failure
            # into a "timeout"; at least one try is always made.
            telemetry.flush(deadline=min(self._report_deadline(), self._episode_deadline() - 1.0))
        except Superseded as exc:
            self.log.warning("stopped without reporting: %s", exc.reason)
            return Outcome("skipped", exc.reason, FailureClass.CANCELLED)
        except Exception as exc:
            failure = classify(exc)
            if not isinstance(exc, TelemetryError):  # the spans just failed their retries: report at once
                self._flush_quietly(telemetry)
            if failure is FailureClass.INFRA and not isinstance(exc, StoreError):
                self.log.exception("unexpected error in the episode")
            watch.reporting = True
            return self._report_failure(failure, redact_text(str(exc)) or type(exc).__name__, telemetry)
        else:
            watch.reporting = True
            return self._report_success(result, telemetry)
        finally:
            self.res.monitor.unwatch(watch)
            telemetry.close()

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

    def _check_lease(self) -> None:
        try:
            reason = self._lease_lost()
        except redis.RedisError as exc:
            self.log.warning("could not check the lease (%r); the report will read the Store", exc)
            return
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

    def _unparsable(self, exc: ValidationError) -> Outcome:
        """A payload without usable ids cannot be reported; one with ids is failed as bad input."""
        rid = self.payload.get("rollout_id") if isinstance(self.payload, dict) else None
        attempt = self.payload.get("attempt") if isinstance(self.payload, dict) else None
        aid = attempt.get("attempt_id") if isinstance(attempt, dict) else None
        message = f"task payload is not an AttemptedRollout: {exc.errors()[0].get('msg') if exc.errors() else exc}"
        if not (isinstance(rid, str) and isinstance(aid, str)):
            log.error("dropping task %s: %s", self.celery_task_id, message)
            return Outcome("skipped", message, str(FailureClass.INPUT))
        self.rid, self.aid = rid, aid
        self.log = RolloutLogger(log, {"rollout_id": rid, "attempt_id": aid, "task_id": self.celery_task_id})
        try:
            return self._report_failure(FailureClass.INPUT, message)
        except StoreError:
            return Outcome("failed", message, str(FailureClass.INPUT))

    def _skip(self, reason: str) -> Outcome:
        self.log.warning("%s", reason)
        return Outcome("skipped", reason)

    def _flush_quietly(self, telemetry: AttemptTelemetry) -> None:
        try:
            telemetry.flush(deadline=time.time() + 10)
        except TelemetryError as exc:
            self.log.warning("spans of the failed attempt were not delivered: %s", exc)

    def _rate_limiter(self, model: str) -> LLMRateLimiter | None:
        """The global per-model LLM budget (LLM_RPM/LLM_TPM/LLM_RATE_LIMITS), or None when unlimited."""
        rpm, tpm = self.settings.llm_rate_limit(model)
        limit = RateLimit(rpm, tpm, self.settings.llm_rate_burst_s)
        return LLMRateLimiter(self.res.redis, model, limit) if limit.active else None

    def _heartbeat_interval(self) -> float:
        unresponsive = self.attempted.config.unresponsive_seconds
        interval = self.settings.heartbeat_interval_s
        return min(interval, unresponsive / 3) if unresponsive else interval

    def _episode_deadline(self) -> float:
        return self.dequeued_at + self.settings.soft_time_limit(self.attempted.config.timeout_seconds)

    def _report_deadline(self) -> float:
        if self.rollout is None:  # an unparsable payload: report it within the grace period
            return time.time() + REPORT_GRACE_S
        timeout = self.rollout.config.timeout_seconds
        if timeout:
            return max(self.dequeued_at + timeout, time.time() + 5)
        return time.time() + REPORT_GRACE_S


def is_retryable_before_progress(exc: BaseException) -> bool:
    """Infrastructure errors worth a Celery retry: nothing of the episode has happened yet."""
    return isinstance(exc, (StoreUnavailable, redis.ConnectionError, redis.TimeoutError))
