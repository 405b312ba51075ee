"""A Store stand-in for unit tests: a real HTTP endpoint on 127.0.0.1 that answers 503 and records requests.

Used where a test must show what a worker sends (or that it sends nothing) without a real Store.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients reset connections on purpose (SO_LINGER 0 on timeouts): not worth a traceback


class RecordingStore:
    """Answers every GET and POST with 503 after ``delay_s`` and keeps each request's path, in order."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.paths: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real Store answers

            def _answer(self) -> None:
                owner.paths.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                time.sleep(delay_s)
                try:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the client timed out first

            do_GET = do_POST = _answer

            def log_message(self, *_: object) -> None:
                pass

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
