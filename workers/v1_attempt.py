"""One Agent Lightning 1.0 attempt on this worker: the rollout's agent program in a subprocess, as 1.0's own
``local`` runner starts it, held by a Redis lease and reported to the gateway (docs/agl-v1.md).

Contract:
* At most one executor per attempt: a done marker drops a delivery of a finished attempt, and the lease
  (``keys.lease(attempt_key)``) one that another executor holds.
* The program runs in a session of its own with the environment ``workers.v1_environment`` builds (never the
  worker's secrets) and the gateway's copy of the rollout's config, never the message's; at the
  rollout's ``timeout_seconds``, or when the gateway shows the rollout moved on (finished, deleted, another
  attempt), its whole process group is killed; the program also dies with the worker process (``PR_SET_PDEATHSIG``).
* The outcome (exit code 0: succeeded; else failed with the last lines the program wrote) is kept in Redis
  before it is sent, so the dispatcher applies it if the gateway could not be told.
* Only the rollout's current attempt (``last_attempt_id``) is ever patched.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from bridge.core import capacity, keys, locks
from bridge.core.agl_v1 import (
    GatewayClient,
    GatewayError,
    V1Rollout,
    V1State,
    attempt_key,
)
from bridge.core.settings import Settings
from workers.lease import free_slot
from workers.v1_environment import output_redactor, program_environment

log = logging.getLogger("workers.v1")

OUTPUT_LINES = 20  # the program's last lines kept for a failed attempt's error
KILL_WAIT_S = 5.0
RESULT_TTL_S = 24 * 3600

# The program's entry point, run with ``python -c``: import the class named on the command line, call
# ``run()`` (awaiting it when it is a coroutine); exit 0 on return, 1 with the traceback on an exception.
# Set up in the child itself: a ``preexec_fn`` is unsafe in a threaded worker.
RUNNER = """
import asyncio, importlib, inspect, os, sys, traceback
try:  # Linux: SIGKILL when the worker that started this dies (PR_SET_PDEATHSIG), or at once if it already did
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
    if os.getppid() != int(sys.argv[2]):
        sys.exit(1)
except (OSError, AttributeError):
    pass
path = sys.argv[1]
try:
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not isinstance(cls, type):
        raise TypeError(f"{path} is not a class")
    result = cls().run()
    if inspect.isawaitable(result):
        asyncio.run(result)
except Exception:
    traceback.print_exc()
    sys.exit(1)
