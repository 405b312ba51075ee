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
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from pydantic import ValidationError

from bridge.core.backoff import retry_until
from bridge.core.errors import (
    ConfigError,
    DuplicateDelivery,
    InvalidInputError,
    LeaseUnproven,
    StoreError,
    StoreUnavailable,
    Superseded,
    TelemetryError,
    UnknownIdError,
)
from bridge.core.logs import RolloutLogger
from bridge.core.message import DEFAULT_AGENT
from bridge.core.models import AttemptedRollout, AttemptStatus
from bridge.core.redact import redact_text
from workers import clock, stuck
from workers import llm as llm_mod
from workers.agent import Episode
from workers.agents import loading as agent_loading
from workers.agents.loading import ConfiguredAgent
from workers.failures import FailureClass, classify
from workers.fence_board import fence
from workers.heartbeat import AttemptWatch, span_flush_interval
from workers.inputs import parse_task_input
from workers.lease import Lease
from workers.ratelimit import LLMRateLimiter, RateLimit
from workers.reporting import AttemptReporter, Outcome, RunResult
from workers.telemetry import AttemptTelemetry

log = logging.getLogger("workers.execution")


class AttemptRun(AttemptReporter):
    """Executes one delivery of ``workers.run_rollout``: claim, fence, run; the report is inherited."""

    expected_agent: str | None = None  # the message's ``agent`` (None: sent before messages named one)

    # --- entry point -------------------------------------------------------------------------

    def execute(self) -> Outcome:
        try:
            rollout = AttemptedRollout.model_validate(self.payload)
        except ValidationError as exc:
            return self._unparsable(exc)
        self.rollout = rollout
        self.rid, self.aid = rollout.rollout_id, rollout.attempt.attempt_id
        self.log = RolloutLogger(log, {"rollout_id": self.rid, "attempt_id": self.aid, "task_id": self.celery_task_id})
        # The Store's clock stamped the dequeue: on ours, the attempt's budget and the watchdog are judged right.
        start = rollout.attempt.start_time
        self.dequeued_at = clock.to_local(start) if start else self.started
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
            kept = None if claim.first_start else self._pending_report()
            if kept is not None:  # the episode ran in an earlier delivery: deliver its report, nothing else
                return self._deliver_kept(kept)
            return self._run_leased(lease, first_start=claim.first_start)
        except Exception as exc:
            if is_retryable_before_progress(exc) or isinstance(
                exc, (StoreError, DuplicateDelivery, Superseded, LeaseUnproven)
            ):
                raise  # a Celery retry (with the kept report, if any), or not ours to report
            # A fault of this worker's own code outside the episode's guard: failed once, so the Store's retry
            # policy bounds it, instead of reconcile finding the attempt stranded and re-publishing it forever.
            self.log.exception("unexpected error in the worker; failing the attempt")
            error = f"unexpected worker error: {type(exc).__name__}: {redact_text(str(exc))}"
            self._discard_kept()  # if delivering it raised, the failure must not re-deliver it
            return self._report_failure(classify(exc), error)
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
        configured = self._configured_agent()
        if isinstance(configured, str):
            return self._report_failure(FailureClass.AGENT, configured)
        if configured is not None:
            return self._run_litagent(lease, configured)
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
        """The built-in WebShop agent."""

        def body(telemetry: AttemptTelemetry, watch: AttemptWatch) -> RunResult:
            limiter = self._rate_limiter(target.model)
            episode = Episode(
                task=task,
                env=self.res.webshop,
                client=llm_mod.make_client(target, self.settings.llm_timeout_s),
                target=target,
                telemetry=telemetry,
                settings=self.settings,
                check_stop=watch.check,
                deadline=watch.deadline,
                before_llm_call=partial(limiter.acquire, watch.check) if limiter else None,
                after_llm_call=limiter.charge_tokens if limiter else None,
            )
            with telemetry.span("webshop.episode", self._root_attributes({"webshop.task_id": task.task_id})) as root:
                result = episode.run()
                root.set_attribute("episode.reward", result.reward)
                root.set_attribute("episode.steps", result.steps)
            return result

        return self._run_attempt(lease, body)

    def _run_attempt(self, lease: Lease, body: Callable[[AttemptTelemetry, AttemptWatch], RunResult]) -> Outcome:
        """Telemetry, heartbeat and report around one agent run (``body``): the same for every agent."""
        telemetry = AttemptTelemetry(
            self.res.store,
            rollout_id=self.rid,
            attempt_id=self.aid,
            service_name=self.settings.service_name,
            traces_url=self.settings.traces_endpoint,
            courier=self.res.courier,
        )
        try:
            watch = self._watch(lease, telemetry)
        except BaseException:
            telemetry.close()  # it counts among the process's running attempts (trace_courier) until closed
            raise
        self.watch, self.telemetry = watch, telemetry
        try:
            if stuck.pool.threads:  # nothing else could stop an agent that blocks outside the LLM calls
                result = stuck.run_abandonable(partial(body, telemetry, watch), watch)
            else:  # prefork: Celery's time limits stop it; solo: the only slot, nothing to run beside it
                result = body(telemetry, watch)
            # Within the episode's budget: retrying past Celery's soft limit would turn a telemetry failure
            # into a "timeout"; at least one try is always made.
            self._flush_while_ours(telemetry, until=min(self._report_deadline(), self._episode_deadline() - 1.0))
        except Superseded as exc:
            self.log.warning("stopped without reporting: %s", exc.reason)
            return Outcome("skipped", exc.reason, FailureClass.CANCELLED)
        except LeaseUnproven as exc:  # a later delivery, or the bridge's reconcile, takes the attempt over
            self.log.warning("stopped without reporting: %s", exc)
            return Outcome("skipped", str(exc), FailureClass.INFRA)
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

    def _watch(self, lease: Lease, telemetry: AttemptTelemetry) -> AttemptWatch:
        """The attempt's heartbeat, lease and fence watch, registered with the process's monitor."""
        interval = self._heartbeat_interval()
        watch = AttemptWatch(
            self.rid,
            self.aid,
            lease,
            telemetry,
            interval_s=interval,
            flush_interval_s=span_flush_interval(
                self.settings.span_flush_interval_s, self.attempted.config.unresponsive_seconds, interval
            ),
            flush_max_pending=self.settings.span_buffer_max_spans,
            deadline=self._episode_deadline(),
            executor=self.executor,
            unresponsive_s=self.attempted.config.unresponsive_seconds,
            first_beat_in_s=interval - (time.time() - self.dequeued_at),  # the clock started at the dequeue
            viewed_at=self.viewed_at,
            alive_at=self.dequeued_at,
        )
        self.res.monitor.watch(watch)
        return watch

    def _run_litagent(self, lease: Lease, configured: ConfiguredAgent) -> Outcome:
        """A configured LitAgent in place of the WebShop episode (``workers.agents.litagent``)."""
        from workers.agents import capture, litagent  # agentlightning: only on workers configured for it

        resources = self.res.store.get_resources(self.attempted.resources_id)
        try:
            target: llm_mod.LLMTarget | None = llm_mod.resolve_target(resources, self.attempted, self.settings)
        except llm_mod.LLMError as exc:
            if resources is None:  # nothing at all to give the agent (Agent Lightning's runner fails these too)
                return self._report_failure(FailureClass.LLM, str(exc))
            target = None  # resources without an LLM: the agent may not need one
        named = litagent.named_resources(resources, target, self.rid, self.aid)
        self.log.info("started on %s (agent=%s, trace=%s)", self.executor, configured.path, self.trace_id)

        def body(telemetry: AttemptTelemetry, watch: AttemptWatch) -> RunResult:
            attempt = capture.AttemptCapture(
                telemetry,
                self.settings,
                watch.check,
                watch.deadline,
                self._rate_limiter,
                record_spans=self.settings.agent_tracer != "agentops",
            )
            with telemetry.span("agent.rollout", self._root_attributes({"agent": configured.path})) as root:
                result = litagent.run_agent(configured, self.payload, named, attempt, self.executor)
                root.set_attribute("agent.result_kind", result.result_kind)
                if result.reward is not None:
                    root.set_attribute("agent.reward", result.reward)
            return result

        return self._run_attempt(lease, body)

    def _configured_agent(self) -> ConfiguredAgent | str | None:
        """This worker's LitAgent (None: the WebShop agent), or why this message must not run here.

        The message's ``agent`` is only compared with the worker's own configuration, never imported.
        """
        expected = self.expected_agent or DEFAULT_AGENT
        try:
            configured = agent_loading.configured_agent(self.settings)
        except ConfigError as exc:  # checked at start; only a factory failing in a new process gets here
            return f"the configured agent {self.settings.agent!r} could not be built: {exc.message}"
        if configured is None:
            if expected == DEFAULT_AGENT:
                return None
            mine = DEFAULT_AGENT
        elif configured.accepts(expected):
            return configured
        else:
            mine = f"{configured.path} ({configured.class_path})"
        return (
            f"agent mismatch: the message expects agent {expected!r} but this worker runs {mine}; "
            "not run (workers only run the agent their AGENT setting names)"
        )

    def _root_attributes(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "agentlightning.rollout_id": self.rid,
            "agentlightning.attempt_id": self.aid,
            "celery.task_id": self.celery_task_id,
            "worker.id": self.executor,
            **extra,
        }

    # --- fencing -----------------------------------------------------------------------------

    def _flush_while_ours(self, telemetry: AttemptTelemetry, until: float) -> None:
        """Deliver the attempt's spans in rounds that each prove the lease first and end before it could lapse.

        A stalled executor whose attempt was taken over writes nothing into it, and a batch held up by a
        partition is never delivered after another host could have taken the attempt over. A failed round
        is retried (a Store outage) until ``until``; the last error is raised.
        """

        def one_round() -> None:
            self._prove_lease(until)
            bound = self._write_bound()
            telemetry.flush(deadline=min(until, time.time() + bound), timeout=bound, together=True)

        # Without a lease nothing can lapse: one round, whose own deadline covers the retries.
        retry_until(one_round, TelemetryError, until if self.lease is not None else 0.0)

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

    def _flush_quietly(self, telemetry: AttemptTelemetry) -> None:
        try:
            self._flush_while_ours(telemetry, until=time.time() + 10)
        except (TelemetryError, Superseded, LeaseUnproven) as exc:
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
        # covered_timeout: a takeover re-read the Store's unclamped timeout_seconds (see the bridge's publisher).
        timeout = self.settings.covered_timeout(self.attempted.config.timeout_seconds)
        return self.dequeued_at + self.settings.soft_time_limit(timeout)


def is_retryable_before_progress(exc: BaseException) -> bool:
    """Infrastructure errors worth a Celery retry: nothing of the episode has happened yet, or the episode
    has run and its report is kept in Redis (``ReportPending``, a StoreUnavailable), which the retry delivers."""
    return isinstance(exc, (StoreUnavailable, redis.ConnectionError, redis.TimeoutError))
