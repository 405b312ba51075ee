"""httpcore's connection pool, retiring an expired connection under the connection's own lock.

httpcore hands an idle connection to a request under the pool's lock but starts the request under the
connection's lock after releasing the pool's; another thread may meanwhile find that connection expired and
close it without any lock, pulling the socket from under the request (``Bad file descriptor``, a failed
WebShop step). Checking and closing under the connection's lock leaves only the harmless case: the request
finds the connection closed and the pool gives it another. Figures: docs/performance.md. Registered in
``bridge.core.patches``.
"""

from __future__ import annotations

import httpcore
import httpx

__all__ = ["expiry_checked"]


class _ExpiryCheckedConnection(httpcore.HTTPConnection):
    """A direct HTTP connection whose expiry check and close happen under its own lock."""

    def has_expired(self) -> bool:
        inner = self._connection
        lock = getattr(inner, "_state_lock", None)
        if inner is None or lock is None:  # not connected yet (or a protocol without that lock): as httpcore
            return super().has_expired()
        if not inner.has_expired():  # the common case, without the lock: a live connection stays either way
            return False
        with lock:
            if not inner.has_expired():  # a request started on it meanwhile
                return False
            inner.close()
            return True


class _ExpiryCheckedPool(httpcore.ConnectionPool):
    def create_connection(self, origin: httpcore.Origin) -> httpcore.ConnectionInterface:
        connection = super().create_connection(origin)
        if type(connection) is httpcore.HTTPConnection:  # a direct one; proxies' connections stay as they are
            connection.__class__ = _ExpiryCheckedConnection  # same object, one method more careful
        return connection


def expiry_checked(transport: httpx.HTTPTransport) -> httpx.HTTPTransport:
    """``transport`` whose pool retires expired connections atomically (``_ExpiryCheckedConnection``)."""
    transport._pool.__class__ = _ExpiryCheckedPool
    return transport