"""


@dataclass(frozen=True)
class V1Outcome:
    """What the attempt ended as: ``state`` succeeded or failed, or None when it was not ours to report."""

    state: V1State | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.state.value if self.state else "skipped", "detail": self.detail}


class V1Attempt:
    """Runs one delivery of a 1.0 attempt; ``run`` returns its outcome and never raises for the program's
    own failures."""

    def __init__(
        self, rollout: V1Rollout, attempt_id: str, *, settings: Settings, client: redis.Redis, scope: str, queue: str
    ) -> None:
        self.rollout, self.attempt_id = rollout, attempt_id
        self.key = attempt_key(rollout.rollout_id, attempt_id)
        self.settings, self.redis, self.scope, self.queue = settings, client, scope, queue
        self.token = f"v1:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.gateway = GatewayClient(settings.agl_v1_url, key=settings.agl_v1_key)
        self.tag = f"[v1 rollout={rollout.rollout_id} attempt={attempt_id}]"

    def run(self) -> V1Outcome:
        held = False
        try:
            if self.redis.exists(keys.done(self.key)):
                return V1Outcome(None, "already finished: duplicate delivery dropped")
            ttl_ms = int(self.settings.lease_ttl_s * 1000)
            if not self.redis.set(keys.lease(self.key), self.token, nx=True, px=ttl_ms):
                return V1Outcome(None, "another executor holds this attempt: duplicate delivery dropped")
            held = True
            self.redis.set(keys.started(self.key), self.token, ex=int(self.settings.done_marker_ttl_s))
            current = self.gateway.get_rollout(self.rollout.rollout_id)
            if not self._ours(current):
                return self._finish(V1Outcome(None, "the rollout moved on before it started"))
            assert current is not None
            self.rollout = current  # the gateway's copy decides what runs, never the message's (docs/agl-v1.md)
            if current.status.state == V1State.QUEUING:  # the dispatcher's patch has not landed yet
                self.gateway.patch_status(current.rollout_id, state=V1State.RUNNING, last_attempt_id=self.attempt_id)
            return self._finish(self._execute())
        except (GatewayError, redis.RedisError) as exc:
            log.warning("%s could not run: %s; the dispatcher's reconcile takes it from here", self.tag, exc)
            return V1Outcome(None, f"not run: {exc}")
        finally:
            self.gateway.close()
            if held:
                self._release()

    # --- the program ---------------------------------------------------------------------------

    def _execute(self) -> V1Outcome:
        local = self.rollout.config.local
        if local is None or not local.agent_class:
            return V1Outcome(V1State.FAILED, "invalid rollout config: missing config.local.agent_class")
        try:
            env = program_environment(self.rollout, self.attempt_id, self.settings)
        except ValueError as exc:
            return V1Outcome(V1State.FAILED, str(exc))
        python = self.settings.agl_v1_agent_python or sys.executable
        process = subprocess.Popen(
            [python, "-c", RUNNER, local.agent_class, str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        reader = threading.Thread(target=self._read_output, args=(process, tail), daemon=True)
        reader.start()
        log.info("%s started %s (pid %d)", self.tag, local.agent_class, process.pid)
        timeout_s = float(self.rollout.config.timeout_seconds)
        deadline = time.monotonic() + timeout_s
        interval = min(self.settings.heartbeat_interval_s, self.settings.lease_ttl_s / 3)
        while True:
            try:
                code = process.wait(timeout=max(0.0, min(interval, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= deadline:
                _kill_group(process)
                reader.join(1.0)
                return V1Outcome(V1State.FAILED, f"timed out after {timeout_s:.0f}s; the agent's processes were killed")
            stop = self._stop_reason()
            if stop is not None:
                _kill_group(process)
                return V1Outcome(None, stop)
        reader.join(2.0)
        if code == 0:
            return V1Outcome(V1State.SUCCEEDED, "the agent exited with code 0")
        last = "\n".join(tail) or "(no output)"
        return V1Outcome(V1State.FAILED, f"the agent exited with code {code}:\n{last}")

    def _read_output(self, process: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
        assert process.stdout is not None
        redact = output_redactor(self.settings)
        for raw in process.stdout:
            line = redact(raw.decode("utf-8", "replace").rstrip())
            tail.append(line)
            log.debug("%s %s", self.tag, line)

    def _stop_reason(self) -> str | None:
        """Why the program must stop now (the lease lost, the rollout moved on), or None to go on."""
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        try:
            if not locks.renew(self.redis, keys.lease(self.key), self.token, ttl_ms):
                return "the lease was lost (another executor took the attempt over): stopped"
        except redis.RedisError as exc:
            log.warning("%s could not renew the lease: %r", self.tag, exc)
        try:
            current = self.gateway.get_rollout(self.rollout.rollout_id)
        except GatewayError as exc:
            log.warning("%s could not read the rollout: %s", self.tag, exc)
            return None
        if not self._ours(current):
            return "the rollout moved on (finished, deleted or re-run): stopped"
        return None

    def _ours(self, current: V1Rollout | None) -> bool:
        """The rollout still waits for this attempt: not finished, and no other attempt is its latest."""
        if current is None or current.status.state in (V1State.SUCCEEDED, V1State.FAILED):
            return False
        return current.status.last_attempt_id in (None, self.attempt_id)

    # --- the report --------------------------------------------------------------------------

    def _finish(self, outcome: V1Outcome) -> V1Outcome:
        if outcome.state is None:
            log.info("%s %s", self.tag, outcome.detail)
            return outcome
        record = json.dumps({"state": outcome.state.value, "detail": outcome.detail[-4000:]})
        self.redis.set(keys.v1_result(self.key), record, ex=RESULT_TTL_S)
        self.redis.set(keys.done(self.key), "1", ex=int(self.settings.done_marker_ttl_s))
        try:
            if not self.gateway.finish(self.rollout.rollout_id, self.attempt_id, outcome.state, outcome.detail):
                log.info("%s not reported: the rollout moved on meanwhile", self.tag)
            self.redis.delete(keys.v1_result(self.key))
        except GatewayError as exc:
            log.warning("%s outcome kept for the dispatcher: %s", self.tag, exc)
        level = logging.INFO if outcome.state == V1State.SUCCEEDED else logging.WARNING
        log.log(level, "%s %s: %s", self.tag, outcome.state.value, outcome.detail.splitlines()[0])
        return outcome

    def _release(self) -> None:
        try:
            locks.release(self.redis, keys.lease(self.key), self.token)
            if free_slot(self.redis, self.scope, self.queue, self.key, self.token):
                capacity.notify_freed(self.redis, self.scope, self.queue)
        except redis.RedisError as exc:
            log.warning("%s could not release the lease or the slot (both expire): %r", self.tag, exc)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the program's process group (it leads its own session) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("agent process %d did not exit within %.0fs of SIGKILL", process.pid, KILL_WAIT_S)
