"""HTTP endpoints on 127.0.0.1 for unit tests: a real server whose answers a test decides.

``LoopbackServer`` answers each request with what its ``answer`` callable returns; ``RecordingStore`` is a
Store stand-in that answers 503 and records requests, used where a test must show what a worker sends (or
that it sends nothing) without a real Store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[str, str], tuple[int, dict[str, str], bytes]]
"""(method, path) -> (status, headers, body)."""


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients reset connections on purpose (SO_LINGER 0 on timeouts): not worth a traceback


class LoopbackServer:
    """Answers every GET and POST with ``respond(method, path, body)`` after ``delay_s``: by default
    ``answer(method, path)``, the body dropped. What the clients' connection pools did shows in ``request_ports``
    (each request's path and the client port of the connection it came on, in order) and ``open_ports`` (the
    client ports of the connections open now)."""

    def __init__(self, answer: Answer, delay_s: float = 0.0) -> None:
        self._answer = answer
        self.request_ports: list[tuple[str, int]] = []
        self.open_ports: set[int] = set()
        respond, request_ports, open_ports = self.respond, self.request_ports, self.open_ports

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real Store answers

            def setup(self) -> None:
                super().setup()
                open_ports.add(self.client_address[1])

            def finish(self) -> None:
                try:
                    super().finish()
                finally:
                    open_ports.discard(self.client_address[1])

            def _answer(self) -> None:
                request_ports.append((self.path, self.client_address[1]))
                length = int(self.headers.get("Content-Length") or 0)
                status, headers, body = respond(self.command, self.path, self.rfile.read(length) if length else b"")
                time.sleep(delay_s)
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client timed out first

            do_GET = do_POST = _answer

            def log_message(self, *_: object) -> None:
                pass

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def respond(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """What a request gets; a subclass that must see request bodies overrides this."""
        return self._answer(method, path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RecordingStore(LoopbackServer):
    """Answers every GET and POST with 503 after ``delay_s`` and keeps each request's path, in order."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.paths: list[str] = []

        def answer(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
            self.paths.append(path)
            return 503, {}, b""

        super().__init__(answer, delay_s)
