"""One Agent Lightning 1.0 attempt on this worker: the rollout's agent program in a process of its own, held by a
Redis lease and reported to the gateway (docs/agl-v1.md).

The attempt protocol (lease, heartbeat, kept result, done marker, drain hand-over, slot release) is the one the
0.3 attempt uses (``workers.protocol.held``); this module supplies what differs: how the program starts and stops, and
how the rollout is read and reported.

Contract:
* At most one executor per attempt: its Redis state is named by ``scoped_attempt_key`` (deployment scope and the
  rollout's creation time), a done marker drops a delivery of a finished attempt, and the owner/epoch lease one
  that another executor holds. The lease is renewed by the process's heartbeat thread, never by a gateway read.
* The program runs in a session of its own (started cold or warm by ``workers.v1.launch``) with the environment
  ``workers.v1.environment`` builds (never the worker's secrets) and the gateway's copy of the rollout's config,
  never the message's; at the rollout's ``timeout_seconds`` (clamped as the dispatcher clamps the message's,
  ``bridge.core.task.time_budget.clamp_to_broker``), when the gateway shows the rollout moved on (finished, deleted,
  another attempt), when the lease is lost, or when the node drains, its whole process group is killed, and on
  every other way out too; the program also dies with the worker process (``PR_SET_PDEATHSIG``). A warm program
  whose server died under it is a lost program: the attempt is reported failed (class ``infra``), never re-run
  as a lost worker.
* The outcome (``bridge.core.task.outcome.Outcome``; exit code 0: succeeded; else failed with the last lines the program
  wrote) carries a failure class and is kept in Redis with the done marker before it is sent, so the dispatcher
  applies it if the gateway could not be told. A drain keeps a hand-over record instead and reports nothing.
  Error texts (the program's output, a gateway, Redis or program-server error) are masked and bounded by the
  outcome record (``bridge.core.task.outcome``) before they leave.
* Only the rollout's current attempt (``last_attempt_id``) is ever patched.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis

from bridge.core.coordination import keys
from bridge.core.gateway import (
    GatewayClient,
    GatewayConflict,
    GatewayError,
    V1Rollout,
    V1State,
    attempt_key,
    scoped_attempt_key,
)
from bridge.core.settings import WorkerSettings
from bridge.core.task import FailureClass, Outcome, OutcomeStatus, clamp_to_broker
from workers.lifecycle import metrics
from workers.protocol.heartbeat import HEARTBEAT_TIMEOUT_S, TICK_S, HeartbeatMonitor
from workers.protocol.held import HeldAttempt
from workers.v1.box import ISOLATION_EVENT, Isolation, isolation_of, limit_hit
from workers.v1.environment import output_redactor, program_environment
from workers.v1.launch import start_program
from workers.v1.program_server import BOX_FAILED, BOX_FAILED_MARK
from workers.v1.programs import Program, ProgramLost, WarmProgram
from workers.v1.relay import process_relay

log = logging.getLogger("workers.v1")

OUTPUT_LINES = 20  # the program's last lines kept for a failed attempt's error
OUTPUT_TAIL_BYTES = 16 * 1024  # at most this much of the program's output is held, however long its lines
OUTPUT_CHUNK_BYTES = 4096
RESULT_TTL_S = 24 * 3600
SUCCEEDED, FAILED, SKIPPED = OutcomeStatus.SUCCEEDED, OutcomeStatus.FAILED, OutcomeStatus.SKIPPED


class OutputTail:
    """The last ``OUTPUT_LINES`` lines of a program's output, holding at most ``OUTPUT_TAIL_BYTES``: fed in chunks,
    so a line without a newline is never held whole."""

    def __init__(self, max_bytes: int = OUTPUT_TAIL_BYTES, lines: int = OUTPUT_LINES) -> None:
        self.max_bytes, self.lines = max_bytes, lines
        self._buffer = bytearray()
        self._lock = threading.Lock()

    def feed(self, chunk: bytes) -> None:
        with self._lock:
            self._buffer += chunk
            if len(self._buffer) > self.max_bytes:
                del self._buffer[: len(self._buffer) - self.max_bytes]

    def text(self) -> str:
        with self._lock:
            raw = bytes(self._buffer)
        return "\n".join(line.rstrip() for line in raw.decode("utf-8", "replace").splitlines()[-self.lines :])


class V1Attempt:
    """Runs one delivery of a 1.0 attempt; ``run`` returns its outcome and never raises for the program's
    own failures."""

    def __init__(
        self,
        rollout: V1Rollout,
        attempt_id: str,
        *,
        settings: WorkerSettings,
        client: redis.Redis,
        scope: str,
        queue: str,
        monitor: HeartbeatMonitor,
    ) -> None:
        self.rollout, self.attempt_id = rollout, attempt_id
        self.key = attempt_key(rollout.rollout_id, attempt_id)  # the task id and in-flight entry
        self.state_key = scoped_attempt_key(scope, rollout, attempt_id)  # lease, markers, kept result
        self.settings, self.redis, self.scope, self.queue = settings, client, scope, queue
        self.gateway = GatewayClient(settings.agl_v1_url, key=settings.agl_v1_key)
        # The reads while the program runs: one short try each, the next read is the retry.
        self.fence = GatewayClient(
            settings.agl_v1_url, key=settings.agl_v1_key, timeout_s=HEARTBEAT_TIMEOUT_S, retries=0
        )
        self.held = HeldAttempt(
            client,
            monitor,
            self.state_key,
            rollout_id=rollout.rollout_id,
            ttl_s=settings.lease_ttl_s,
            interval_s=settings.heartbeat_interval_s,
        )
        self.tag = f"[v1 rollout={rollout.rollout_id} attempt={attempt_id}]"

    def run(self) -> Outcome:
        try:
            claim = self.held.claim(float(self.settings.done_marker_ttl_s))
            if claim.done_status is not None:
                return self._skip(Outcome(SKIPPED, "already finished: duplicate delivery dropped"))
            if not claim.acquired:
                return self._skip(Outcome(SKIPPED, "another executor holds this attempt: duplicate delivery dropped"))
            current = self.gateway.get_rollout(self.rollout.rollout_id)  # however slow: the lease is renewed aside
            if current is not None and self._ours(current) and current.status.state == V1State.QUEUING:
                current = self._mark_running(current)
            if not self._ours(current):
                return self._skip(Outcome(SKIPPED, "the rollout moved on before it started", FailureClass.CANCELLED))
            assert current is not None
            self.rollout = current  # the gateway's copy decides what runs, never the message's (docs/agl-v1.md)
            if claim.ran_before:  # an earlier executor started its program, which may still be writing: not again
                # Unreported and undone, the attempt is the dispatcher's lost worker: it runs the rollout again under
                # the next attempt id (AGL_V1_MAX_RERUNS), with a state key of its own.
                lost = "the worker executing this attempt was lost after its program started; not re-run in place"
                log.warning("%s %s", self.tag, lost)
                return Outcome(SKIPPED, lost, FailureClass.INFRA)
            return self._finish(self._execute())
        except (GatewayError, redis.RedisError) as exc:  # the task's result and the log: masked, as 0.3's errors
            outcome = Outcome(SKIPPED, f"not run: {exc}", FailureClass.INFRA)  # the record masks it
            log.warning("%s %s; the dispatcher's reconcile takes it from here", self.tag, outcome.detail)
            return outcome
        finally:
            self.gateway.close()
            self.fence.close()
            self.held.close(self.scope, self.queue, self.key)

    def _mark_running(self, current: V1Rollout) -> V1Rollout | None:
        """The dispatcher's patch to ``running`` has not landed yet: make it here. When it lands in between, the
        gateway refuses this one (409: running -> running is no transition): the rollout as it is now."""
        try:
            self.gateway.patch_status(current.rollout_id, state=V1State.RUNNING, last_attempt_id=self.attempt_id)
        except GatewayConflict:
            return self.gateway.get_rollout(current.rollout_id)
        return current

    # --- the program ---------------------------------------------------------------------------

    def _execute(self) -> Outcome:
        local = self.rollout.config.local
        if local is None or not local.agent_class:
            return Outcome(FAILED, "invalid rollout config: missing config.local.agent_class", FailureClass.INPUT)
        try:
            grant = process_relay(self.settings.agl_v1_url, self.settings.agl_v1_key).grant(
                self.rollout, self.attempt_id
            )
        except ValueError as exc:  # an env_map path the input lacks
            return Outcome(FAILED, str(exc), FailureClass.INPUT)
        try:
            return self._execute_with(local.agent_class, grant.env)
        finally:
            grant.revoke()  # a call of the program's after its attempt is refused

    def _execute_with(self, agent_class: str, attempt_env: dict[str, str]) -> Outcome:
        try:
            env = program_environment(self.rollout, self.settings, attempt=attempt_env)
        except ValueError as exc:
            return Outcome(FAILED, str(exc), FailureClass.INPUT)
        stopped = self._stopped()
        if stopped is not None:  # the node drains, or the lease went, before the program started
            return stopped
        if not self.held.lease.mark_ran():  # a later claim of the attempt must never start a second program
            return Outcome(SKIPPED, "the lease lapsed before the program started: not run", FailureClass.CANCELLED)
        try:
            program = start_program(self.settings, agent_class, env)
        except ProgramLost as exc:  # the server took the request and died: it may have started, never run it twice
            return Outcome(FAILED, f"the agent's program server failed: {exc}", FailureClass.INFRA)
        tail = OutputTail()
        reader = threading.Thread(target=self._read_output, args=(program, tail), daemon=True)
        isolation = isolation_of(program.box, program.pid)
        metrics.program_started(program.start, isolation.kind)
        try:
            reader.start()
            log.info(
                "%s started %s (pid %d, %s start, %s)",
                self.tag,
                agent_class,
                program.pid,
                program.start,
                isolation.describe(),
            )
            self._record(isolation, program)
            ended = self._supervise(program)
        finally:
            # Every way out: children the program left behind at its exit, an exception, Celery's time limit.
            program.kill()
            reader.join(2.0)
        if isinstance(ended, Outcome):
            return self._blame_pause(ended)
        if ended == 0:
            return Outcome(SUCCEEDED, "the agent exited with code 0")
        last = output_redactor(self.settings)(tail.text()) or "(no output)"
        if isinstance(ended, ProgramLost):  # a lost program: reported, never run again as a lost worker's
            return Outcome(
                FAILED,
                f"the agent's program server died under it (the agent was killed with it):\n{last}",
                FailureClass.INFRA,
            )
        if ended == BOX_FAILED and BOX_FAILED_MARK in last:
            return Outcome(FAILED, f"the agent did not run: {last}", FailureClass.INFRA)
        limit = limit_hit(ended, last, self.settings, disk_quota=isolation.disk_quota)
        if limit is not None:
            detail = f"the agent ran into {limit}, {isolation.describe()}, and exited with code {ended}:\n{last}"
            return Outcome(FAILED, detail, FailureClass.AGENT)
        return self._blame_pause(Outcome(FAILED, f"the agent exited with code {ended}:\n{last}", FailureClass.AGENT))

    def _record(self, isolation: Isolation, program: Program) -> None:
        """The box the program runs in, as an event of its attempt on the gateway, where the trainer reads it beside
        the rollout; a gateway that does not take it costs a warning, never the attempt."""
        data = {**isolation.record(), "start": program.start, "host": socket.gethostname()}
        try:
            self.gateway.post_event(self.rollout.rollout_id, self.attempt_id, ISOLATION_EVENT, data)
        except GatewayError as exc:
            log.warning("%s could not record its box on the gateway: %s", self.tag, exc)

    def _blame_pause(self, outcome: Outcome) -> Outcome:
        """A program that timed out or failed while the trainer had the gateway's proxy paused ended because of the
        pause (its time ran out waiting, or its client gave up on the 429s): class ``infra``, the pause named.
        One read of the proxy's state, on these two ways out only."""
        if outcome.status is not FAILED or outcome.failure_class not in (FailureClass.TIMEOUT, FailureClass.AGENT):
            return outcome
        pause = self.fence.proxy_pause()
        if pause is None or not pause.paused:
            return outcome
        return Outcome(FAILED, f"{pause.describe()} when the program ended: {outcome.detail}", FailureClass.INFRA)

    def _supervise(self, program: Program) -> Outcome | ProgramLost | int:
        """Wait for the program: its exit code, or why it was stopped (its timeout, a stop of the protocol, the
        rollout moving on), or ProgramLost when its server died under it."""
        # The gateway's copy carries the trainer's timeout_seconds: clamped as the dispatcher clamped the message's,
        # so the program never runs past the task's hard limit or the broker's redelivery (``clamp_to_broker``).
        timeout_s = clamp_to_broker(self.settings, float(self.rollout.config.timeout_seconds), agl_v1=True)
        deadline = time.monotonic() + timeout_s
        interval = self.settings.heartbeat_interval_s
        next_read = time.monotonic() + interval
        while True:
            try:
                code = program.wait(max(0.0, min(TICK_S, deadline - time.monotonic())))
            except ProgramLost as exc:
                return exc
            if code is not None:
                break
            if time.monotonic() >= deadline:
                return Outcome(
                    FAILED,
                    f"timed out after {timeout_s:.0f}s; the agent's processes were killed",
                    FailureClass.TIMEOUT,
                )
            stopped = self._stopped()
            if stopped is not None:
                return stopped
            if time.monotonic() >= next_read:
                moved = self._moved_on()
                next_read = time.monotonic() + interval
                if moved is not None:
                    return Outcome(SKIPPED, moved, FailureClass.CANCELLED)
        return code

    def _stopped(self) -> Outcome | None:
        """The protocol's stop (the node's drain: a hand-over; the lease lost or reported elsewhere), or None."""
        reason = self.held.stop_reason
        if reason is None:
            return None
        if self.held.shutdown:
            return Outcome(SKIPPED, reason, FailureClass.SHUTDOWN, handover=True)
        return Outcome(SKIPPED, f"{reason}: stopped", FailureClass.CANCELLED)

    def _read_output(self, program: Program, tail: OutputTail) -> None:
        while chunk := os.read(program.output_fd, OUTPUT_CHUNK_BYTES):  # whatever is there, never a whole line
            tail.feed(chunk)
        if isinstance(program, WarmProgram):  # ours to close (a cold one's is the Popen's)
            os.close(program.output_fd)

    def _moved_on(self) -> str | None:
        """Why the program must stop because of the gateway (the rollout finished, deleted, re-run), or None."""
        try:
            current = self.fence.get_rollout(self.rollout.rollout_id)
        except GatewayError as exc:
            log.warning("%s could not read the rollout (read again next interval): %s", self.tag, exc)
            return None
        if not self._ours(current):
            return "the rollout moved on (finished, deleted or re-run): stopped"
        return None

    def _ours(self, current: V1Rollout | None) -> bool:
        """The rollout still waits for this attempt: the gateway has it (a restarted gateway forgets every rollout,
        the trainer deletes them), it is the same rollout (a rollout created again under the same id after a
        restart is another one: its creation time differs), not finished, and no other attempt is its latest."""
        if current is None or current.status.state in (V1State.SUCCEEDED, V1State.FAILED):
            return False
        created, ours = current.status.created_at, self.rollout.status.created_at
        if created is not None and ours is not None and created != ours:
            return False
        return current.status.last_attempt_id in (None, self.attempt_id)

    # --- the report --------------------------------------------------------------------------

    def _skip(self, outcome: Outcome) -> Outcome:
        log.info("%s %s", self.tag, outcome.detail)
        return outcome

    def _finish(self, outcome: Outcome) -> Outcome:
        if outcome.handover:
            # Kept for the dispatcher, which runs the rollout again elsewhere; the gateway is never told.
            self._keep(outcome)
            log.warning("%s handed over: %s", self.tag, outcome.detail)
            return outcome
        if outcome.state is None:
            return self._skip(outcome)
        self._keep(outcome)
        try:
            state = V1State(outcome.state)
            reported = self.gateway.finish(self.rollout.rollout_id, self.attempt_id, state, outcome.message())
            self.redis.delete(keys.v1_result(self.state_key))
        except GatewayError as exc:
            log.warning("%s outcome kept for the dispatcher: %s", self.tag, exc)
            reported = True  # the dispatcher reports it: the attempt's outcome stands
        if not reported:  # finished, deleted, forgotten by a restart, or re-run meanwhile: nothing was written
            return self._skip(
                Outcome(
                    SKIPPED,
                    f"the rollout moved on before the report ({outcome.state}): not reported",
                    FailureClass.CANCELLED,
                )
            )
        level = logging.INFO if outcome.status is SUCCEEDED else logging.WARNING
        log.log(level, "%s %s: %s", self.tag, outcome.state, outcome.headline)
        return outcome

    def _keep(self, result: Outcome) -> None:
        self.held.keep(
            result,
            result_key=keys.v1_result(self.state_key),
            result_ttl_s=RESULT_TTL_S,
            done_ttl_s=self.settings.done_marker_ttl_s,
        )
