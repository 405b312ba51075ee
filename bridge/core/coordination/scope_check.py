"""Workers of this deployment under another spelling of its URL: found at run time and said loudly.

Each process derives its deployment's Redis key scope from the Store's (or the gateway's) URL in canonical form
(``bridge.core.coordination.keys.canonical_endpoint``), so every spelling of one local endpoint is one scope. Two names
of one host that cannot be proved equal (``http://store:4747`` inside compose, ``http://localhost:4747`` on the
host) are two scopes: the dispatcher of one sees none of the other's worker slots and its rollouts wait.

``ScopeWatch.check`` looks, while none of this deployment's workers serves a queue, for workers listed on the
same queues under another scope whose advertised URL (``keys.scope_endpoint``) has the same scheme, port and
path and another host, or the same canonical URL (one side sets ``REDIS_KEY_SCOPE``). It then logs an error
naming both URLs and the fix; in strict mode (``CeleryRunner``) it raises ``ScopeMismatchError`` once that
lasted ``STRICT_AFTER_S``. Workers of another Store (another port or path) are only mentioned at warning level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis

from bridge.core.coordination import capacity, keys
from bridge.core.infra import ConfigError

log = logging.getLogger("bridge.scope")

CHECK_EVERY_S = 60.0  # a keyspace walk (``capacity.listed_scopes``): once a minute while no worker serves us
STRICT_CHECK_EVERY_S = 1.0  # CeleryRunner's check: a trainer should hear of it within seconds
STRICT_AFTER_S = 3.0  # how long the mismatch lasts before CeleryRunner raises (workers re-advertise every 5 s)


class ScopeMismatchError(ConfigError):
    """This deployment's workers serve the same queues under another Redis key scope (another spelling of the
    Store's or gateway's URL, or a ``REDIS_KEY_SCOPE`` set on one side only): no rollout of ours would start."""


@dataclass(frozen=True)
class OtherScope:
    """Workers listed on our queues under another scope, with the URL they advertise (None: not advertised)."""

    scope: str
    endpoint: str | None

    def looks_like(self, ours: str | None) -> bool:
        """Whether these workers plausibly serve our endpoint under another name: the same canonical URL, or
        the same scheme, port and path on another host."""
        if ours is None or self.endpoint is None:
            return False
        mine, theirs = keys.canonical_endpoint(ours), keys.canonical_endpoint(self.endpoint)
        if mine == theirs:
            return True
        a, b = urlsplit(mine), urlsplit(theirs)
        return (a.scheme, a.port, a.path) == (b.scheme, b.port, b.path)


def other_scopes(client: redis.Redis, scope: str, queues: Iterable[str]) -> list[OtherScope]:
    """Every other scope whose workers list themselves on ``queues``, with its advertised URL (one SCAN)."""
    others = sorted(capacity.listed_scopes(client, queues) - {scope})
    if not others:
        return []
    endpoints = client.mget([keys.scope_endpoint(other) for other in others])
    return [OtherScope(other, endpoint) for other, endpoint in zip(others, endpoints, strict=True)]


def mismatch_message(who: str, ours: str | None, scope: str, suspects: list[OtherScope]) -> str:
    """The error line: both URLs, both scopes, and the fix."""
    theirs = ", ".join(f"{s.endpoint} (scope {s.scope})" for s in suspects)
    return (
        f"{who} names this deployment {ours} (Redis key scope {scope}), but no worker serves it under that scope, "
        f"while workers on the same queues name it {theirs}: these look like one Store (gateway) under two "
        "spellings, so no rollout of ours would start. Give every process the same URL, or set one "
        "REDIS_KEY_SCOPE alike on the trainer, the bridge and every worker (docs/operations.md, "
        "'Several deployments on one Redis')"
    )


class ScopeWatch:
    """Called each round with the queues this deployment's workers serve; logs (and in ``strict`` mode raises)
    when they serve none of ``queues`` and workers of the same endpoint under another scope do."""

    def __init__(
        self,
        client: redis.Redis,
        scope: str,
        endpoint: str | None,
        queues: Iterable[str],
        *,
        who: str,
        strict: bool = False,
    ) -> None:
        self.client, self.scope, self.endpoint, self.queues = client, scope, endpoint, list(queues)
        self.who, self.strict = who, strict
        self._next_check = 0.0
        self._suspected_since: float | None = None

    def check(self, served: set[str]) -> None:
        """No-op while any of our queues is served; otherwise look (rate limited) and report."""
        now = time.monotonic()
        if served & set(self.queues):
            self._suspected_since = None
            return
        if now < self._next_check:
            return
        self._next_check = now + (STRICT_CHECK_EVERY_S if self.strict else CHECK_EVERY_S)
        try:
            others = other_scopes(self.client, self.scope, self.queues)
        except redis.RedisError:
            return
        suspects = [other for other in others if other.looks_like(self.endpoint)]
        if not suspects:
            self._suspected_since = None
            if others and not self.strict:
                log.warning(
                    "no worker of this deployment (%s, Redis key scope %s) consumes queues %s; workers of other "
                    "deployments do (%s)",
                    self.endpoint,
                    self.scope,
                    ", ".join(self.queues),
                    ", ".join(f"{o.endpoint or 'URL not advertised'} (scope {o.scope})" for o in others),
                )
            return
        message = mismatch_message(self.who, self.endpoint, self.scope, suspects)
        if not self.strict:
            log.error(message)
            return
        if self._suspected_since is None:
            self._suspected_since = now
        if now - self._suspected_since >= STRICT_AFTER_S:
            raise ScopeMismatchError(message)
