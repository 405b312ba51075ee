"""A Redis lease on an attempt: the idempotency guard against Celery's at-least-once delivery.

A lease is named by its ``lease_id``, the name of one attempt's Redis state: a 0.3 attempt's Store attempt id
(also its Celery task id), a 1.0 attempt's deployment-scoped key (``bridge.core.gateway.scoped_attempt_key``,
which is not its task id). ``agl:lease:<lease_id>`` says who executes it now and expires unless renewed, so a
redelivery after a crash can take over; ``agl:owner:<lease_id>`` says who claimed it last, with
an epoch each claim raises, and a renewal succeeds only for that owner and never after the done marker, so a
stalled executor that was taken over learns so at its next renewal and stops without writing;
``agl:started:<lease_id>`` marks a later claim as a takeover, and ``agl:ran:<lease_id>`` (``Lease.mark_ran``, set
under the live lease right before the agent begins) one that must not run the agent again. A renewal after Redis
lost its data restores the first three, the higher epoch winning. Why: docs/architecture.md, "Guarantees"
(Redelivery, Takeover).

Public API, small because ``workers.execution``, ``workers.protocol.write_guard``, ``workers.protocol.reporting`` and
``workers.protocol.heartbeat`` share it:
``Lease.claim``, ``Lease.mark_ran``, ``Lease.renew`` (bool), ``Lease.release``, ``Lease.remaining_s``, ``Lease.holder``,
``Lease.valid_until`` (monotonic time up to which our lease is known to be live), ``renew_all`` (every
lease of a process in one round trip), ``mark_done`` and ``free_slot``. Each takes a coordination client
(``bridge.core.coordination.connection``), whose answers are ``str``.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from bridge.core.coordination import keys

# KEYS: lease, done, started, owner, ran. ARGV: our executor token, lease ttl ms, started/owner ttl s.
# One round trip at task start: finished already? someone else executing? the first start of the attempt? did an
# earlier executor's agent begin? A claim raises the owner's epoch by one, so whoever held the attempt before can
# never renew it again.
_CLAIM = """
local done = redis.call('get', KEYS[2])
if done then return {0, done, '', 0} end
if redis.call('exists', KEYS[1]) == 1 then return {1, '', '', 0} end
local owner = redis.call('get', KEYS[4])
local epoch = 1
if owner then epoch = (tonumber(string.match(owner, '^(%d+):')) or 0) + 1 end
local token = string.format('%d', epoch) .. ':' .. ARGV[1]
redis.call('set', KEYS[1], token, 'PX', ARGV[2])
redis.call('set', KEYS[4], token, 'EX', ARGV[3])
local first = '0'
if redis.call('set', KEYS[3], token, 'NX', 'EX', ARGV[3]) then first = '1' end
return {2, first, token, redis.call('exists', KEYS[5])}
"""

# KEYS: lease, ran. ARGV: our token, ran ttl s. The mark is set only while the lease is ours: a claim that comes later
# finds it, and one that came earlier took the lease, so this returns 0 and the agent never begins.
_MARK_RAN = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('set', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""

# KEYS: lease, owner, started, done of each lease in turn (4 per lease). ARGV: token, lease ttl ms, started/owner
# ttl s of each lease in turn (3 per lease). One call renews every lease of a process, atomically.
# Per lease: 1 (held: lease extended, or restored after data loss together with owner and started marker),
# 0 (lost: a later claim owns the attempt, or we never claimed it) or 2 (done: the attempt was reported;
# nobody renews it again).
_RENEW = """
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local lease, owner_key, started, done = KEYS[4 * i + 1], KEYS[4 * i + 2], KEYS[4 * i + 3], KEYS[4 * i + 4]
  local token, ttl_ms, keep_s = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3]
  local ours = tonumber(string.match(token, '^(%d+):')) or 0
  local result = 1
  if redis.call('exists', done) == 1 then
    result = 2
  elseif ours < 1 then
    result = 0
  else
    local owner = redis.call('get', owner_key)
    if owner and owner ~= token and (tonumber(string.match(owner, '^(%d+):')) or 0) >= ours then result = 0 end
  end
  if result == 1 then
    redis.call('set', lease, token, 'PX', ttl_ms)
    redis.call('set', owner_key, token, 'EX', keep_s)
    redis.call('set', started, token, 'NX', 'EX', keep_s)
  end
  out[i + 1] = result
