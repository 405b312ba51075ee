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

The parts: ``workers.protocol.attempt`` describes the attempt (built once, immutable); ``workers.protocol.held``
holds it, as it holds a 1.0 attempt: the lease, claimed before any Store read and released after the final report,
and the heartbeat watch, which this module builds (Store-fenced, with the attempt's telemetry) once the run starts;
``workers.protocol.write_guard`` decides whether a write may go out; ``workers.protocol.reporting`` decides and delivers
the report (0.3's own, kept under ``keys.pending_report``); this module runs it. The task frees the slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from celery.exceptions import SoftTimeLimitExceeded

from bridge.core.infra import (
    ConfigError,
    DuplicateDelivery,
    InvalidInputError,
    LeaseUnproven,
    StoreError,
    StoreUnavailable,
    Superseded,
    TelemetryError,
    UnknownIdError,
    redact_error,
    redact_text,
)
from bridge.core.store import AttemptedRollout, AttemptStatus, RolloutStatus
from bridge.core.task import DEFAULT_AGENT, Outcome, OutcomeStatus, clamp_to_broker, skipped, soft_time_limit
from workers.agents import llm as llm_mod
from workers.agents import loading as agent_loading
from workers.agents.inputs import parse_task_input
from workers.agents.loading import ConfiguredAgent
from workers.agents.ratelimit import LLMRateLimiter, RateLimit
from workers.agents.webshop_loop import Episode
from workers.lifecycle import drain, state, stuck
from workers.lifecycle.resources import WorkerResources
from workers.protocol.attempt import Attempt, Rejected, read_payload
from workers.protocol.failures import FailureClass, classify
from workers.protocol.fencing import fence
from workers.protocol.heartbeat import AttemptWatch, span_flush_interval
from workers.protocol.held import HeldAttempt, release_slot
from workers.protocol.lease import Lease, mark_done
from workers.protocol.reporting import AttemptReporter, ReportPending, RunResult
from workers.protocol.write_guard import WriteGuard
from workers.telemetry.spans import AttemptTelemetry

log = logging.getLogger("workers.execution")


class Delivery:
    """One delivery of ``workers.run_rollout``: its payload read once, then run (or reported, if rejected).

    The task frees the attempt's slot with ``release_slot`` once no retry of the message follows.
    """

    def __init__(
        self,
        payload: Any,
        *,
        celery_task_id: str,
        expected_agent: str | None,
        res: WorkerResources,
        slot: tuple[str, str] | None = None,
    ) -> None:
        """``slot``: the deployment's key scope and the queue of the attempt's in-flight entry, freed by a hand-over the
        drain makes in the task's place (``AttemptRun``)."""
        read = read_payload(payload, celery_task_id=celery_task_id, expected_agent=expected_agent)
        self._work: AttemptRun | Rejected = AttemptRun(read, res, slot=slot) if isinstance(read, Attempt) else read
        self._res = res

    def release_slot(self, scope: str, queue: str) -> None:
        """Free the attempt's slot (its in-flight entry, the task id) unless another executor holds the attempt;
        a rejected payload was never leased."""
        work = self._work
        if isinstance(work, AttemptRun):
            work.held.release_slot(scope, queue, work.attempt.celery_task_id)
        else:
            release_slot(self._res.redis, scope, queue, work.celery_task_id, None)

    def execute(self) -> Outcome:
        if isinstance(self._work, Rejected):
            return report_rejected(self._work, self._res)
        return self._work.execute()


def report_rejected(rejected: Rejected, res: WorkerResources) -> Outcome:
    """A payload without usable ids cannot be reported; one with ids is failed as bad input (never leased)."""
    attempt = rejected.attempt
    if attempt is None:
        log.error("dropping task %s: %s", rejected.celery_task_id, rejected.message)
        return Outcome(OutcomeStatus.SKIPPED, rejected.message, FailureClass.INPUT)
    reporter = AttemptReporter(attempt, res, WriteGuard(attempt, None, res.settings))
    try:
        return reporter.failure(FailureClass.INPUT, rejected.message)
    except StoreError:
        return Outcome(OutcomeStatus.FAILED, rejected.message, FailureClass.INPUT)


class AttemptRun:
    """Executes one attempt under its lease: claim, fence, run the agent; the report is the reporter's.

    Built once per delivery with its collaborators: the ``HeldAttempt`` (the lease on the attempt and its watch),
    the ``WriteGuard`` that proves the lease before any write, and the ``AttemptReporter`` that ends the attempt.
    """

    def __init__(self, attempt: Attempt, res: WorkerResources, *, slot: tuple[str, str] | None = None) -> None:
        """``slot``: the scope and queue of the attempt's in-flight entry, freed when the drain hands the attempt over
        in the task's place (``HeldAttempt.hand_over_at_drain``); the task frees it on every other way out."""
        if attempt.rollout is None:
            raise ValueError("an attempt without a valid rollout is reported (report_rejected), never run")
        self.attempt = attempt
        self.rollout: AttemptedRollout = attempt.rollout
        self.res = res
        self.settings = res.settings
        self.log = attempt.log
        self.held = HeldAttempt(
            res.redis,
            res.monitor,
            attempt.attempt_id,
            rollout_id=attempt.rollout_id,
            ttl_s=self.settings.lease_ttl_s,
            interval_s=self._heartbeat_interval(),
        )
        self.guard = WriteGuard(attempt, self.lease, self.settings)
        self.reporter = AttemptReporter(attempt, res, self.guard)
        self.slot = None if slot is None else (*slot, attempt.celery_task_id)

    @property
    def lease(self) -> Lease:
        return self.held.lease

    # --- entry point -------------------------------------------------------------------------

    def execute(self) -> Outcome:
        lease = self.lease
        # The started marker must outlive any redelivery of this message.
        claim = self.held.claim(2 * self.settings.visibility_timeout_s, renew=False)
        if claim.done_status is not None:
            return skipped(self.log, f"attempt already finished here ({claim.done_status}); duplicate delivery ignored")
        if not claim.acquired:
            # Not dropped: if the holder died, its lease lapses and the re-check takes the attempt over.
            raise DuplicateDelivery(
                f"another executor holds the lease ({lease.holder()})", retry_in_s=lease.remaining_s()
            )
        try:
            # Renewed from here on, so no Store read before the run (a takeover's fence read, the resources), however
            # slow, lets the lease lapse; the run's Store-fenced watch, with its telemetry, replaces this one (_watch).
            self.held.start_renewing()
            kept = None if claim.first_start else self.reporter.pending()
            if kept is not None:  # the episode ran in an earlier delivery: deliver its report, nothing else
                return self.reporter.deliver_kept(kept)
            return self._run_leased(first_start=claim.first_start, ran_before=claim.ran_before)
        except Exception as exc:
            if is_retryable_before_progress(exc) or isinstance(
                exc, (StoreError, DuplicateDelivery, Superseded, LeaseUnproven)
            ):
                raise  # a Celery retry (with the kept report, if any), or not ours to report
            if isinstance(exc, SoftTimeLimitExceeded) and self.reporter.pending() is not None:
                # The time limit struck once the report was decided and kept: a retry delivers that report.
                raise ReportPending("time limit reached with the report kept; a retry delivers it") from exc
            # A fault of this worker's own code outside the episode's guard: failed once, so the Store's retry
            # policy bounds it, instead of reconcile finding the attempt stranded and re-publishing it forever.
            self.log.exception("unexpected error in the worker; failing the attempt")
            error = f"unexpected worker error: {redact_error(exc)}"
            self.reporter.discard_kept()  # if delivering it raised, the failure must not re-deliver it
            return self.reporter.failure(classify(exc), error)
        finally:
            self.held.release()  # after the final report; the run's watch was unwatched at its end already

    # --- phases ------------------------------------------------------------------------------

    def _run_leased(self, *, first_start: bool, ran_before: bool) -> Outcome:
        dequeued_at = self.attempt.dequeued_at
        if first_start and self.guard.view_is_fresh(dequeued_at, alive_at=dequeued_at):
            self.guard.viewed(dequeued_at)  # the dequeue answer the bridge published moments ago
        else:
            sent_at = time.time()
            try:
                current = self.res.store.get_rollout(self.attempt.rollout_id)
            except UnknownIdError:
                return skipped(self.log, "the Store does not know this rollout (it restarted?); dropping the task")
            reason = fence(current, self.attempt.attempt_id)
            if reason is not None:
                return skipped(self.log, f"not running: {reason}")
            assert isinstance(current, AttemptedRollout)
            if ran_before or current.attempt.status == AttemptStatus.RUNNING:
                # An earlier executor's agent began this attempt and its lease lapsed (we hold it now). Its spans may
                # be in the attempt already, or still on their way (a request queued at a busy Store, a process that
                # stalled and wakes): running again would mix two executions into one trace and one reward. Failed,
                # the Store's retry policy starts a clean attempt. (``running`` covers a mark lost with Redis's data.)
                return self.reporter.failure(
                    FailureClass.INFRA,
                    "the worker executing this attempt was lost after its agent began; not re-run in place",
                )
            self.guard.viewed(sent_at)
        configured = self._configured_agent()
        if isinstance(configured, str):
            return self.reporter.failure(FailureClass.AGENT, configured)
        if configured is not None:
            return self._run_litagent(configured)
        try:
            task = parse_task_input(self.rollout.input, max_chars=self.settings.max_instruction_chars)
        except InvalidInputError as exc:
            return self.reporter.failure(FailureClass.INPUT, str(exc))
        try:
            resources = self.res.store.get_resources(self.rollout.resources_id)
            target = llm_mod.resolve_target(resources, self.rollout, self.settings)
        except llm_mod.LLMError as exc:
            return self.reporter.failure(FailureClass.LLM, str(exc))
        # No explicit `running` mark: the first stored span sets it (6.1). The bridge's reconcile tells a
        # started attempt from a stranded one by its lease in Redis, not by the Store status.
        self.log.info(
            "started on %s (llm=%s via %s, trace=%s)",
            self.attempt.executor,
            target.model,
            target.source,
            self.attempt.trace_id,
        )
        return self._run_episode(task, target)

    def _run_episode(self, task: Any, target: llm_mod.LLMTarget) -> Outcome:
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
            with telemetry.span(
                "webshop.episode", self.attempt.span_attributes({"webshop.task_id": task.task_id})
            ) as root:
                result = episode.run()
                root.set_attribute("episode.reward", result.reward)
                root.set_attribute("episode.steps", result.steps)
            return result

        return self._run_attempt(body)

    def _run_attempt(self, body: Callable[[AttemptTelemetry, AttemptWatch], RunResult]) -> Outcome:
        """Telemetry, heartbeat and report around one agent run (``body``): the same for every agent. The agent begins
        only once the lease records it (``Lease.mark_ran``): a later claim of the attempt then never runs it again."""
        if not self.lease.mark_ran():
            return skipped(self.log, "the lease lapsed before the agent began (another executor claimed the attempt)")
        telemetry = AttemptTelemetry(
            self.res.store,
            rollout_id=self.attempt.rollout_id,
            attempt_id=self.attempt.attempt_id,
            service_name=self.settings.service_name,
            traces_url=self.settings.traces_endpoint,
            courier=self.res.courier,
        )
        try:
            watch = self._watch(telemetry)
        except BaseException:
            telemetry.close()  # it counts among the process's running attempts (trace_courier) until closed
            raise
        self.guard.follow(watch, telemetry)
        # An agent that never returns (it swallows the stop and the interrupt) must not keep the hand-over from
        # happening: the drain makes it in this thread's place.
        self.held.hand_over_at_drain(partial(self._hand_over_now, watch), slot=self.slot)
        try:
            if state.node.pool.threads:  # nothing else could stop an agent that blocks outside the LLM calls
                result = stuck.run_abandonable(partial(body, telemetry, watch), watch)
            else:  # prefork: Celery's time limits stop it; solo: the only slot, nothing to run beside it
                result = body(telemetry, watch)
            # Within the episode's budget: retrying past Celery's soft limit would turn a telemetry failure
            # into a "timeout"; at least one try is always made.
            self.guard.flush_while_ours(telemetry, until=min(self.reporter.deadline(), self._episode_deadline() - 1.0))
            # One step with the drain's interrupt: once it began no interrupt comes, and an agent interrupted as it
            # returned is handed over, never reported (the interrupt would strike in the report).
            began = watch.begin_reporting()
        except Superseded as exc:
            if watch.shutdown:
                return self._hand_over(watch)
            self.log.warning("stopped without reporting: %s", exc.reason)
            return Outcome(OutcomeStatus.SKIPPED, exc.reason, FailureClass.CANCELLED)
        except LeaseUnproven as exc:  # a later delivery, or the bridge's reconcile, takes the attempt over
            self.log.warning("stopped without reporting: %s", exc)
            return Outcome(OutcomeStatus.SKIPPED, str(exc), FailureClass.INFRA)
        except Exception as exc:
            if isinstance(exc, SoftTimeLimitExceeded):
                watch.interrupt_seen()
            if watch.shutdown:  # whatever the stopped agent raised (prefork: SoftTimeLimitExceeded from its interrupt)
                return self._hand_over(watch)
            failure = classify(exc)
            if not isinstance(exc, TelemetryError):  # the spans just failed their retries: report at once
                self._flush_quietly(telemetry)
            if failure is FailureClass.INFRA and not isinstance(exc, StoreError):
                self.log.exception("unexpected error in the episode")
            if not watch.begin_reporting():
                return self._hand_over(watch)
            return self.reporter.failure(failure, redact_text(str(exc)) or type(exc).__name__, telemetry)
        else:
            if not began:
                return self._hand_over(watch)
            return self.reporter.success(result, telemetry)
        finally:
            self.held.unwatch()
            telemetry.close()

    def _hand_over(self, watch: AttemptWatch) -> Outcome:
        """The worker drained before the episode finished: give the rollout back so it runs again elsewhere, once,
        whether this thread or the drain's (in place of an agent that did not return) gets there first."""
        return watch.hand_over_once(partial(self._hand_over_now, watch))

    def _hand_over_now(self, watch: AttemptWatch) -> Outcome:
        """Read the rollout, then report the attempt ``failed`` (``shutdown``) when the Store retries that, else hand
        the rollout back (``requeuing``) and mark the attempt done (``workers.lifecycle.drain.handover``). The partial
        episode's spans are dropped: the trainer reads the next attempt's.
        """
        watch.begin_reporting()  # the heartbeat and the drain's interrupt leave it alone from now on
        reason = watch.stop_reason or drain.shutdown_reason(None)
        bound = self.guard.write_bound()
        try:
            self.guard.prove_lease(time.time() + bound)
            sent_at = time.time()
            current = self.res.store.get_rollout(self.attempt.rollout_id, retries=1, timeout=bound)
        except UnknownIdError:
            return skipped(self.log, "the Store does not know this rollout (it restarted?); dropping the task")
        except (Superseded, LeaseUnproven) as exc:
            return skipped(self.log, f"stopped by the drain, not handed over: {exc}")
        except StoreError as exc:  # undecided: the failure report retries, and the retry policy decides
            self.log.warning("could not read the rollout to hand it over (%s); reporting it failed", exc)
            return self.reporter.failure(FailureClass.SHUTDOWN, reason)
        why_not = fence(current, self.attempt.attempt_id)
        if why_not is not None:
            return skipped(self.log, f"stopped by the drain, not handed over: {why_not}")
        assert isinstance(current, AttemptedRollout)
        self.guard.viewed(sent_at)
        if drain.handover(current.config, current.attempt.sequence_id) is drain.Handover.FAIL:
            return self.reporter.failure(FailureClass.SHUTDOWN, reason)
        self.res.store.update_rollout(self.attempt.rollout_id, status=RolloutStatus.REQUEUING)
        try:
            mark_done(self.res.redis, self.attempt.attempt_id, "requeued", self.settings.done_marker_ttl_s)
        except redis.RedisError as exc:  # a redelivery finds the rollout requeuing: the fence stops it
            self.log.warning("could not record the done marker: %r", exc)
        self.log.warning("%s; no retry left for a failed attempt: handed the rollout back to the Store queue", reason)
        return Outcome(OutcomeStatus.SKIPPED, f"{reason}; handed back", FailureClass.SHUTDOWN)

    def _watch(self, telemetry: AttemptTelemetry) -> AttemptWatch:
        """The attempt's heartbeat, lease and fence watch, registered with the monitor by ``HeldAttempt.follow``."""
        interval = self._heartbeat_interval()
        watch = AttemptWatch(
            self.attempt.rollout_id,
            self.attempt.attempt_id,
            self.lease,
            telemetry,
            interval_s=interval,
            flush_interval_s=span_flush_interval(
                self.settings.span_flush_interval_s, self.rollout.config.unresponsive_seconds, interval
            ),
            flush_max_pending=self.settings.span_buffer_max_spans,
            deadline=self._episode_deadline(),
            executor=self.attempt.executor,
            unresponsive_s=self.rollout.config.unresponsive_seconds,
            first_beat_in_s=interval - (time.time() - self.attempt.dequeued_at),  # the clock started at the dequeue
            viewed_at=self.guard.viewed_at,
            alive_at=self.attempt.dequeued_at,
            interruptible=state.node.pool.prefork,
        )
        self.held.follow(watch)
        return watch

    def _run_litagent(self, configured: ConfiguredAgent) -> Outcome:
        """A configured LitAgent in place of the WebShop episode (``workers.agents.litagent``)."""
        from workers.agents import capture, litagent  # agentlightning: only on workers configured for it

        resources = self.res.store.get_resources(self.rollout.resources_id)
        try:
            target: llm_mod.LLMTarget | None = llm_mod.resolve_target(resources, self.rollout, self.settings)
        except llm_mod.LLMError as exc:
            if resources is None:  # nothing at all to give the agent (Agent Lightning's runner fails these too)
                return self.reporter.failure(FailureClass.LLM, str(exc))
            target = None  # resources without an LLM: the agent may not need one
        named = litagent.named_resources(resources, target, self.attempt.rollout_id, self.attempt.attempt_id)
        self.log.info(
            "started on %s (agent=%s, trace=%s)", self.attempt.executor, configured.path, self.attempt.trace_id
        )

        def body(telemetry: AttemptTelemetry, watch: AttemptWatch) -> RunResult:
            attempt = capture.AttemptCapture(
                telemetry,
                self.settings,
                watch.check,
                watch.deadline,
                self._rate_limiter,
                record_spans=self.settings.agent_tracer != "agentops",
            )
            with telemetry.span("agent.rollout", self.attempt.span_attributes({"agent": configured.path})) as root:
                result = litagent.run_agent(configured, self.attempt.payload, named, attempt, self.attempt.executor)
                root.set_attribute("agent.result_kind", result.result_kind)
                if result.reward is not None:
                    root.set_attribute("agent.reward", result.reward)
            return result

        return self._run_attempt(body)

    def _configured_agent(self) -> ConfiguredAgent | str | None:
        """This worker's LitAgent (None: the WebShop agent), or why this message must not run here.

        The message's ``agent`` is only compared with the worker's own configuration, never imported.
        """
        expected = self.attempt.expected_agent or DEFAULT_AGENT
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

    # --- helpers -----------------------------------------------------------------------------

    def _flush_quietly(self, telemetry: AttemptTelemetry) -> None:
        try:
            self.guard.flush_while_ours(telemetry, until=time.time() + 10)
        except (TelemetryError, Superseded, LeaseUnproven) as exc:
            self.log.warning("spans of the failed attempt were not delivered: %s", exc)

    def _rate_limiter(self, model: str) -> LLMRateLimiter | None:
        """The global per-model LLM budget (LLM_RPM/LLM_TPM/LLM_RATE_LIMITS), or None when unlimited."""
        rpm, tpm = self.settings.llm_rate_limit(model)
        limit = RateLimit(rpm, tpm, self.settings.llm_rate_burst_s)
        return LLMRateLimiter(self.res.redis, model, limit) if limit.active else None

    def _heartbeat_interval(self) -> float:
        unresponsive = self.rollout.config.unresponsive_seconds
        interval = self.settings.heartbeat_interval_s
        return min(interval, unresponsive / 3) if unresponsive else interval

    def _episode_deadline(self) -> float:
        # clamp_to_broker: a takeover re-read the Store's unclamped timeout_seconds (see the bridge's publisher).
        timeout = clamp_to_broker(self.settings, self.rollout.config.timeout_seconds)
        return self.attempt.dequeued_at + soft_time_limit(self.settings, timeout)


def is_retryable_before_progress(exc: BaseException) -> bool:
    """Infrastructure errors worth a Celery retry: nothing of the episode has happened yet, or the episode
    has run and its report is kept in Redis (``ReportPending``, a StoreUnavailable), which the retry delivers."""
    return isinstance(exc, (StoreUnavailable, redis.ConnectionError, redis.TimeoutError))
