"""A Redis lease on an attempt: the idempotency guard against Celery's at-least-once delivery.

The attempt id is the Celery task id. Whoever holds ``agl:lease:<attempt>`` executes it; a second
delivery of the same message while the lease is live does nothing. The lease expires on its own when
its holder dies (no renewal), so a redelivery after a crash can take over.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass

import redis

from bridge.core import keys, locks

# Renew our lease; if the key vanished (Redis restarted without persistence, or it expired while the
# heartbeat thread was stalled) and nobody else took it, take it back instead of abandoning a live episode.
_RENEW = (
    "local v = redis.call('get', KEYS[1]) "
    "if v == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end "
    "if not v then return redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end "
    "return 0"
)
# One round trip at task start: finished already? someone else executing? the first start of the attempt?
_CLAIM = (
    "local done = redis.call('get', KEYS[2]) "
    "if done then return {0, done} end "
    "if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, ''} end "
    "if redis.call('set', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[3]) then return {2, '1'} end "
    "return {2, '0'}"
)


def executor_id() -> str:
    """Host, process and thread: names who runs an attempt in logs, the Store and the lease."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()}"


@dataclass(frozen=True)
class Claim:
    acquired: bool
    first_start: bool = False  # no executor started this attempt before (else: a takeover after a crash)
    done_status: str | None = None  # the attempt was already reported with this status


class Lease:
    def __init__(self, client: redis.Redis, attempt_id: str, ttl_s: float) -> None:
        self._client = client
        self.attempt_id = attempt_id
        self.key = keys.lease(attempt_id)
        self.ttl_ms = int(ttl_s * 1000)
        self.token = f"{executor_id()}:{uuid.uuid4().hex[:8]}"

    def claim(self, started_ttl_s: float) -> Claim:
        """Take the lease unless the attempt is finished or held; note whether this is its first start.

        The started marker must outlive any redelivery of the task (``started_ttl_s``: the broker's
        visibility timeout and more), or a takeover would be taken for a first start.
        """
        code, value = self._client.eval(
            _CLAIM,
            3,
            self.key,
            keys.done(self.attempt_id),
            keys.started(self.attempt_id),
            self.token,
            self.ttl_ms,
            max(1, int(started_ttl_s)),
        )
        text = value.decode() if isinstance(value, bytes) else str(value)
        if int(code) == 0:
            return Claim(False, done_status=text)
        return Claim(int(code) == 2, first_start=text == "1")

    def renew(self) -> bool:
        return bool(self._client.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    def release(self) -> None:
        locks.release(self._client, self.key, self.token)

    def remaining_s(self) -> float:
        """Seconds until the lease lapses (0 when it is gone): how long a duplicate delivery should wait."""
        ttl_ms = int(self._client.pttl(self.key))
        return max(0.0, ttl_ms / 1000.0)

    def holder(self) -> str | None:
        value = self._client.get(self.key)
        return value.decode() if isinstance(value, bytes) else value


def mark_done(client: redis.Redis, attempt_id: str, status: str, ttl_s: float) -> None:
    client.set(keys.done(attempt_id), status, ex=int(ttl_s))
