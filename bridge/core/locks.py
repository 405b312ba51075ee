"""Owner-checked writes to a Redis key that holds a token: the executors' attempt leases (``workers.protocol.lease``),
whose key is also set by a Lua script of their own, so redis-py's ``Lock`` (the leader lock's) does not fit.

A plain ``DEL`` or ``PEXPIRE`` could touch a key another holder took after ours expired; these scripts
compare the token and act in one atomic step, so only the holder that set a key can extend or drop it.
"""

from __future__ import annotations

import redis

# Extend the key only while it still holds our token.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
# Delete the key only while it still holds our token.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def renew(client: redis.Redis, key: str, token: str, ttl_ms: int) -> bool:
    """Extend ``key`` to ``ttl_ms`` if we still hold it; False when it is gone or someone else's."""
    return bool(client.eval(_RENEW, 1, key, token, ttl_ms))


def release(client: redis.Redis, key: str, token: str) -> None:
    """Drop ``key`` if we still hold it; another holder's key is left alone."""
    client.eval(_RELEASE, 1, key, token)
