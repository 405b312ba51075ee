"""A global LLM rate limit: one token bucket per model in Redis, shared by every worker on every host.

Why here and not only in Celery: Celery's ``rate_limit`` task option is enforced by each worker on its
own (N workers at ``10/m`` start ``10*N`` tasks a minute), and it limits task *starts*, while a WebShop
episode makes a dozen LLM calls at its own pace. An endpoint's quota (OpenAI's RPM/TPM, a vLLM server's
capacity) is global, so the budget has to live where every worker sees it: the broker's Redis.

The bucket holds two levels in one hash (``bridge.core.keys.ratelimit(model)``):

* requests: refilled at ``rpm/60`` per second, capped at ``rpm * burst_s / 60`` (at least 1), and
  charged one unit *before* each call;
* tokens (optional): refilled at ``tpm/60`` per second, charged *after* each call with the tokens the
  endpoint reported (the count is unknown before). The level may go negative; a call waits until it
  is back above zero. That is how a large answer slows the next calls instead of being refused.

Refill uses the Redis server's clock (``TIME``), so workers with skewed clocks share one fair bucket.
If Redis cannot be reached, the limiter lets the call through with a warning: an outage of the
limiter must not fail episodes that the endpoint itself would have served (the LLM client still honours
429 + Retry-After).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from bridge.core import keys

log = logging.getLogger("workers.ratelimit")

MAX_SLEEP_S = 1.0  # re-check stop conditions at least this often while waiting for budget

# KEYS[1] bucket; ARGV: rpm, tpm, burst_s, request_cost, token_cost, force (1 = debit even if short).
# Returns the seconds to wait (as a string: Lua numbers would be truncated to integers), "0" if granted.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local req_cost, tok_cost, force = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local h = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local elapsed = math.max(0, now - (tonumber(h[3]) or now))
local req, tok, wait = 0, 0, 0
if rpm > 0 then
  local cap = math.max(1, rpm * burst / 60)
  req = math.min(cap, (tonumber(h[1]) or cap) + elapsed * rpm / 60)
  if req < req_cost then wait = (req_cost - req) * 60 / rpm end
end
if tpm > 0 then
  local cap = math.max(1, tpm * burst / 60)
  tok = math.min(cap, (tonumber(h[2]) or cap) + elapsed * tpm / 60)
  if req_cost > 0 and tok < 0 then wait = math.max(wait, -tok * 60 / tpm) end
end
if wait == 0 or force then
  req = req - req_cost
  tok = tok - tok_cost
  wait = 0
end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000 + math.floor(burst * 1000))
return tostring(wait)
"""


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
    """Waits for a model's shared budget before each call and charges the tokens it used afterwards."""

    def __init__(self, client: redis.Redis, model: str, limit: RateLimit) -> None:
        self._client = client
        self.model = model
        self.limit = limit
        self.key = keys.ratelimit(model)
        self.waited_s = 0.0
        self._script = client.register_script(_TAKE)

    def acquire(self, check_stop: Callable[[], None] | None = None) -> float:
        """Block until one request fits the budget; returns the seconds waited.

        ``check_stop`` is called between sleeps so a cancelled or superseded attempt stops waiting
        within a second instead of holding its slot until the budget frees up.
        """
        if not self.limit.active:
            return 0.0
        started = time.monotonic()
        while True:
            wait = self._take(requests=1, tokens=0, force=False)
            if wait <= 0:
                break
            if check_stop is not None:
                check_stop()
            time.sleep(min(MAX_SLEEP_S, wait) * random.uniform(1.0, 1.2))  # jitter: waiters do not wake in step
        waited = time.monotonic() - started
        self.waited_s += waited
        return waited

    def charge_tokens(self, tokens: int | None) -> None:
        """Debit what a finished call used; later calls wait while the token level is below zero."""
        if self.limit.tpm and tokens:
            self._take(requests=0, tokens=tokens, force=True)

    def _take(self, *, requests: int, tokens: int, force: bool) -> float:
        args = [self.limit.rpm or 0, self.limit.tpm or 0, self.limit.burst_s, requests, tokens, 1 if force else 0]
        try:
            return float(self._script(keys=[self.key], args=args))
        except redis.RedisError as exc:
            log.warning("rate limiter for %s unavailable (%r); letting the call through", self.model, exc)
            return 0.0
