"""The attempt relay: how a 1.0 agent program reaches the gateway without holding its key (docs/agl-v1.md,
"Trust model").

A program gets ``AGL_OPENAI_BASE_URL``, ``AGL_EVENT_URL`` and ``AGL_KEY`` as 1.0 promises them, but the URLs name
this worker process's relay and the key is a token minted for its attempt alone. The relay forwards, with the
gateway's key, only what that attempt is owed; whatever else the program asks for never reaches the gateway.

Contract:

* one relay per worker process that runs programs (``process_relay``), on 127.0.0.1 at a free port, started on
  first use; ``grant`` mints a random token bound to one attempt's routes, ``Grant.revoke`` ends it at the
  attempt's end: every later call with it is refused;
* forwarded, with the gateway's key in place of the token (``Authorization: Bearer`` or ``x-api-key``, as the
  gateway reads either): ``POST`` of the attempt's own model-proxy routes (``.../openai/v1/chat/completions`` and
  ``.../completions`` under its rollout, attempt and mode) and ``POST`` of its own events route. The answer comes
  back as the gateway gave it (status, headers, the body's bytes as they arrive: a paused proxy's 429 and its
  ``Retry-After`` unchanged);
* refused with 403, a fixed text and ``agl_worker_relay_refused_total{reason}``: no token or an unknown, revoked
  one (``token``), any other path or method (``route``): listing, reading, creating, patching or deleting
  rollouts, another attempt's events or proxy, pausing the proxy, the model servers. A body over
  ``MAX_BODY_BYTES`` answers 413, a connection past ``MAX_CONNECTIONS`` 503; neither reaches the gateway;
* nothing the relay answers holds the gateway's key: its own answers are fixed texts, and the gateway's
  answers are to requests that carried no token of another attempt.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

from bridge.core.gateway import V1Rollout, agent_environment
from bridge.core.infra import KEEPALIVE_S, ConfigError, default_tls
from workers.lifecycle import metrics, state

log = logging.getLogger("workers.v1.relay")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a chat completion's request, a long conversation included
MAX_CONNECTIONS = 256  # open connections at once per relay; the rest answer 503 at once
IDLE_S = 60.0  # a connection that sends nothing this long is closed (a kept-alive client reconnects)
READ_S = 900.0  # to the gateway, each wait for bytes; a model call may take minutes, the program's timeout ends it
READ_BYTES = 64 * 1024
# Never forwarded either way: hop-by-hop headers, and the credentials the relay replaces.
_DROPPED = frozenset(
    {
        "authorization",
        "x-api-key",
        "host",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)


@dataclass
class Grant:
    """One attempt's token and the routes it opens; ``env`` is what the program gets for them."""

    token: str
    routes: frozenset[str]
    env: dict[str, str]
    relay: AttemptRelay = field(repr=False)

    def revoke(self) -> None:
        """End the token: every later call with it is refused (safe to repeat)."""
        self.relay.revoke(self.token)


class AttemptRelay:
    """One process's relay: ``grant`` / ``revoke`` tokens, forward what a live token is owed (module contract)."""

    def __init__(self, gateway_url: str, key: str | None, *, host: str = "127.0.0.1") -> None:
        self.gateway_url, self._key = gateway_url.rstrip("/"), key or ""
        self._grants: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self._target = urlsplit(self.gateway_url)
        if self._target.scheme not in ("http", "https") or not self._target.hostname:
            raise ConfigError(f"AGL_V1_SERVER_URL {gateway_url!r} is not an http(s) URL", setting="AGL_V1_SERVER_URL")
        self._server = _Server((host, 0), self)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="agl-v1-relay", daemon=True
        )
        self._thread.start()

    def grant(self, rollout: V1Rollout, attempt_id: str) -> Grant:
        """A new token for ``attempt_id`` of ``rollout``: its 1.0 variables name this relay and carry the token."""
        token = secrets.token_urlsafe(32)
        env = agent_environment(rollout, attempt_id, agent_url=self.url, key=token)
        proxy = env["AGL_OPENAI_BASE_URL"].removeprefix(self.url)
        routes = frozenset(
            {f"{proxy}/chat/completions", f"{proxy}/completions", env["AGL_EVENT_URL"].removeprefix(self.url)}
        )
        with self._lock:
            self._grants[token] = routes
        return Grant(token, routes, env, self)

    def revoke(self, token: str) -> None:
        with self._lock:
            self._grants.pop(token, None)

    @property
    def live(self) -> int:
        """Tokens not yet revoked."""
        with self._lock:
            return len(self._grants)

    def refusal(self, method: str, path: str, headers: Any) -> str | None:
        """Why a request may not pass (``token`` or ``route``), or None when it may."""
        auth = headers.get("authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else headers.get("x-api-key", "")
        with self._lock:
            routes = self._grants.get(token) if token else None
        if routes is None:
            return "token"
        if method != "POST" or path.partition("?")[0] not in routes:
            return "route"
        return None

    def upstream(self) -> Upstream:
        """A new connection to the gateway, for one program connection's requests in turn."""
        return Upstream(self._target)

    def forward(self, handler: _Handler, body: bytes) -> None:
        """Send the request to the gateway with its key and stream the answer back unchanged."""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _DROPPED}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        upstream = handler.upstream()
        try:
            response = upstream.send(handler.command, self._target.path + handler.path, headers, body)
        except (OSError, http.client.HTTPException) as exc:
            upstream.close()
            log.warning("the gateway did not answer a program's %s: %s", handler.command, type(exc).__name__)
            handler.answer(502, "the gateway did not answer\n")
            return
        try:
            handler.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _DROPPED:
                    handler.send_header(name, value)
            length = response.getheader("content-length") or ""
            framed = not length.isdigit()
            if framed:
                handler.send_header("Transfer-Encoding", "chunked")
            else:
                handler.send_header("Content-Length", length)
            handler.end_headers()
            while chunk := response.read1(READ_BYTES):  # as each part arrives
                handler.wfile.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if framed else chunk)
            if framed:
                handler.wfile.write(b"0\r\n\r\n")
            upstream.done(response)
        except (OSError, http.client.HTTPException):
            upstream.close()
            handler.close_connection = True  # the answer was cut: the program's client sees a broken response

    def close(self) -> None:
        """Stop serving and drop every token."""
        with self._lock:
            self._grants.clear()
        self._server.shutdown()
        self._server.server_close()


