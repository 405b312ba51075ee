"""A bounded warm shutdown (``WORKER_SHUTDOWN_GRACE_S``): what happens to a node's running episodes when it drains.

At SIGTERM the main process withdraws the node's slot adverts (``workers.lifecycle.steps.advertising``) and records a
*stop time* (``workers.lifecycle.steps.drain``), the signal's time plus the grace less a reporting margin, in this
process and in Redis (``keys.worker_drain``), where pool children, which never see the main process's signal, read
it. From the stop time on, each process's heartbeat stops its running attempts (``HeartbeatMonitor``); a stopped attempt
is handed over (``handover``) so it runs again elsewhere, and an episode that ends before it is reported as
usual. The hand-over does not wait for the agent: an attempt whose thread has not begun it ``HAND_OVER_AFTER_S``
after the stop is handed over by its process's heartbeat in that thread's place
(``workers.protocol.held.HeldAttempt.hand_over_at_drain``), well before the forced exit, which ends prefork children
with their process. Celery's soft shutdown does not fit: it starts only with a cold shutdown, and then terminates the
tasks instead of letting them report (docs/operations.md, "Graceful shutdown").
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

import redis

from bridge.core.coordination import keys
from bridge.core.store import AttemptStatus, RolloutConfig

log = logging.getLogger("workers.lifecycle.drain")

# Stop this long before the grace ends: the interrupt (1 s), hand-over and report (< 0.1 s) and Celery's own exit,
# measured at 2.5 s (threads) and 4 s (prefork, 3 slots) on a loaded 2-core host (docs/operations.md).
MARGIN_S = 6.0
MIN_GRACE_S = 8.0  # WORKER_SHUTDOWN_GRACE_S's lower bound: episodes get at least 2 s
CHECK_EVERY_S = 0.5  # a process with running attempts reads the node's stop time this often
INTERRUPT_AFTER_S = 1.0  # prefork: an agent still running this long after its stop is interrupted (SIGUSR1)
INTERRUPT_LANDS_S = 1.0  # an interrupt sent as the agent returned lands in its thread within this (bounded wait)
# An attempt whose own thread has begun neither its report nor its hand-over this long after its stop (an agent that
# swallows the stop and the interrupt never returns) is handed over by its process's heartbeat instead: after the
# interrupt and the time it takes to land, and after ``-P threads``' 2 s before it abandons an agent thread.
HAND_OVER_AFTER_S = INTERRUPT_AFTER_S + INTERRUPT_LANDS_S + 0.5
EXIT_EARLY_S = 0.5  # a process still there this long before the grace ends exits by force


def stop_after(grace_s: float) -> float:
    """Seconds after the signal at which running episodes are stopped: the grace less the reporting margin."""
    return max(MIN_GRACE_S - MARGIN_S, grace_s - MARGIN_S)


def shutdown_reason(grace_s: float | None) -> str:
    grace = f" (grace {grace_s:g} s)" if grace_s is not None else ""
    return f"the worker shut down before the episode finished{grace}"


class Handover(StrEnum):
    """How a stopped attempt goes back to the Store, so that the rollout runs again on another worker."""

    FAIL = "fail"  # report it failed (class shutdown): the Store's retry policy requeues the rollout
    REQUEUE = "requeue"  # no retry left for a failed attempt: hand the rollout back (requeuing), attempt untouched


def handover(config: RolloutConfig, sequence_id: int) -> Handover:
    """``FAIL`` when the Store would retry a failed attempt (``failed`` in ``retry_condition`` and attempts left
    under ``max_attempts``); else ``REQUEUE``, since a failed report would end the rollout ``failed`` for a
    shutdown that is none of its doing (docs/store-protocol.md 6.2; 10, "Handing a rollout back")."""
    retried = AttemptStatus.FAILED in config.retry_condition and sequence_id < config.max_attempts
    return Handover.FAIL if retried else Handover.REQUEUE


@dataclass
class DrainClock:
    """This process's view of its node's stop time: set here (the main process) or read from Redis (a child).

    The record names the worker process that drains (``incarnation``, ``state.NodeState.incarnation``): a node
    name outlives its process (a restarted container keeps its host name, so ``worker@%h`` comes back), and a
    new process must not read its predecessor's drain, which lives on in Redis for the grace plus a minute.
    """

    node: str | None = None  # the Celery node name: the main process's, or learned from a task's request
    stop_at: float | None = None  # epoch s
    grace_s: float | None = None
    incarnation: str = ""  # the node's main process: its own drain is the only one this clock reads
    _next_read: float = 0.0

    def begin(self, client: redis.Redis, scope: str, node: str, grace_s: float) -> float:
        """Record the stop time of a drain starting now, here and in Redis; returns it."""
        self.node, self.grace_s = node, grace_s
        self.stop_at = time.time() + stop_after(grace_s)
        record = f"{self.stop_at}:{grace_s}:{self.incarnation}"
        try:
            client.set(keys.worker_drain(scope, node), record, ex=int(grace_s) + 60)
        except redis.RedisError as exc:  # the children then run on; the exit deadline still ends them
            log.warning("could not publish the drain to this node's pool processes: %r", exc)
        return self.stop_at

    def due(self, client: redis.Redis, scope: str, now: float) -> bool:
        """Whether running episodes must stop now; reads Redis at most every ``CHECK_EVERY_S``."""
        self.refresh(client, scope, now)
        return self.stop_at is not None and now >= self.stop_at

    def refresh(self, client: redis.Redis, scope: str, now: float) -> bool:
        """Whether the node is draining; a child reads Redis at most every ``CHECK_EVERY_S`` until it is."""
        if self.stop_at is None and self.node is not None and now >= self._next_read:
            self._next_read = now + CHECK_EVERY_S
            try:
                raw = client.get(keys.worker_drain(scope, self.node))
            except redis.RedisError:
                raw = None
            if raw:
                stop_at, grace, incarnation = [*str(raw).split(":"), "", ""][:3]
                if incarnation != self.incarnation:  # an earlier process of this node name drained, not ours
                    return False
                self.stop_at, self.grace_s = float(stop_at), float(grace) if grace else None
        return self.stop_at is not None

    @property
    def draining(self) -> bool:
        return self.stop_at is not None


def interrupt_main_thread() -> None:
    """Raise Celery's ``SoftTimeLimitExceeded`` in this pool child's task (billiard's SIGUSR1 handler), for an
    agent that does not return by itself: blocked in a call that never reaches its stop check."""
    os.kill(os.getpid(), signal.SIGUSR1)


TIMER_LAG_S = 0.2  # the timer after the thread: the thread's clean exit first wherever threads still run


def exit_by(deadline: float) -> None:
    """End this (main) process at ``deadline`` if it is still there: by then its attempts were handed over, and
    what remains is Celery's own exit (pool children, atexit hooks), measured at up to 6 s on a loaded host.

    Never through a signal's default action: the kernel drops those for the first process of a PID namespace, which
    a worker is in a container without an init. A thread calls ``os._exit`` (status 1), and ``TIMER_LAG_S`` later a
    real-time timer's SIGALRM runs a handler that does the same on the main thread, for when daemon threads no
    longer run (the interpreter finalizing); where finalizing had also reset that handler, SIGALRM's default action
    ends the process (status 142 under an init). Prefork children then see their pipe close and exit."""
    delay = max(0.01, deadline - time.time())
    threading.Thread(target=_exit_after, args=(delay,), name="drain-exit", daemon=True).start()
    try:
        signal.signal(signal.SIGALRM, lambda signum, frame: _exit_now())
        signal.setitimer(signal.ITIMER_REAL, delay + TIMER_LAG_S)
    except ValueError:  # not the main thread: signal.signal refuses; the thread alone ends it
        pass


def _exit_after(delay: float) -> None:
    time.sleep(delay)
    _exit_now()


def _exit_now() -> None:
    """Exit at once, status 1, with one line on stderr (written directly: a logging lock may be held forever)."""
    try:
        os.write(2, b"workers.lifecycle.drain: still running at the end of WORKER_SHUTDOWN_GRACE_S: exiting now\n")
    finally:
        os._exit(1)
