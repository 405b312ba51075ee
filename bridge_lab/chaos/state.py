"""What a chaos scenario knows while it runs and what its audit returns, shared by scenarios, runner and audit.

Kept apart from ``bridge_lab.chaos.run`` (which drives scenarios) and ``bridge_lab.chaos.audit``
(which counts), so neither imports the other. Everything recorded here is a fact read from the Store,
Redis or Celery's own task registry, never a log line or the inside of a token.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from bridge.core.coordination import coordination_client, markers
from bridge.core.settings import load_settings
from bridge.core.store import ACTIVE_ROLLOUT, FINISHED_ROLLOUT, Attempt, AttemptedRollout, AttemptStatus, StoreClient
from bridge.core.task import base_app
from bridge_lab.procs import ManagedProcess
from bridge_lab.stack import LocalStack

REPORTED = frozenset({AttemptStatus.SUCCEEDED, AttemptStatus.FAILED})
"""Attempt statuses only an executor's final report sets (the Store's watchdog sets timeout/unresponsive)."""


@dataclass
class ScenarioResult:
    """One scenario's counts; the four zeros of ``clean`` are what the chaos suite asserts."""

    name: str
    enqueued: int = 0
    succeeded: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    # Every attempt that ended other than succeeded, retried ones included, by failure class (else its status):
    # the evidence that a fault the rollouts' retries absorbed did happen.
    attempts_failed: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    executed_twice: int = 0
    flipped: int = 0
    bad_reward: int = 0
    # 1.0: rollouts the gateway no longer has (the trainer deleted them, a restart forgot them), counted in
    # ``enqueued`` but out of the other counts: their programs' end is checked instead (``bridge_lab.chaos.v1``).
    forgotten: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.lost == self.executed_twice == self.flipped == self.bad_reward == 0


@dataclass(frozen=True)
class FinalReport:
    """Who reported an attempt and with what: a second report by another execution changes it.

    ``started_at`` and ``duration_s`` are computed by the executing task before it reports, so a retried
    HTTP request of the same report carries the same values, while any other execution's report differs.
    """

    status: str
    worker_id: Any
    started_at: Any
    duration_s: Any

    @classmethod
    def of(cls, attempt: Attempt) -> FinalReport | None:
        """The report an attempt carries, or None while no executor has reported it."""
        if attempt.status not in REPORTED:
            return None
        meta = attempt.metadata or {}
        return cls(str(attempt.status), meta.get("worker_id"), meta.get("started_at"), meta.get("duration_s"))