class Upstream:
    """One kept-alive connection to the gateway (``http.client``: a few parsing steps per request where a pooled
    client costs milliseconds), opened afresh when it sat idle past ``KEEPALIVE_S``: the gateway may have closed
    it meanwhile, and a request sent on a closed connection cannot be told apart from one the gateway took."""

    def __init__(self, target: SplitResult) -> None:
        self._target = target
        self._connection: http.client.HTTPConnection | None = None
        self._idle_since = 0.0

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes) -> http.client.HTTPResponse:
        if self._connection is not None and time.monotonic() - self._idle_since > KEEPALIVE_S:
            self.close()
        if self._connection is None:
            self._connection = _connection(self._target)
        self._connection.request(method, path, body=body, headers=headers)
        return self._connection.getresponse()

    def done(self, response: http.client.HTTPResponse) -> None:
        """The answer was read whole: keep the connection unless the gateway is closing it."""
        response.close()  # the connection takes the next request only once its answer is closed
        if response.will_close:
            self.close()
        self._idle_since = time.monotonic()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _connection(target: SplitResult) -> http.client.HTTPConnection:
    timeout = READ_S  # each wait for bytes: a model call may take minutes, the program's timeout ends it
    if target.scheme == "https":
        return http.client.HTTPSConnection(target.hostname or "", target.port, timeout=timeout, context=default_tls())
    connection = http.client.HTTPConnection(target.hostname or "", target.port, timeout=timeout)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], relay: AttemptRelay) -> None:
        self.relay = relay
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            metrics.relay_refused("connections")
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A program that drops its connection mid-request is its own business: no traceback in the worker's log."""
        log.debug("a program's connection to the relay failed", exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S
    server: _Server
    _upstream: Upstream | None = None

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body in separate writes

    def upstream(self) -> Upstream:
        """This program connection's connection to the gateway, opened on first use."""
        if self._upstream is None:
            self._upstream = self.server.relay.upstream()
        return self._upstream

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._upstream is not None:
                self._upstream.close()

    def _handle(self) -> None:
        relay = self.server.relay
        why = relay.refusal(self.command, self.path, self.headers)
        length = self.headers.get("content-length")
        if self.headers.get("transfer-encoding") or (length is not None and not length.isdigit()):
            self.answer(400, "a body needs a Content-Length\n", close=True)
            return
        size = int(length or 0)
        if size > MAX_BODY_BYTES:
            self.answer(413, "request body too large\n", close=True)
            return
        body = self.rfile.read(size) if size else b""
        if why is not None:
            metrics.relay_refused(why)
            self.answer(403, "refused: this token is not for that\n")
            return
        relay.forward(self, body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

    def answer(self, status: int, text: str, *, close: bool = False) -> None:
        data = text.encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a refused request is counted, and a program's calls are not the worker's log."""


def process_relay(gateway_url: str, key: str | None) -> AttemptRelay:
    """This process's relay, started on first use; a forked child (its parent's relay thread is not in it) and
    a process told of another gateway start their own."""
    process = state.process
    with process.relay_lock:
        held = process.relay
        if held is None or held[0] != os.getpid() or held[1].gateway_url != gateway_url.rstrip("/"):
            held = process.relay = (os.getpid(), AttemptRelay(gateway_url, key))
        return held[1]
