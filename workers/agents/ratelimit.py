"""A global LLM rate limit: one token bucket per model in Redis, shared by every worker on every host.

An endpoint's quota is global, and Celery's ``rate_limit`` is per worker and limits task starts, so the
budget lives in the broker's Redis (``bridge.core.coordination.keys.ratelimit(model)``). Requests are charged one unit
before each call, tokens (optional) after it with the count the endpoint reported; refill runs on the Redis
server's clock. ``acquire`` reserves the next slot even when the level is short and sleeps until it, so
callers are served in arrival order and none starves; a caller stopped while waiting gives its reservation
back. When Redis does not answer the call goes through, and the process skips the limiter for ``BYPASS_S``:
an outage of the limiter must never fail an episode the endpoint would serve.
Details and figures: docs/operations.md, "The LLM rate limit".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from bridge.core.coordination import keys
from workers.lifecycle import metrics as worker_metrics
from workers.lifecycle import state

log = logging.getLogger("workers.agents.ratelimit")

MAX_SLEEP_S = 1.0  # re-check stop conditions at least this often while waiting for a reserved slot
BYPASS_S = 5.0  # after Redis failed to answer, skip the limiter this long (one probe per period)

# KEYS[1] bucket; ARGV: rpm, tpm, burst_s, request_cost, token_cost.
# Debits both costs at once (levels may go negative: that is the reservation) and returns the seconds until
# the debt this call leaves is paid back, its reserved slot: "0" if the call may go at once. A negative
# request_cost gives a reservation back (capped at the bucket's size). Returned as a string: Lua numbers
# would be truncated to integers.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local req_cost, tok_cost = tonumber(ARGV[4]), tonumber(ARGV[5])
local h = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local elapsed = math.max(0, now - (tonumber(h[3]) or now))
local req, tok, wait = 0, 0, 0
if rpm > 0 then
  local cap = math.max(1, rpm * burst / 60)
  req = math.min(cap, (tonumber(h[1]) or cap) + elapsed * rpm / 60)
  req = math.min(cap, req - req_cost)
  if req_cost > 0 and req < 0 then wait = -req * 60 / rpm end
end
if tpm > 0 then
  local cap = math.max(1, tpm * burst / 60)
  tok = math.min(cap, (tonumber(h[2]) or cap) + elapsed * tpm / 60)
  tok = tok - tok_cost
  if req_cost > 0 and tok < 0 then wait = math.max(wait, -tok * 60 / tpm) end
end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now))
-- Kept while reservations are outstanding: a bucket that expired in debt would come back full.
redis.call('PEXPIRE', KEYS[1], 120000 + math.floor(burst * 1000) + math.ceil(wait * 1000))
return tostring(wait)
"""


class _Outage:
    """Per Redis connection pool: until when the limiter is skipped, and whether a probe is under way."""

    def __init__(self) -> None:
        self.until = 0.0  # time.monotonic() before which callers skip the limiter
        self.lock = threading.Lock()


def _outage_for(client: redis.Redis) -> _Outage:
    """One back-off per Redis address and process (``workers.lifecycle.state``), shared by every limiter (one
    per attempt) on it."""
    pool = client.connection_pool
    process = state.process
    with process.llm_outages_lock:
        outage = process.llm_outages.get(pool)
        if outage is None:
            outage = process.llm_outages[pool] = _Outage()
        assert isinstance(outage, _Outage)
        return outage


@dataclass(frozen=True)
class RateLimit:
    """Budget for one model; ``None`` means that dimension is not limited."""

    rpm: float | None = None
    tpm: float | None = None
    burst_s: float = 10.0

    @property
    def active(self) -> bool:
        return bool(self.rpm or self.tpm)


class LLMRateLimiter:
    """Reserves a slot in a model's shared budget before each call and charges the tokens it used afterwards."""

    def __init__(self, client: redis.Redis, model: str, limit: RateLimit) -> None:
        self._client = client
        self.model = model
        self.limit = limit
        self.key = keys.ratelimit(model)
        self.waited_s = 0.0
        self._script = client.register_script(_RESERVE)
        self._outage = _outage_for(client)

    def acquire(self, check_stop: Callable[[], None] | None = None) -> float:
        """Reserve one request and sleep until its slot; returns the seconds waited.

        ``check_stop`` is called at least every ``MAX_SLEEP_S`` while waiting, so a cancelled, superseded
        or timed-out attempt stops waiting within a second (and gives its reservation back) instead of
        holding its slot until the budget frees up.
        """
        if not self.limit.active:
            return 0.0
        started = time.monotonic()
        wait = self._reserve(requests=1, tokens=0, op="acquire")
        if wait > 0:
            slot = started + wait
            try:
                while (left := slot - time.monotonic()) > 0:
                    if check_stop is not None:
                        check_stop()
                    time.sleep(min(MAX_SLEEP_S, left))
            except BaseException:
                self._reserve(requests=-1, tokens=0, op="refund")  # the slot goes to the next caller
                raise
        waited = time.monotonic() - started
        self.waited_s += waited
        return waited

    def charge_tokens(self, tokens: int | None) -> None:
        """Debit what a finished call used; later reservations wait while the token level is below zero."""
        if self.limit.tpm and tokens:
            self._reserve(requests=0, tokens=tokens, op="charge")

    def _reserve(self, *, requests: int, tokens: int, op: str) -> float:
        """Run the bucket script; 0 (go at once) while Redis is in its back-off or does not answer.

        After a failure, one caller at a time asks Redis again once the back-off is over (the probe);
        the others keep skipping meanwhile instead of each waiting out the socket timeout. While Redis
        answers, no lock is taken.
        """
        outage = self._outage
        probing = False
        if outage.until:
            if time.monotonic() < outage.until or not outage.lock.acquire(blocking=False):
                worker_metrics.observe_ratelimit_bypassed(op)
                return 0.0
            probing = True
        args = [self.limit.rpm or 0, self.limit.tpm or 0, self.limit.burst_s, requests, tokens]
        try:
            wait = float(self._script(keys=[self.key], args=args))
        except redis.RedisError as exc:
            outage.until = time.monotonic() + BYPASS_S
            log.warning(
                "rate limiter for %s unavailable (%r); calls go through without it for the next %.0f s",
                self.model,
                exc,
                BYPASS_S,
            )
            worker_metrics.observe_ratelimit_bypassed(op)
            return 0.0
        finally:
            if probing:
                outage.lock.release()
        outage.until = 0.0
        return wait