class ChaosRun:
    """One scenario in progress: its stack, its rollouts, and an observer that records what it saw finish."""

    def __init__(
        self,
        services: LocalStack,
        stack: LocalStack,
        rollout_ids: list[str],
        borrowed: dict[str, ManagedProcess] | None = None,
    ) -> None:
        self.services = services
        self.borrowed = borrowed or {}
        self.stack = stack
        self.rollout_ids = rollout_ids
        self.store = StoreClient(stack.store_url, retries=3, timeout_s=20)
        self.redis = coordination_client(stack.redis_url or stack.broker_url, socket_timeout=2)
        self.first_final: dict[str, str] = {}  # rollout id -> the first finished status seen
        self.flipped: set[str] = set()
        self.latest: dict[str, AttemptedRollout] = {}
        self.first_report: dict[str, FinalReport] = {}  # attempt id -> its report when first seen
        self.stop = threading.Event()
        self.notes: list[str] = []
        self._celery: Celery | None = None
        self._observing = threading.Lock()  # one observation at a time: see observe_once

    # --- observing ---------------------------------------------------------------------------------

    def observe_once(self) -> None:
        """One look at every rollout of the run: first finished status, flips, and each report's first form.

        Several threads observe (the observer's loop, a scenario's ``wait_recovered``, the audit's last look), so a
        read and its bookkeeping are one step: a read answered before a report but counted after a later read
        that saw the report would record a flip the Store never made (docs/cluster.md, "What a partition must not
        break").
        """
        with self._observing, contextlib.suppress(Exception):  # the Store may be paused on purpose: try again
            rollouts, _ = self.store.list_rollouts(rollout_ids=self.rollout_ids)
            for item in rollouts:
                if isinstance(item, AttemptedRollout):
                    self.latest[item.rollout_id] = item
                    report = FinalReport.of(item.attempt)
                    if report is not None:
                        self.first_report.setdefault(item.attempt.attempt_id, report)
                first = self.first_final.get(item.rollout_id)
                if first is None and item.status in FINISHED_ROLLOUT:
                    self.first_final[item.rollout_id] = item.status
                elif first is not None and item.status != first and item.rollout_id not in self.flipped:
                    self.flipped.add(item.rollout_id)
                    attempt = item.attempt if isinstance(item, AttemptedRollout) else None
                    self.note(
                        f"{item.rollout_id} flipped {first} -> {item.status}"
                        + (f" (latest attempt {attempt.attempt_id} {attempt.status})" if attempt else "")
                    )

    def observe(self) -> None:
        while not self.stop.wait(0.5):
            self.observe_once()

    @property
    def finished(self) -> int:
        return len(self.first_final)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if predicate():
                return True
            time.sleep(0.3)
        return False

    @property
    def complete(self) -> bool:
        return self.finished >= len(self.rollout_ids)

    def wait_progress(self, finished: int, timeout_s: float, *, running: bool = True) -> bool:
        """Until ``finished`` rollouts are done (and, if asked, some attempt is running): a fault hits mid-run.
        False on timeout, and at once when every rollout has finished: nothing is left for a fault to hit."""
        reached = self.wait_for(
            lambda: self.complete or (self.finished >= finished and (not running or bool(self.running()))), timeout_s
        )
        return reached and not self.complete

    def share(self, fraction: float) -> int:
        """How many finished rollouts make ``fraction`` of this run: faults are placed by progress, not time."""
        return max(1, int(len(self.rollout_ids) * fraction))

    # --- who runs what -------------------------------------------------------------------------------

    def running(self) -> list[AttemptedRollout]:
        """Rollouts whose latest attempt an executor holds right now: its lease key exists in Redis.

        Workers send no ``running`` mark, so the Store alone cannot tell a started attempt from a claimed one.
        """
        active = [r for r in self.latest.values() if r.status in ACTIVE_ROLLOUT]
        try:
            facts = markers.read_markers(self.redis, [r.attempt.attempt_id for r in active])
        except redis.RedisError:  # restarting on purpose: nothing to pick this round
            return []
        return [r for r in active if facts[r.attempt.attempt_id].leased]

    def leased(self, attempt_id: str) -> bool:
        try:
            return markers.read_markers(self.redis, [attempt_id])[attempt_id].leased
        except redis.RedisError:
            return False

    def celery(self) -> Celery:
        """A client app on the scenario's broker: to ask workers what they run, and to publish duplicates."""
        if self._celery is None:
            # The workers' own broker settings: a RabbitMQ queue declared with another type (QUEUE_TYPE) or
            # arguments than it has is refused (PRECONDITION_FAILED), so a plain app could not publish to it.
            queue_type = self.stack.component_env().get("QUEUE_TYPE", "classic")
            settings = load_settings(
                store_url=self.stack.store_url,
                broker_url=self.stack.broker_url,
                redis_url=self.stack.redis_url or None,
                queue_type=queue_type,
            )
            self._celery = base_app(settings, "chaos")
        return self._celery

    def executor_pids(self) -> dict[str, int]:
        """Attempt id -> pid of the pool process running it, as the workers themselves answer.

        The task id is the attempt id; ``inspect active`` returns each running task with its
        ``worker_pid``. ``limit`` ends the broadcast as soon as every live worker has answered.
        """
        live = sum(1 for w in self.stack.workers if w.alive())
        if live == 0:
            return {}
        try:
            replies = self.celery().control.inspect(timeout=1.0, limit=live).active() or {}
        except Exception:  # the broker is restarting on purpose: nothing to pick this round
            return {}
        return {
            str(task["id"]): int(task["worker_pid"])
            for tasks in replies.values()
            for task in tasks or []
            if task.get("id") and isinstance(task.get("worker_pid"), int)
        }

    # --- bookkeeping ---------------------------------------------------------------------------------

    def process(self, name: str) -> ManagedProcess | None:
        """A service process this run may pause or restart (its own, or one borrowed from the caller)."""
        return self.services.processes.get(name) or self.borrowed.get(name)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def close(self) -> None:
        if self._celery is not None:
            self._celery.close()
        self.redis.close()
        self.store.close()