end
return out
"""

# KEYS: in-flight set, lease. ARGV: attempt id, our token ('' when we never held the attempt).
# The in-flight entry is per attempt id, shared by every delivery of it: only clear it when no other executor
# holds the attempt right now, or a duplicate (or a stale executor) would free the live execution's slot.
_FREE_SLOT = """
local holder = redis.call('get', KEYS[2])
if holder and holder ~= ARGV[2] then return 0 end
return redis.call('zrem', KEYS[1], ARGV[1])
"""

# KEYS: lease, owner. ARGV: our token. Drop our lease and mark the owner key released (same epoch, so the next claim
# still goes one higher): a renewal already on its way for this lease then finds it lost instead of restoring it
# (the restore after Redis data loss would otherwise hold a released attempt for a lease TTL).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
if redis.call('get', KEYS[2]) == ARGV[1] then redis.call('set', KEYS[2], ARGV[1] .. ':released', 'KEEPTTL') end
"""

DEFAULT_STARTED_TTL_S = 4 * 3600.0


def executor_id() -> str:
    """Host, process and thread: names who runs an attempt in logs, the Store and the lease."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()}"


@dataclass(frozen=True)
class Claim:
    acquired: bool
    first_start: bool = False  # no executor started this attempt before (else: a takeover after a crash)
    ran_before: bool = False  # an earlier executor's agent began (``Lease.mark_ran``): never run it again in place
    done_status: str | None = None  # the attempt was already reported with this status


class Renewal(enum.Enum):
    """What a renewal found: still ours, taken over by a later claim, or already reported."""

    HELD = 1
    LOST = 0
    DONE = 2


class Lease:
    """One attempt's lease, named by ``lease_id`` (see the module's docstring)."""

    def __init__(self, client: redis.Redis, lease_id: str, ttl_s: float) -> None:
        self._client = client
        self.lease_id = lease_id
        self.key = keys.lease(lease_id)
        self.ttl_ms = int(ttl_s * 1000)
        self.ttl_s = ttl_s
        # Epoch-prefixed by ``claim``; until then nothing in Redis can match it.
        self.token = f"0:{executor_id()}:{uuid.uuid4().hex[:8]}"
        self._suffix = self.token.split(":", 1)[1]
        self.started_ttl_s = DEFAULT_STARTED_TTL_S
        # Monotonic time until which the lease is known to be ours: set from the send time of the latest
        # successful claim or renewal (Redis starts the TTL later than that, so this errs on the safe side).
        self.valid_until = 0.0

    def _keys(self) -> list[str]:
        aid = self.lease_id
        return [self.key, keys.owner(aid), keys.started(aid), keys.done(aid)]

    def _args(self) -> list[str | int]:
        return [self.token, self.ttl_ms, max(1, int(self.started_ttl_s))]

    def claim(self, started_ttl_s: float) -> Claim:
        """Take the lease unless the attempt is finished or held; note whether this is its first start.

        The started marker and the owner key must outlive any redelivery of the task (``started_ttl_s``:
        the broker's visibility timeout and more), or a takeover would be taken for a first start and a
        stale executor could take an attempt back.
        """
        self.started_ttl_s = max(1.0, started_ttl_s)
        sent = time.monotonic()
        code, value, token, ran = self._client.eval(
            _CLAIM,
            5,
            self.key,
            keys.done(self.lease_id),
            keys.started(self.lease_id),
            keys.owner(self.lease_id),
            keys.ran(self.lease_id),
            self._suffix,
            self.ttl_ms,
            max(1, int(self.started_ttl_s)),
        )
        if int(code) == 0:
            return Claim(False, done_status=value)
        if int(code) == 2:
            self.token = token or self.token
            self.valid_until = sent + self.ttl_s
        return Claim(int(code) == 2, first_start=value == "1", ran_before=int(ran) == 1)

    def mark_ran(self) -> bool:
        """Record, while the lease is ours, that this executor's agent begins now; False when it is not ours any more
        (taken over: the agent must not begin). Raises ``redis.RedisError`` when Redis cannot tell.

        Why: a live executor's writes can reach the Store after its lease lapsed (a request queued at a busy Store, a
        stalled process), and a takeover that saw the attempt ``preparing`` would run a second execution beside them
        (docs/architecture.md, "Takeover"). Lost with Redis's data, the mark falls back to what the Store shows.
        """
        keep_s = max(1, int(self.started_ttl_s))
        return bool(self._client.eval(_MARK_RAN, 2, self.key, keys.ran(self.lease_id), self.token, keep_s))

    def renew(self) -> bool:
        """Extend the lease if the attempt is still ours and unreported; False means stop without writing.

        After Redis data loss this restores the lease, the owner key and the started marker.
        Raises ``redis.RedisError`` when Redis cannot tell.
        """
        return renew_all(self._client, [self])[0] is Renewal.HELD

    def _apply(self, answer: object, sent: float) -> Renewal:
        result = Renewal(int(answer))  # type: ignore[call-overload]
        if result is Renewal.HELD:
            self.valid_until = max(self.valid_until, sent + self.ttl_s)
        else:
            self.valid_until = 0.0
        return result

    def release(self) -> None:
        """Drop our lease (never another executor's) for good: the owner key stays, marked released, so neither an
        older executor nor a renewal of ours already in flight can bring it back."""
        self._client.eval(_RELEASE, 2, self.key, keys.owner(self.lease_id), self.token)
        self.valid_until = 0.0

    def remaining_s(self) -> float:
        """Seconds until the lease lapses (0 when it is gone): how long a duplicate delivery should wait."""
        ttl_ms = int(self._client.pttl(self.key))
        return max(0.0, ttl_ms / 1000.0)

    def holder(self) -> str | None:
        return self._client.get(self.key)


def renew_all(client: redis.Redis, leases: Sequence[Lease]) -> list[Renewal]:
    """Renew every lease in one Redis call (one script over all of them), whatever the Store is doing.

    Returns one result per lease, in order. Raises ``redis.RedisError`` when Redis cannot tell.
    """
    if not leases:
        return []
    script = client.register_script(_RENEW)  # EVALSHA; the script is loaded again after a Redis restart
    sent = time.monotonic()
    answers = script(
        keys=[key for lease in leases for key in lease._keys()],
        args=[arg for lease in leases for arg in lease._args()],
    )
    return [lease._apply(answer, sent) for lease, answer in zip(leases, answers, strict=True)]


def mark_done(client: redis.Redis, lease_id: str, status: str, ttl_s: float) -> None:
    """Mark the attempt named ``lease_id`` finished with ``status``: a later delivery of it is dropped."""
    client.set(keys.done(lease_id), status, ex=int(ttl_s))


def free_slot(
    client: redis.Redis,
    scope: str,
    queue: str,
    inflight_id: str,
    token: str | None = None,
    *,
    lease_id: str | None = None,
) -> bool:
    """Clear the attempt's in-flight entry (in deployment ``scope``'s set of ``queue``) unless another executor
    holds the attempt now; True if cleared.

    ``token`` is the caller's own lease token when it executed the attempt (its lease may still be there if
    the release failed); a delivery that never held the attempt passes None. The entry (``inflight_id``: the
    attempt's task id) is shared by every delivery: a rejected duplicate, an expired redelivery or a stale
    executor that was taken over must leave the live execution's slot counted. ``lease_id``: the name the
    attempt's lease is kept under when it differs from its in-flight entry (a 1.0 attempt's scoped key).
    """
    inflight = keys.inflight(scope, queue)
    lease = keys.lease(lease_id or inflight_id)
    return bool(client.eval(_FREE_SLOT, 2, inflight, lease, inflight_id, token or ""))
