"""A paused Agent Lightning 1.0 gateway costs time, never the rollout (``workers.agents.gateway_llm``, and the 0.3
worker's ``workers.agents.llm.chat``): against a loopback server that answers as 1.0's paused proxy does (429,
``Retry-After``, ``X-Agl-Paused: true``, a JSON reason) for its first requests, then as an LLM."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bridge.core.infra import LLMPaused
from tests.loopback import LoopbackServer
from workers.agents import llm as llm_mod
from workers.agents.gateway_llm import MAX_WAIT_S, openai_client, pause_reason, paused_wait_s
from workers.protocol.failures import FailureClass, classify

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "search[lamp]"}, "finish_reason": "stop"}],
}


class PausedGateway(LoopbackServer):
    """Paused for its first ``paused_for`` requests (``None``: always), each answered with ``retry_after``; a plain
    rate limit instead of a pause with ``plain``. Keeps every request's body."""

    def __init__(self, paused_for: int | None, *, retry_after: str = "0.1", plain: bool = False) -> None:
        self.paused_for, self.retry_after, self.plain = paused_for, retry_after, plain
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()
        super().__init__(lambda method, path: (500, {}, b""))

    def respond(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.bodies.append(body)
            count = len(self.bodies)
        if self.paused_for is None or count <= self.paused_for:
            headers = {"Retry-After": self.retry_after, "Content-Type": "application/json"}
            if not self.plain:
                headers["X-Agl-Paused"] = "true"
            return 429, headers, json.dumps({"error": "gateway paused", "reason": "weight update"}).encode()
        return 200, {"Content-Type": "application/json"}, json.dumps(COMPLETION).encode()


@pytest.fixture
def gateway_paused_for_five() -> Iterator[PausedGateway]:
    server = PausedGateway(5)
    yield server
    server.close()


def _ask(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "buy a lamp"}])
    return reply.choices[0].message.content or ""


def test_a_pause_longer_than_the_sdks_retries_fails_a_plain_client(gateway_paused_for_five: PausedGateway) -> None:
    """What every 1.0 program on the plain SDK does: three tries, then RateLimitError (the program exits 1)."""
    plain = openai.OpenAI(base_url=f"{gateway_paused_for_five.url}/v1", api_key="k", max_retries=2)
    with pytest.raises(openai.RateLimitError):
        _ask(plain)
    assert len(gateway_paused_for_five.bodies) == 3


