"""The LLM stand-in's OpenAI-compatible HTTP server (``python -m webshop_env.policy``) as a real process.

Its WebShop rules on their own are tested in tests/unit/test_llm_stand_in.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bridge_lab.procs import PYTHON, free_port, serving
from webshop_env.policy import STANDIN_MODEL

INSTRUCTION = "i need a 120 ml hair mask treatment, and price lower than 130.00 dollars"
SEARCH_PAGE = f"WebShop [SEP] Instruction: [SEP] {INSTRUCTION} [SEP] Search"


@contextlib.contextmanager
def stand_in(log_dir: Path, *extra: str) -> Iterator[str]:
    """``python -m webshop_env.policy`` on a free port, entered once /health answers (at most 20 s)."""
    base = f"http://127.0.0.1:{free_port()}"
    argv = [PYTHON, "-m", "webshop_env.policy", "--port", base.rsplit(":", 1)[1], *extra]
    with serving("llm-stand-in", argv, f"{base}/health", timeout_s=20, log_dir=log_dir):
        yield base


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with stand_in(tmp_path_factory.mktemp("llm-stand-in")) as base:
        yield base


def chat_messages() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a shopping agent."},
        {"role": "user", "content": f"Step 1 of 15\nObservation: {SEARCH_PAGE}"},
    ]


def test_openai_client_gets_parsable_action_and_usage(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="anything", messages=chat_messages())  # type: ignore[arg-type]
    assert reply.model == STANDIN_MODEL
    content = reply.choices[0].message.content or ""
    assert content.splitlines()[-1] == "Action: search[120 ml hair mask treatment]"
    assert content.startswith("Thought: ")
    assert reply.usage is not None and reply.usage.total_tokens > reply.usage.completion_tokens > 0
    plain = httpx.post(f"{server}/v1/chat/completions", json={"messages": chat_messages()}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]  # vLLM: only when asked
    asked = {"messages": chat_messages(), "return_token_ids": True}
    raw = httpx.post(f"{server}/v1/chat/completions", json=asked).json()
    assert len(raw["prompt_token_ids"]) == raw["usage"]["prompt_tokens"]
    assert len(raw["choices"][0]["token_ids"]) == raw["usage"]["completion_tokens"]


def test_any_path_prefix_and_models_and_bad_input(server: str) -> None:
    url = f"{server}/rollout/ro-1/attempt/at-2/v1/chat/completions"
    assert httpx.post(url, json={"messages": chat_messages()}).status_code == 200
    assert httpx.post(f"{server}/chat/completions", json={"messages": chat_messages()}).status_code == 200
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == STANDIN_MODEL
    bad = httpx.post(f"{server}/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and "error" in bad.json()
    assert httpx.post(f"{server}/v1/chat/completions", json={"messages": []}).status_code == 400
    assert httpx.post(f"{server}/v1/chat/completions", json=[1]).status_code == 400


def test_error_rate_one_gives_429_with_retry_after_or_500(tmp_path: Path) -> None:
    with stand_in(tmp_path, "--error-rate", "1.0", "--seed", "7") as base:
        statuses = []
        for _ in range(20):
            resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": chat_messages()})
            statuses.append(resp.status_code)
            assert "error" in resp.json()
            if resp.status_code == 429:
                assert resp.headers["Retry-After"] == "1"
        assert set(statuses) == {429, 500}


def test_latency_knob_delays_without_serialising(tmp_path: Path) -> None:
    with stand_in(tmp_path, "--latency-ms", "300") as base:
        started = time.monotonic()
        httpx.post(f"{base}/v1/chat/completions", json={"messages": chat_messages()})
        assert time.monotonic() - started >= 0.3
        with httpx.Client(limits=httpx.Limits(max_connections=50)) as client:
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                codes = list(
                    pool.map(
                        lambda _: (
                            client.post(f"{base}/v1/chat/completions", json={"messages": chat_messages()}).status_code
                        ),
                        range(20),
                    )
                )
            assert codes == [200] * 20
            assert time.monotonic() - started < 2.0  # 20 x 300 ms would be 6 s if serialised
