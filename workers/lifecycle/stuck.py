"""Agent threads that never return, under ``-P threads``: abandoned, counted, and cured by a restart.

Nothing can interrupt a Python thread, so under the threads pool the agent runs on a thread of its own
(``run_abandonable``) and the task gives up on it at the attempt's deadline, or on a stop verdict, plus
``ABANDON_GRACE_S``: the attempt is reported ``failed`` (``timeout``) or left unreported, its lease is no
longer renewed, and the thread counts as stuck until it returns. Each stuck thread takes one slot off the
node's advert; at ``MAX_STUCK_AGENT_THREADS`` the node drains (warm shutdown) and re-executes its own command
line. Under prefork Celery's hard time limit does this job. Operator's view: docs/operations.md, "Agents
that block".
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from bridge.core.infra import Superseded
from workers.lifecycle import state
from workers.protocol.heartbeat import AttemptWatch

log = logging.getLogger("workers.lifecycle.stuck")

T = TypeVar("T")

ABANDON_GRACE_S = 2.0  # after the deadline or a stop verdict, how long the agent gets to return by itself
WAKE_MAX_S = 5.0  # the waiting task thread re-checks at least this often (a backstop: stops and returns wake it)


class AgentAbandoned(TimeoutError):
    """The agent did not return by the attempt's deadline (plus the grace): its thread is left behind."""


@dataclass(frozen=True)
class StuckThread:
    thread: threading.Thread
    attempt_id: str
    since: float


class StuckThreads:
    """The process's abandoned agent threads; ``on_change`` runs whenever the count changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[StuckThread] = []
        self.on_change: list[Callable[[int], None]] = []

    def add(self, thread: threading.Thread, attempt_id: str) -> None:
        with self._lock:
            self._threads.append(StuckThread(thread, attempt_id, time.time()))
        self._changed()

    def returned(self, thread: threading.Thread) -> None:
        """A thread counted as stuck finished after all: its slot comes back."""
        with self._lock:
            before = len(self._threads)
            self._threads = [t for t in self._threads if t.thread is not thread]
            changed = len(self._threads) != before
        if changed:
            self._changed()

    def count(self) -> int:
        with self._lock:
            return len(self._threads)

    def attempts(self) -> list[str]:
        with self._lock:
            return [t.attempt_id for t in self._threads]

    def _changed(self) -> None:
        count = self.count()
        for callback in list(self.on_change):
            try:
                callback(count)
            except Exception:  # a listener must never break the task that noticed
                log.exception("stuck-thread listener failed")


@dataclass
class Pool:
    """How this process runs tasks, recorded at ``worker_init``; threads is the only abandonable pool."""

    threads: bool = False
    prefork: bool = False  # the agent runs on a pool child's main thread (SIGUSR1 reaches it)
    max_stuck: int = 4


def run_abandonable(body: Callable[[], T], watch: AttemptWatch) -> T:
    """``body()`` on a thread of its own, in the caller's context; its result, or what it raised.

    Raises ``AgentAbandoned`` (a TimeoutError: class ``timeout``) past the watch's deadline plus
    ``ABANDON_GRACE_S``, or ``Superseded`` that long after the watch got a stop verdict, without waiting for
    the thread, which is then counted in the node's ``StuckThreads`` (``workers.lifecycle.state``). The caller's
    thread sleeps until the agent returns, the watch is stopped (``AttemptWatch.on_stop``) or a deadline comes: it
    does not poll, so a waiting slot costs no CPU (at most one wake every ``WAKE_MAX_S``, a backstop).
    """
    done = threading.Event()
    wake = threading.Event()  # the agent returned, or the watch was stopped
    outcome: dict[str, object] = {}
    context = contextvars.copy_context()  # the task's trace context and anything set around the agent

    def target() -> None:
        try:
            outcome["result"] = context.run(body)
        except BaseException as exc:  # handed to the task's thread as it is
            outcome["error"] = exc
        finally:
            done.set()
            wake.set()
            state.node.stuck_threads.returned(threading.current_thread())

    watch.on_stop.append(wake.set)
    try:
        thread = threading.Thread(target=target, name=f"agent-{watch.attempt_id}", daemon=True)
        thread.start()
        give_up_at: float | None = None
        while True:
            wake.clear()  # cleared before the checks: a stop or a return after them ends the wait at once
            if done.is_set():
                break
            now = time.time()
            if give_up_at is None and (watch.stop_reason is not None or (watch.deadline and now > watch.deadline)):
                give_up_at = now + ABANDON_GRACE_S
            if give_up_at is not None and now >= give_up_at:
                return _abandon(thread, watch)
            until = give_up_at if give_up_at is not None else watch.deadline
            wake.wait(WAKE_MAX_S if not until else min(WAKE_MAX_S, max(0.0, until - now)))
    finally:
        watch.on_stop.remove(wake.set)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]


def _abandon(thread: threading.Thread, watch: AttemptWatch) -> NoReturn:
    reason = watch.stop_reason
    watch.stop("the agent did not return; its thread was abandoned")  # a late LLM call of it stops at once
    stuck_threads = state.node.stuck_threads
    stuck_threads.add(thread, watch.attempt_id)
    count = stuck_threads.count()
    log.error(
        "rollout=%s attempt=%s: the agent did not return %.0fs after %s; its thread is abandoned "
        "(%d stuck in this process)",
        watch.rollout_id,
        watch.attempt_id,
        ABANDON_GRACE_S,
        "the attempt's deadline" if reason is None else f"the stop verdict ({reason})",
        count,
    )
    max_stuck = state.node.pool.max_stuck
    if count >= max_stuck and not state.process.drain_clock.draining:  # a draining worker exits, never re-executes
        restart_worker(f"{count} agent threads stuck (MAX_STUCK_AGENT_THREADS={max_stuck})")
    if reason is not None:
        raise Superseded(reason)
    raise AgentAbandoned(
        "the agent did not return by the attempt's deadline (it blocks outside any LLM call?); "
        "its thread was abandoned and the worker counts it as stuck"
    )


def restart_worker(why: str) -> None:
    """Drain this worker (Celery warm shutdown) and re-execute its command line once it has exited."""
    restarting = state.node.restarting
    if restarting.is_set():
        return
    restarting.set()
    log.error("%s: draining this worker and restarting it", why)
    atexit.register(_reexec)
    os.kill(os.getpid(), signal.SIGTERM)


def _reexec() -> None:
    log.warning("restarting: %s", " ".join(sys.orig_argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execv(sys.executable, sys.orig_argv)
