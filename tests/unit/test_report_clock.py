"""Clock skew between a worker host and the Store (docs/store-protocol.md): measured at start, corrected, bounded.

A real loopback HTTP server plays the Store's ``/health`` with a ``Date`` header from a clock that is off by
a known amount, the way uvicorn writes it (whole seconds).
"""

from __future__ import annotations

import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from pydantic import HttpUrl

from bridge.core.settings import Settings
from workers.protocol import clock


class SkewedStore:
    """Answers every GET with 200 and a Date header ``skew_s`` seconds off this host's clock."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b'{"status":"ok"}'
                self.send_response_only(200)
                self.send_header("Date", formatdate(time.time() + store.skew_s, usegmt=True))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize("skew_s", [0.0, 3.4, -7.8, 120.0])
def test_the_measured_offset_brackets_the_true_skew_within_about_a_second(skew_s: float) -> None:
    store = SkewedStore(skew_s)
    try:
        with httpx.Client(base_url=store.url) as client:
            reading = clock.measure(client)
    finally:
        store.close()
    assert reading is not None
    assert abs(reading.offset_s - skew_s) <= reading.error_s + 0.05
    assert reading.error_s <= 1.1


def test_a_worker_within_the_tolerance_adopts_the_offset_and_corrects_store_times() -> None:
    store = SkewedStore(3.0)
    try:
        reading = clock.check_store_clock(Settings(store_url=HttpUrl(store.url), clock_skew_tolerance_s=5.0))
    finally:
        store.close()
    assert reading is not None
    assert clock.store_offset_s() == reading.offset_s
    stamped = time.time() + 3.0  # "now" on the Store's clock
    assert abs(clock.to_local(stamped) - time.time()) <= reading.error_s + 0.1


def test_a_worker_refuses_to_start_beyond_the_tolerance() -> None:
    store = SkewedStore(-30.0)
    try:
        with pytest.raises(SystemExit) as exited:
            clock.check_store_clock(Settings(store_url=HttpUrl(store.url), clock_skew_tolerance_s=5.0))
        assert exited.value.code == clock.EXIT_CODE
        # 0 turns the check off: the offset is adopted and corrected for instead.
        reading = clock.check_store_clock(Settings(store_url=HttpUrl(store.url), clock_skew_tolerance_s=0))
    finally:
        store.close()
    assert reading is not None and abs(clock.store_offset_s() + 30.0) <= reading.error_s + 0.05


def test_an_unreachable_store_does_not_stop_a_worker() -> None:
    settings = Settings(store_url=HttpUrl("http://127.0.0.1:9"), clock_skew_tolerance_s=5.0)
    assert clock.check_store_clock(settings) is None
    assert clock.store_offset_s() == 0.0
