"""An LLM call never outlives the attempt's budget: each try is capped at the time left, retries stop at
the deadline, and a stop check (cancelled, superseded) ends a back-off at once.

Real sockets: a server that accepts and never answers, and one that answers 503 to everything."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bridge.core.infra import Superseded
from tests.helpers import silent_llm_url
from workers.agents import llm as llm_mod
from workers.protocol.failures import FailureClass, classify

MESSAGES = [{"role": "user", "content": "buy a lamp"}]


@pytest.fixture
def silent_url() -> Iterator[str]:
    with silent_llm_url() as url:
        yield url


class _Unavailable(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": {"message": "overloaded"}}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _call(url: str, *, deadline: float, check_stop: Callable[[], None] | None = None) -> llm_mod.ChatResult:
    """The worker's defaults: LLM_TIMEOUT_S 120 s, LLM_RETRIES 6, LLM_MAX_BACKOFF_S 30 s."""
    target = llm_mod.LLMTarget(url, "m", "EMPTY")
    client = llm_mod.make_client(target, 120.0)
    return llm_mod.chat(
        client,
        target,
        MESSAGES,
        retries=6,
        max_backoff_s=30.0,
        timeout_s=120.0,
        deadline=deadline,
        check_stop=check_stop,
    )


def test_a_hanging_llm_is_cut_at_the_deadline(silent_url: str) -> None:
    """LLM_TIMEOUT_S is 120 s and 6 retries remain, but the budget ends in 1.5 s."""
    started = time.time()
    with pytest.raises(TimeoutError) as raised:
        _call(silent_url, deadline=started + 1.5)
    elapsed = time.time() - started
    assert elapsed < 2.5, f"the call took {elapsed:.1f} s past a 1.5 s budget"
    assert classify(raised.value) is FailureClass.TIMEOUT


def test_retries_stop_before_a_back_off_would_pass_the_deadline(unavailable_url: str) -> None:
    started = time.time()
    with pytest.raises(TimeoutError, match="503"):
        _call(unavailable_url, deadline=started + 2.0)
    assert time.time() - started < 2.5


def test_a_stopped_attempt_leaves_the_back_off_at_once(unavailable_url: str) -> None:
    stop_at = time.monotonic() + 0.3

    def check_stop() -> None:
        if time.monotonic() > stop_at:
            raise Superseded("rollout is cancelled")

    started = time.monotonic()
    with pytest.raises(Superseded):
        _call(unavailable_url, check_stop=check_stop, deadline=time.time() + 60)
    assert time.monotonic() - started < 1.5  # not the 1-30 s back-offs of the remaining retries


def test_without_a_deadline_the_retries_run_as_configured(unavailable_url: str) -> None:
    target = llm_mod.LLMTarget(unavailable_url, "m", "EMPTY")
    client = llm_mod.make_client(target, 120.0)
    with pytest.raises(llm_mod.LLMError, match="after 2 tries"):
        llm_mod.chat(client, target, MESSAGES, retries=1, max_backoff_s=0.1)
