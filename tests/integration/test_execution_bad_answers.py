"""Bad answers from the environment and the LLM end cleanly, and the worker carries on.

A tiny misbehaving server (``app`` below, run by uvicorn in a subprocess on loopback) plays both the
WebShop server and the OpenAI-compatible LLM. A marker word in the rollout's instruction picks how it
misbehaves: WebShop answers that are not JSON, lack fields, are not objects or carry a non-finite reward
(or reward info); LLM answers with no choices, an empty message, a multi-megabyte message, or a body that
is not JSON. Without a marker it is a well-behaved one-product shop whose LLM buys at once (reward 1.0),
which proves the worker still works after every bad rollout. Real bridge, real Celery worker, real Store;
each bad rollout must end with a clear, classified error in the attempt metadata (or a bounded retry),
never a hang or a dead worker.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from bridge_lab.procs import ManagedProcess, free_port, http_ok
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import attempts, cancel_unfinished, enqueue, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(9)]

HUGE_CHARS = 4_000_000
MAX_STEPS = 3
MAX_REPROMPTS = 1

# --- the misbehaving server ----------------------------------------------------------------------

_sessions: dict[str, str] = {}  # session id -> marker of the instruction that opened it
_MARKER = re.compile(r"\b(webshop|llm)-[a-z]+\b")


def _marker(text: str) -> str:
    found = _MARKER.search(text)
    return found.group(0) if found else ""


async def _reset(request: Request) -> Response:
    body = json.loads(await request.body() or b"{}")
    marker = _marker(str(body.get("instruction", "")))
    if marker == "webshop-html":
        return PlainTextResponse("<html><body>502 Bad Gateway (but 200)</body></html>", media_type="text/html")
    if marker == "webshop-nofields":
        return JSONResponse({"ok": True})
    sid = uuid.uuid4().hex
    _sessions[sid] = marker
    page = f"Instruction: [SEP] {body.get('instruction')} [SEP] Product B000000001 [SEP] Buy Now"
    return JSONResponse({"session_id": sid, "observation": page, "done": False, "reward": 0.0, "info": {}})


async def _step(request: Request) -> Response:
    body = json.loads(await request.body() or b"{}")
    sid = str(body.get("session_id"))
    if _sessions.get(sid) == "webshop-steplist":
        return JSONResponse(["not", "an", "object"])
    done = "buy now" in str(body.get("action", "")).lower()
    page = "Thank you for shopping with us!" if done else "Product B000000001 [SEP] Buy Now"
    if done and _sessions.get(sid) in ("webshop-nanreward", "webshop-naninfo"):
        # Python's json reads NaN and Infinity (httpx too); Starlette's JSONResponse refuses to write them.
        bad = (
            '"reward": NaN'
            if _sessions[sid] == "webshop-nanreward"
            else '"reward": 1.0, "info": {"reward_info": {"r_price": Infinity}}'
        )
        text = f'{{"session_id": "{sid}", "observation": "{page}", "done": true, {bad}}}'
        return Response(text.encode(), media_type="application/json")
    return JSONResponse({"session_id": sid, "observation": page, "done": done, "reward": 1.0 if done else 0.0})


async def _chat(request: Request) -> Response:
    body = json.loads(await request.body() or b"{}")
    marker = _marker(json.dumps(body.get("messages", [])))
    reply = "Thought: the page has it.\nAction: click[Buy Now]"
    if marker == "llm-notjson":
        return Response(b'{"id": "chatcmpl-1", "choices": [ this is not json', media_type="application/json")
    if marker == "llm-html":
        return PlainTextResponse("<html>upstream gone</html>", media_type="text/html")
    if marker == "llm-nochoices":
        return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": []})
    if marker == "llm-empty":
        reply = ""
    if marker == "llm-huge":
        reply = "Thought: " + "very " * (HUGE_CHARS // 5) + "\nAction: click[Buy Now]"
    choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
    return JSONResponse(
        {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake", "choices": [choice]}
    )


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


app = Starlette(
    routes=[
        Route("/reset", _reset, methods=["POST"]),
        Route("/step", _step, methods=["POST"]),
        Route("/sessions/{sid}", lambda request: JSONResponse({}), methods=["DELETE"]),
        Route("/v1/chat/completions", _chat, methods=["POST"]),
        Route("/health", _health, methods=["GET"]),
    ]
)

# --- the test ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "uvicorn", f"{__name__}:app", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "warning"]
    server = ManagedProcess(
        "misbehaving", argv, tmp_path_factory.mktemp("misbehaving") / "server.log", lambda: http_ok(f"{url}/health")
    )
    server.start()
    try:
        server.wait_healthy()
        yield url
    finally:
        server.stop()


CASES: dict[str, tuple[str, str]] = {
    # marker: (failure class, a phrase the error must contain)
    "webshop-html": ("env", "non-JSON"),
    "webshop-nofields": ("env", "lacks observation"),
    "webshop-steplist": ("env", "expected an object"),
    "webshop-nanreward": ("env", "non-finite reward (nan)"),
    "webshop-naninfo": ("env", "metadata.reward_info.r_price is inf, not a finite number"),
    "llm-nochoices": ("llm", "no choices"),
    "llm-notjson": ("llm", "not valid JSON"),
    "llm-html": ("llm", "non-JSON content"),
}


def test_bad_environment_and_llm_answers_end_cleanly_and_the_worker_carries_on(
    services: LocalStack, clean_store: LocalStack, misbehaving: str, tmp_path: Path
) -> None:
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=misbehaving,
            llm_base_url=f"{misbehaving}/v1",
            workers=1,
            concurrency=2,
            log_dir=tmp_path,
            extra_env={
                "MAX_STEPS": str(MAX_STEPS),
                "MAX_REPROMPTS": str(MAX_REPROMPTS),
                "LLM_RETRIES": "1",
                "LLM_MAX_BACKOFF_S": "0.5",
                "WEBSHOP_RETRIES": "1",
                "LLM_RETURN_TOKEN_IDS": "false",
            },
        )
    )
    markers = [*CASES, "llm-empty", "llm-huge"]
    inputs: list[Any] = [{"instruction": f"buy a lamp {m}"} for m in markers]
    inputs += [{"instruction": f"buy a lamp, good run {i}"} for i in range(3)]  # after the bad ones
    with stack:
        ids = enqueue(services.store_url, inputs, config={"max_attempts": 1, "timeout_seconds": 120})
        final = wait_finished(services.store_url, ids, timeout_s=150)
        by_marker = dict(zip(markers, ids[: len(markers)], strict=True))
        meta = {m: (attempts(services.store_url, rid)[-1].get("metadata") or {}) for m, rid in by_marker.items()}
        status = {m: final[rid]["status"] for m, rid in by_marker.items()}
        good = [final[rid] for rid in ids[len(markers) :]]
        worker_alive = stack.workers[0].alive()
        worker_log = (tmp_path / "worker1.log").read_text(errors="replace")
    cancel_unfinished(services.store_url)

    for marker, (failure_class, phrase) in CASES.items():
        assert status[marker] == "failed", (marker, status[marker], meta[marker])
        assert meta[marker].get("failure_class") == failure_class, (marker, meta[marker])
        assert phrase in meta[marker].get("error", ""), (marker, meta[marker])
    # An empty answer is re-prompted a bounded number of times per step; the episode then ends unfinished
    # with the reward it earned (0), which is the policy's result to learn from, not an infrastructure fault.
    assert status["llm-empty"] == "succeeded", meta["llm-empty"]
    assert meta["llm-empty"]["reward"] == 0.0 and meta["llm-empty"]["done"] is False
    assert meta["llm-empty"]["llm_calls"] == MAX_STEPS * (MAX_REPROMPTS + 1)
    # A multi-megabyte answer is cut to its tail (where the action is) instead of being carried along.
    assert status["llm-huge"] == "succeeded", meta["llm-huge"]
    assert meta["llm-huge"]["reward"] == 1.0 and meta["llm-huge"]["llm_calls"] == 1
    assert all(r["status"] == "succeeded" for r in good), good
    assert worker_alive
    assert "Traceback" not in worker_log
