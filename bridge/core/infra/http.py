"""The one way this project builds an HTTP client for a service it calls (Store, WebShop, LLM) and reads
its answers' pacing hints."""

from __future__ import annotations

import functools
import socket
import ssl
import struct
import threading
from typing import Any

import httpx

from bridge.core.patches.httpcore_pool_expiry import expiry_checked

# A request given up on (a timeout) must not reach the service later. On a normal close the kernel keeps
# retransmitting the bytes the peer has not acknowledged, so a span batch or heartbeat stalled by a network
# partition would land when the link returns, after another host took the attempt over (docs/cluster.md).
# Linger 0 makes close() drop them and reset the connection instead.
ABORT_ON_CLOSE = [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))]

# Shorter than the idle timeout of the servers we call (uvicorn closes an idle connection after 5 s, which is
# also httpx's default expiry): with equal values a request sent on a connection idle for ~5 s can meet the
# server's close and fail with "Server disconnected without sending a response" (seen on WebShop /step
# between 5 s LLM calls). A fresh connection on loopback or a LAN costs far less than such a failure.
KEEPALIVE_S = 2.0


@functools.cache
def default_tls() -> ssl.SSLContext:
    """httpx's default verifying TLS context (certifi's CAs, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``), built once
    per process and shared by every transport of this module.

    Each build loads the whole CA bundle: about 0.8 MB and 20 ms of CPU. Built per transport, the two gateway
    clients a 1.0 attempt opens cost 40 ms of CPU per rollout, even for ``http://`` URLs, and the freed bundles
    fragmented the worker's heap: a prefork node grew by 0.8 MB steps, about 20 MB per 1,000 short rollouts
    (``bench-v1 --long``, docs/performance.md)."""
    return httpx.create_ssl_context()


class PerThreadTransport(httpx.BaseTransport):
    """A connection pool per calling thread, so that no thread pays for the connections of the others.

    httpcore's pool walks every connection it holds on each request and each response close, with a
    readability check (a syscall) per idle connection, all under the GIL. With 128 threads sharing one pool
    of about 128 connections that walk is a large share of a ``-P threads -c 128`` worker's Python time
    (docs/performance.md, "The worker's CPU"). A synchronous thread uses one connection at a time, so its own pool
    holds one or two. The pool of a thread that ended goes to the next thread that needs one, with its open
    connections: under ``-P threads`` an agent runs on a thread per attempt, which would otherwise open (and with
    TLS negotiate) a connection to every service for each rollout.
    """

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        # One TLS context for every pool: each would build its own otherwise, loading the CA bundle again
        # (~0.8 MB and milliseconds of CPU each, times threads x clients).
        self._tls = default_tls()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pools: dict[threading.Thread, httpx.HTTPTransport] = {}  # each calling thread's pool
        self._idle: list[httpx.HTTPTransport] = []  # pools of threads that ended, for the next ones
        self._most = 0  # the most threads that held a pool at once: no more pools than that are kept

    @property
    def pools(self) -> dict[threading.Thread, httpx.HTTPTransport]:
        """Each calling thread's pool, as last counted (a copy): threads that ended keep theirs until the next new
        caller moves it to ``idle``."""
        with self._lock:
            return dict(self._pools)

    @property
    def idle(self) -> list[httpx.HTTPTransport]:
        """The pools of threads that ended, kept for the next ones (a copy)."""
        with self._lock:
            return list(self._idle)

    @property
    def most(self) -> int:
        """The most threads that held a pool at once: no more pools than that are kept."""
        return self._most

    def _own(self) -> httpx.HTTPTransport:
        pool: httpx.HTTPTransport | None = getattr(self._local, "pool", None)
        if pool is None:
            with self._lock:
                # Keyed by the thread itself, not its ident (reused once a thread ends), and judged under the
                # lock: a list of live threads taken before it missed a thread that started and filed its pool
                # meanwhile, and handed that pool on under its first call. A thread that threading did not start
                # (a "dummy" thread) counts as alive for good: its pool is closed only with the transport.
                ended = [thread for thread in self._pools if not thread.is_alive()]
                self._idle.extend(self._pools.pop(thread) for thread in ended)
                pool = self._idle.pop() if self._idle else None
                if pool is None:
                    pool = httpx.HTTPTransport(verify=self._tls, limits=self._limits, socket_options=ABORT_ON_CLOSE)
                self._pools[threading.current_thread()] = pool
                self._most = max(self._most, len(self._pools))
                surplus = self._idle[self._most :]  # never more pools than threads ever held at once
                del self._idle[self._most :]
            self._local.pool = pool
            for spare in surplus:
                spare.close()
        return pool

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._own().handle_request(request)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()) + self._idle, {}
            self._idle = []
        for pool in pools:
            pool.close()