def test_the_programs_client_waits_out_the_pause_and_sends_the_same_request(
    gateway_paused_for_five: PausedGateway,
) -> None:
    client = openai_client(base_url=f"{gateway_paused_for_five.url}/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    assert _ask(client) == "search[lamp]"
    assert len(gateway_paused_for_five.bodies) == 6
    assert len(set(gateway_paused_for_five.bodies)) == 1  # the body is sent again unchanged
    assert time.monotonic() - started >= 5 * 0.1  # Retry-After honoured between the tries


def test_a_plain_rate_limit_is_left_to_the_sdk() -> None:
    server = PausedGateway(None, plain=True)
    try:
        client = openai_client(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            _ask(client)
        assert len(server.bodies) == 1
    finally:
        server.close()


def test_the_wait_ends_at_the_programs_deadline() -> None:
    server = PausedGateway(None, retry_after="0.2")
    try:
        client = openai_client(base_url=f"{server.url}/v1", api_key="k", max_retries=0, deadline=time.time() + 1.0)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError):
            _ask(client)
        assert time.monotonic() - started < 1.5
    finally:
        server.close()


def test_the_client_reads_the_programs_environment(
    monkeypatch: pytest.MonkeyPatch, gateway_paused_for_five: PausedGateway
) -> None:
    monkeypatch.setenv("AGL_OPENAI_BASE_URL", f"{gateway_paused_for_five.url}/v1")
    monkeypatch.setenv("AGL_KEY", "the-key")
    client = openai_client(max_retries=0)
    assert client.api_key == "the-key" and str(client.base_url).startswith(gateway_paused_for_five.url)
    assert _ask(client) == "search[lamp]"


def test_what_counts_as_a_pause() -> None:
    def answer(status: int, **headers: str) -> httpx.Response:
        return httpx.Response(status, headers=headers, json={"error": "gateway paused", "reason": "step 7"})

    assert paused_wait_s(answer(429, **{"X-Agl-Paused": "true", "Retry-After": "5"})) == 5.0
    assert paused_wait_s(answer(429, **{"x-agl-paused": "True"})) == 5.0  # 1.0's default when none is named
    assert paused_wait_s(answer(429, **{"X-Agl-Paused": "true", "Retry-After": "600"})) == MAX_WAIT_S
    assert paused_wait_s(answer(429, **{"Retry-After": "5"})) is None  # rate limited, not paused
    assert paused_wait_s(answer(503, **{"X-Agl-Paused": "true"})) is None
    assert pause_reason(answer(429)) == "step 7"
    assert pause_reason(httpx.Response(429, text="not json")) == ""


# --- the 0.3 worker's own LLM call ----------------------------------------------------------------


def _chat(
    url: str, *, retries: int, deadline: float | None, check_stop: Callable[[], None] | None = None
) -> llm_mod.ChatResult:
    target = llm_mod.LLMTarget(f"{url}/v1", "m", "EMPTY")
    return llm_mod.chat(
        llm_mod.make_client(target, 30.0),
        target,
        [{"role": "user", "content": "x"}],
        retries=retries,
        max_backoff_s=1.0,
        deadline=deadline,
        check_stop=check_stop,
    )


def test_the_workers_llm_call_waits_out_a_pause_without_spending_its_retries(
    gateway_paused_for_five: PausedGateway,
) -> None:
    result = _chat(gateway_paused_for_five.url, retries=1, deadline=time.time() + 30)
    assert result.content == "search[lamp]"
    assert (result.retries, result.rate_limited) == (0, 0)
    assert len(gateway_paused_for_five.bodies) == 6


def test_a_pause_that_outlasts_the_attempt_is_infra_never_llm_or_timeout() -> None:
    server = PausedGateway(None, retry_after="0.2")
    try:
        started = time.monotonic()
        with pytest.raises(LLMPaused) as raised:
            _chat(server.url, retries=6, deadline=time.time() + 1.0)
        assert time.monotonic() - started < 1.5
        assert classify(raised.value) is FailureClass.INFRA
    finally:
        server.close()


def test_a_wait_for_the_pause_that_overshoots_the_deadline_is_still_the_pause() -> None:
    """A starved process wakes from its wait for the gateway past the attempt's deadline: the pause's (infra),
    not a timeout of the rollout's."""
    server = PausedGateway(None, retry_after="0.2")
    checks = 0

    def starved_once_waiting() -> None:  # the stop check, run before the call and then within the wait
        nonlocal checks
        checks += 1
        if checks == 2:
            time.sleep(1.2)  # the process gets no CPU until well past the deadline

    try:
        with pytest.raises(LLMPaused) as raised:
            _chat(server.url, retries=6, deadline=time.time() + 1.0, check_stop=starved_once_waiting)
        assert classify(raised.value) is FailureClass.INFRA and len(server.bodies) == 1
    finally:
        server.close()


def test_the_docs_example_program_waits_out_a_pause(
    monkeypatch: pytest.MonkeyPatch, gateway_paused_for_five: PausedGateway
) -> None:
    """The program of docs/agl-v1.md, "A paused gateway", run as written against a paused proxy."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agl-v1.md").read_text()
    section = text.split("### A paused gateway", 1)[1].split("\n### ", 1)[0]
    source = section.split("```python\n", 1)[1].split("```", 1)[0]
    program = textwrap.dedent(source)
    monkeypatch.setenv("AGL_OPENAI_BASE_URL", f"{gateway_paused_for_five.url}/v1")
    monkeypatch.setenv("AGL_KEY", "k")
    namespace: dict[str, object] = {}
    exec(compile(program, "docs/agl-v1.md", "exec"), namespace)
    agent = namespace["MyAgent"]
    assert isinstance(agent, type)
    agent().run()
    assert len(gateway_paused_for_five.bodies) == 6  # five paused answers, then the completion
