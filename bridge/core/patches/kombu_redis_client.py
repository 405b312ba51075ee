"""kombu's Redis transport, reusing one client per channel where kombu builds one per call.

kombu's Redis channel builds a new ``redis.Redis`` around its connection pool for every acknowledgement, every
fanout publish (the worker's task events), every message it files as unacknowledged and every task the bridge
publishes (``Channel.conn_or_acquire`` without a client). A client is a thin view on the pool, but building one
copies redis-py's table of about 200 response callbacks, a notable share of a ``-P threads`` worker's Python
time (docs/performance.md, "The worker's CPU"). ``Transport`` keeps one client per channel and pool instead: the same
commands on the same pool (a client is thread-safe; each command takes a pool connection), and a new client
when kombu replaced the pool (after a connection error). Chosen by ``broker_transport`` for ``redis://`` and
``rediss://`` brokers (``bridge.core.task.message.base_app``). Registered in ``bridge.core.patches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

__all__ = ["TRANSPORT", "Channel", "Transport"]

TRANSPORT = f"{__name__}:Transport"
"""The ``broker_transport`` value that selects it."""


class Channel(kombu_redis.Channel):
    """kombu's Redis channel whose ``conn_or_acquire`` hands out one client per pool."""

    _reused: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        reused = self._reused
        if reused is None or reused.connection_pool is not pool:
            reused = self._reused = self._create_client()
        yield reused


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with ``Channel``."""

    Channel = Channel
