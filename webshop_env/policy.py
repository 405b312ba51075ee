"""OpenAI-compatible HTTP server that STANDS IN for an LLM playing WebShop. It is not a model.

Every `POST .../chat/completions` is answered by the rule-based heuristic (`webshop_env.heuristic`), which
reads the last WebShop observation in the conversation and the earlier assistant turns' actions, and replies
`Thought: <one line>` then `Action: <action>`. The reply's `model` is always `webshop-heuristic-standin`.
Token ids come back, as from vLLM, only when the request asks with `"return_token_ids": true`.
`--latency-ms` and `--error-rate` make it slow or failing on purpose.

Run: `python -m webshop_env.policy --host 127.0.0.1 --port 8000 [--latency-ms L] [--error-rate R] [--seed N]`.
Conversation contract, token ids and why it exists: docs/webshop-env.md section 13.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from webshop_env import needs_lab_extra

try:  # the lab extra's libraries (HTTP; rapidfuzz for the heuristic)
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from webshop_env.heuristic import DEFAULT_MAX_STEPS, Decision, decide
except ModuleNotFoundError as exc:
    if __name__ != "__main__":
        raise
    # Run as a program without them: one line naming the pip command, as every lab command does.
    print(needs_lab_extra("webshop_env.policy", "the LLM stand-in", exc), file=sys.stderr)
    raise SystemExit(1) from None

STANDIN_MODEL = "webshop-heuristic-standin"
VOCAB_SIZE = 32000
VALID_ACTIONS_RE = re.compile(
    r"^\s*(?:(?:valid|available)\s+actions|clickables?)\s*:(.*)$", re.IGNORECASE | re.MULTILINE
)
CLICK_ARG_RE = re.compile(r"click\[([^\[\]]*)\]")
# Anchors that start an observation inside a longer chat message (see the worker contract).
OBSERVATION_ANCHORS = ("WebShop [SEP] ", "Instruction: [SEP] ", "Thank you for shopping")
ACTION_RE = re.compile(r"\b(search|click)\[([^\[\]]*)\]")
STEP_OF_RE = re.compile(r"\bstep\s+\d+\s+of\s+(\d+)\b", re.IGNORECASE)

logger = logging.getLogger("webshop_env.policy")


class BadRequest(ValueError):
    """The request body cannot be read as a chat completion request."""


@dataclass(frozen=True)
class PolicySettings:
    """Knobs of the stand-in: how slow and how unreliable it pretends to be."""

    latency_ms: float = 0.0
    error_rate: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Conversation:
    """What the heuristic needs from a chat request."""

    observation: str
    previous_actions: list[str]
    clickables: set[str] | None
    pages_after: list[str]  # observation that followed each previous action ("" if none seen)
    max_steps: int


# ---------------------------------------------------------------- request reading


def extract_observation(message: str) -> str:
    """Cut the WebShop observation out of a chat message that may hold other lines around it.

    The observation starts at the last anchor (`WebShop [SEP] `, `Instruction: [SEP] `, `Thank you
    for shopping`) and runs to the end of that line: observations are single-line. Without an
    anchor, an `Observation:` line is taken as is; a message with neither (e.g. only "Invalid
    action") yields "" so the caller keeps the previous observation.
    """
    best = -1
    for anchor in OBSERVATION_ANCHORS:
        pos = message.rfind(anchor)
        if anchor == "Instruction: [SEP] " and pos >= 0:
            # "WebShop [SEP] Instruction: [SEP] ..." must keep its WebShop prefix.
            prefix = "WebShop [SEP] "
            if message[max(0, pos - len(prefix)) : pos] == prefix:
                pos -= len(prefix)
        best = max(best, pos)
    if best < 0:
        for line in message.strip().splitlines():
            if line.strip().lower().startswith("observation:"):
                return line.split(":", 1)[1].strip()
        return ""
    return message[best:].split("\n", 1)[0].strip()


def parse_action(text: str) -> str | None:
    """The last `search[...]` / `click[...]` in an assistant message, normalised."""
    found = ACTION_RE.findall(text)
    if not found:
        return None
    name, arg = found[-1]
    return f"{name}[{arg.strip()}]"


def message_text(message: dict[str, Any]) -> str:
    """Text of a chat message whose content is a string or a list of OpenAI content parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def parse_clickables(user_text: str) -> set[str] | None:
    """Clickables from a `Clickable: a, b, ...` / `Valid actions: ...` line, if the prompt has one.

    Accepts `click[x]` lists, the env's JSON (`{"clickables": [...]}` or a list) and plain
    comma-separated names. Only an item page's list (it contains `buy now`) is kept: it is the one
    place where it helps, telling option names from values.
    """
    match = VALID_ACTIONS_RE.search(user_text)
    if not match:
        return None
    raw = match.group(1).strip()
    found = {c.strip().lower() for c in CLICK_ARG_RE.findall(raw)}
    if not found:
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.split(", ")
        if isinstance(data, dict):
            data = data.get("clickables")
        if isinstance(data, list):
            found = {str(c).strip().lower() for c in data}
    return found if "buy now" in found else None


def read_conversation(messages: Sequence[Any]) -> Conversation:
    """Pull the current observation, earlier actions (with the pages they led to) and the step cap.

    The step cap comes from a "Step k of N" line when the prompt has one; it bounds how many items
    the heuristic can afford to open before buying.
    """
    observation = ""
    clickables: set[str] | None = None
    actions: list[str] = []
    pages_after: list[str] = []
    max_steps = DEFAULT_MAX_STEPS
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("every message must be an object with 'role' and 'content'")
        role = message.get("role")
        text = message_text(message)
        if role == "assistant":
            action = parse_action(text)
            if action is not None:
                actions.append(action)
                pages_after.append("")
        elif role == "user" and extract_observation(text):
            observation = extract_observation(text)
            clickables = parse_clickables(text)
            if pages_after and not pages_after[-1]:
                pages_after[-1] = observation
            step_of = STEP_OF_RE.search(text)
            if step_of:
                max_steps = int(step_of.group(1))
    return Conversation(observation, actions, clickables, pages_after, max_steps)


def read_messages(body: Any) -> list[Any]:
    """Validate the request body enough to answer 400 instead of crashing."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    return messages


# ---------------------------------------------------------------- response building


def token_ids(text: str) -> list[int]:
    """Deterministic fake token ids: CRC32 of each whitespace token, folded into a small vocab."""
    return [zlib.crc32(tok.encode("utf-8")) % VOCAB_SIZE for tok in text.split()]


def render_reply(decision: Decision) -> str:
    """The assistant message: a one-line thought, then the action on its own line."""
    thought = " ".join(decision.thought.split())
    return f"Thought: {thought}\nAction: {decision.action}"


def completion_body(prompt_text: str, content: str, *, with_token_ids: bool = False) -> dict[str, Any]:
    """A `chat.completion` object as the OpenAI API returns it, plus vLLM's token ids when asked for."""
    prompt_ids = token_ids(prompt_text)
    response_ids = token_ids(content)
    body: dict[str, Any] = {
        "id": f"chatcmpl-standin-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": STANDIN_MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(response_ids),
            "total_tokens": len(prompt_ids) + len(response_ids),
        },
    }
    if with_token_ids:
        # vLLM's names (>= 0.10.2, `return_token_ids`): prompt ids top level, completion ids per choice.
        body["prompt_token_ids"] = prompt_ids
        body["choices"][0]["token_ids"] = response_ids
    return body


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body, so SDK clients classify it as they would a real API error."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------- fault injection