class _SetCookieOnly(httpx.Cookies):
    """A cookie store that reads a response only when it sets a cookie.

    httpx hands every response to its cookie store, which builds urllib request and response stand-ins and
    copies their headers before the standard library finds no ``Set-Cookie`` there: a measurable share of a
    worker's Python time (docs/performance.md) for services (the Store, WebShop, an LLM server) that set none. A
    response that does set one (e.g. a load balancer's sticky-session cookie in front of an LLM gateway) is read
    by httpx's own cookie handling, and the cookie goes back with the next request.
    """

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers:
            super().extract_cookies(response)


class HTTPClient(httpx.Client):
    """``httpx.Client`` whose cookie store skips responses that set no cookie (``_SetCookieOnly``); every
    client this project builds for a service is one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cookies = super().cookies.jar  # the jar itself, as httpx keeps one it is given

    @property
    def cookies(self) -> httpx.Cookies:
        return self._set_cookie_only

    @cookies.setter
    def cookies(self, cookies: Any) -> None:  # whatever httpx.Cookies accepts
        self._set_cookie_only = _SetCookieOnly(cookies)


def _limits(max_connections: int) -> httpx.Limits:
    return httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=KEEPALIVE_S
    )


def pooled_transport(max_connections: int) -> PerThreadTransport:
    """Per-thread pools, for the LLM: each of a worker's threads keeps a call open most of the time, so a shared
    pool would hold a connection per thread and walk them all on every request (``PerThreadTransport``)."""
    return PerThreadTransport(_limits(max_connections))


def shared_transport(max_connections: int) -> httpx.HTTPTransport:
    """One pool for every thread, for the services a thread calls now and then (the Store, WebShop).

    A thread of a ``-P threads`` worker calls the Store about twice per episode and WebShop once per LLM call:
    with a pool of its own, the connection had expired by its next call (``KEEPALIVE_S``), so nearly every
    Store request and WebShop step opened a new connection, at a cost to both sides. Shared, the pool holds
    only as many connections as requests run at once, and they stay warm.
    """
    transport = httpx.HTTPTransport(
        verify=default_tls(), limits=_limits(max_connections), socket_options=ABORT_ON_CLOSE
    )
    return expiry_checked(transport)


def service_client(base_url: str, *, token: str | None, timeout_s: float, max_connections: int) -> httpx.Client:
    """A client with one connection pool (``shared_transport``) and an optional bearer token (for services
    behind an authenticating proxy).

    The connect timeout is short and separate: a service that is down should fail fast into the caller's
    retry policy, while a slow answer may take the whole ``timeout_s``.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return HTTPClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
        transport=shared_transport(max_connections),
    )


def retry_after_s(
    response: httpx.Response | None, *, with_ms: bool = False, cap_s: float | None = None
) -> float | None:
    """The wait a throttled service asked for, in seconds, or None when it named none we can read.

    ``with_ms`` also honours ``retry-after-ms`` (OpenAI-compatible servers send it, and it wins over the
    coarser ``retry-after``). A negative value means no wait; ``cap_s`` bounds a server that asks too much.
    Only the delta-seconds form is read: an HTTP-date is treated as absent, so the caller's backoff applies.
    """
    if response is None:
        return None
    for name in ("retry-after-ms", "retry-after") if with_ms else ("retry-after",):
        value = response.headers.get(name)
        if value is None:
            continue
        try:
            seconds = max(0.0, float(value) / (1000.0 if name == "retry-after-ms" else 1.0))
        except ValueError:
            continue
        return seconds if cap_s is None else min(cap_s, seconds)
    return None