class FaultInjector:
    """Seeded coin flips deciding which requests fail, so failure runs repeat.

    The server runs on one event loop, so the shared generator needs no lock; the sequence of
    outcomes is fixed by the seed and the order requests arrive in.
    """

    def __init__(self, error_rate: float, seed: int) -> None:
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def next_fault(self) -> JSONResponse | None:
        """None for a normal answer; otherwise a 429 (with Retry-After) or a 500, half each."""
        if self.error_rate <= 0.0 or self.rng.random() >= self.error_rate:
            return None
        if self.rng.random() < 0.5:
            return error_response(
                429,
                "Injected rate limit (heuristic stand-in --error-rate)",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        return error_response(500, "Injected server error (heuristic stand-in --error-rate)", "server_error")


# ---------------------------------------------------------------- HTTP app


def build_app(settings: PolicySettings) -> Starlette:
    """The Starlette app; chat completions are served under any path prefix (per-attempt proxies)."""
    faults = FaultInjector(settings.error_rate, settings.seed)

    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
            messages = read_messages(body)
            conversation = read_conversation(messages)
        except (ValueError, BadRequest) as exc:
            return error_response(400, f"Bad chat completion request: {exc}", "invalid_request_error")
        if settings.latency_ms > 0:
            await asyncio.sleep(settings.latency_ms / 1000.0)
        fault = faults.next_fault()
        if fault is not None:
            return fault
        decision = decide(
            conversation.observation,
            conversation.previous_actions,
            conversation.clickables,
            pages_after=conversation.pages_after,
            max_steps=conversation.max_steps,
        )
        prompt_text = "\n".join(message_text(m) for m in messages)
        logger.debug("path=%s action=%s", request.url.path, decision.action)
        with_ids = body.get("return_token_ids") is True
        return JSONResponse(completion_body(prompt_text, render_reply(decision), with_token_ids=with_ids))

    async def models(_request: Request) -> JSONResponse:
        card = {"id": STANDIN_MODEL, "object": "model", "created": 0, "owned_by": "webshop-env (heuristic)"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": STANDIN_MODEL, "kind": "heuristic stand-in"})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/{prefix:path}/chat/completions", chat_completions, methods=["POST"]),
        Route("/models", models, methods=["GET"]),
        Route("/{prefix:path}/models", models, methods=["GET"]),
    ]
    return Starlette(routes=routes)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; the help text says plainly that this is not a model."""
    parser = argparse.ArgumentParser(
        prog="python -m webshop_env.policy",
        description=(
            "Heuristic STAND-IN for an LLM, for tests, demos and benchmarks. NOT a model: an "
            "OpenAI-compatible server whose replies come from fixed WebShop rules (search the "
            "instruction, open the best-matching affordable result, select options named in the "
            f"instruction, buy). Responses report model '{STANDIN_MODEL}'."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="wait this long before each answer, without blocking other requests (default 0)",
    )
    parser.add_argument(
        "--error-rate",
        type=float,
        default=0.0,
        help="probability of an injected failure per completion: half 429 + Retry-After, half 500",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the failure coin flips (default 0)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.error_rate <= 1.0:
        parser.error("--error-rate must be between 0 and 1")
    if args.latency_ms < 0:
        parser.error("--latency-ms must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Start the stand-in server."""
    args = parse_args(argv)
    settings = PolicySettings(latency_ms=args.latency_ms, error_rate=args.error_rate, seed=args.seed)
    app = build_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, backlog=2048)


if __name__ == "__main__":
    main()
