"""A LitAgent's ``openai`` SDK chat calls as ``openai.chat.completion`` spans of the attempt running them.

Agent Lightning's tracers hold one active trace per process, and a ``-P threads`` worker runs many attempts in
one. So ``chat.completions.create`` (sync and async) is wrapped once per process, and each call finds its
attempt through a context variable set around the agent call (``capturing``); a call outside any attempt
passes through untouched. Inside an attempt a call gets what the WebShop loop's calls get: the stop check, a
timeout no later than the attempt's deadline, the model's cluster-wide rate limit, token ids when
``LLM_RETURN_TOKEN_IDS`` is on, and a span with the attributes ``TracerTraceToTriplet`` reads.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from bridge.core.settings import WorkerSettings
from workers.agents.ratelimit import LLMRateLimiter
from workers.telemetry.spans import LLM_SPAN, AttemptTelemetry

MIN_TRY_S = 0.05


@dataclass
class AttemptCapture:
    """What the wrapped SDK needs to know about the attempt whose agent is calling it."""

    telemetry: AttemptTelemetry
    settings: WorkerSettings
    check_stop: Callable[[], None]
    deadline: float | None
    limiter_for: Callable[[str], LLMRateLimiter | None]
    llm_calls: int = 0
    last_reward: float | None = None  # the latest reward an Agent Lightning emitter recorded
    record_spans: bool = True  # False under AGENT_TRACER=agentops: its instrumentation records the call

    def llm_span(self, kwargs: dict[str, Any]) -> AbstractContextManager[trace.Span]:
        """The call's span, or a non-recording one where another tracer records LLM calls (no duplicates)."""
        if self.record_spans:
            return self.telemetry.span(LLM_SPAN, self.attributes(kwargs))
        return nullcontext(trace.INVALID_SPAN)

    def before(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], LLMRateLimiter | None]:
        """Stop check, rate limit and request changes before one call; returns the call's keyword arguments."""
        self.check_stop()
        kwargs = dict(kwargs)
        if self.settings.llm_return_token_ids and not kwargs.get("stream"):
            extra = dict(kwargs.get("extra_body") or {})
            extra.setdefault("return_token_ids", True)
            kwargs["extra_body"] = extra
        if self.deadline is not None:
            left = self.deadline - time.time()
            if left < MIN_TRY_S:
                raise TimeoutError("the rollout's time budget ran out before the agent's LLM call")
            timeout = kwargs.get("timeout")
            if not isinstance(timeout, (int, float)) or timeout > left:
                kwargs["timeout"] = left
        limiter = self.limiter_for(str(kwargs.get("model") or ""))
        return kwargs, limiter

    def attributes(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.system": "openai",
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": str(kwargs.get("model") or ""),
            "llm.source": "agent",
        }
        if self.settings.trace_content:
            for i, message in enumerate(kwargs.get("messages") or []):
                if isinstance(message, dict):
                    attributes[f"gen_ai.prompt.{i}.role"] = str(message.get("role", ""))
                    attributes[f"gen_ai.prompt.{i}.content"] = str(message.get("content", ""))
        return attributes

    def record(self, span: trace.Span, response: Any, started: float, limiter: LLMRateLimiter | None) -> None:
        """Usage, finish reason and token ids of one answer on its span; tokens charged to the rate limit."""
        self.llm_calls += 1
        data = _as_dict(response)
        usage = _obj(data.get("usage"))
        prompt_tokens, completion_tokens = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
        if limiter is not None:
            limiter.charge_tokens((prompt_tokens or 0) + (completion_tokens or 0) or None)
        choices = data.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        choice: dict[str, Any] = first if isinstance(first, dict) else {}
        message = _obj(choice.get("message"))
        span.set_attribute("gen_ai.response.model", str(data.get("model") or ""))
        if isinstance(choice.get("finish_reason"), str):
            span.set_attribute("gen_ai.response.finish_reasons", [choice["finish_reason"]])
        if prompt_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
            span.set_attribute("gen_ai.usage.prompt_tokens", prompt_tokens)
        if completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
            span.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
        prompt_ids = _ints(data.get("prompt_token_ids")) or _ints(choice.get("prompt_token_ids"))
        response_ids = next(
            (
                ids
                for ids in map(
                    _ints,
                    (
                        choice.get("token_ids"),
                        _get(choice.get("provider_specific_fields"), "token_ids"),
                        _get(message.get("provider_specific_fields"), "token_ids"),
                    ),
                )
                if ids is not None
            ),
            None,
        )
        if not span.is_recording():
            return
        if prompt_ids is not None:
            self.telemetry.attach_ints(span, "prompt_token_ids", prompt_ids)
        if response_ids is not None:
            self.telemetry.attach_ints(span, "response_token_ids", response_ids)
        span.set_attribute("llm.latency_ms", round((time.perf_counter() - started) * 1000, 2))
        if self.settings.trace_content and isinstance(message.get("content"), str):
            span.set_attribute("gen_ai.completion.0.content", message["content"])


_current: ContextVar[AttemptCapture | None] = ContextVar("agl_celery_attempt_capture", default=None)


def current() -> AttemptCapture | None:
    """The attempt whose agent runs in this context, if any."""
    return _current.get()


@contextmanager
def capturing(capture: AttemptCapture | None) -> Iterator[None]:
    """Calls made in this context (and coroutines ``asyncio.run`` starts from it) belong to ``capture``."""
    token = _current.set(capture)
    try:
        yield
    finally:
        _current.reset(token)


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        capture = _current.get()
        if capture is None:
            return original(self, *args, **kwargs)
        kwargs, limiter = capture.before(kwargs)
        if limiter is not None:
            limiter.acquire(capture.check_stop)
        with capture.llm_span(kwargs) as span:
            started = time.perf_counter()
            response = original(self, *args, **kwargs)
            if not kwargs.get("stream"):
                capture.record(span, response, started, limiter)
            return response

    create.__agl_celery_wrapped__ = True  # type: ignore[attr-defined]
    return create


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        capture = _current.get()
        if capture is None:
            return await original(self, *args, **kwargs)
        kwargs, limiter = capture.before(kwargs)
        if limiter is not None:  # its wait sleeps: off the agent's event loop
            await asyncio.to_thread(limiter.acquire, capture.check_stop)
        with capture.llm_span(kwargs) as span:
            started = time.perf_counter()
            response = await original(self, *args, **kwargs)
            if not kwargs.get("stream"):
                capture.record(span, response, started, limiter)
            return response

    create.__agl_celery_wrapped__ = True  # type: ignore[attr-defined]
    return create


_install_lock = threading.Lock()


def install_openai_capture() -> None:
    """Wrap the SDK's chat completion methods once per process (idempotent)."""
    from openai.resources.chat import completions

    with _install_lock:
        for cls, wrap in ((completions.Completions, _wrap_sync), (completions.AsyncCompletions, _wrap_async)):
            if not getattr(cls.create, "__agl_celery_wrapped__", False):
                cls.create = wrap(cls.create)  # type: ignore[method-assign]


def _as_dict(response: Any) -> dict[str, Any]:
    if isinstance(response, dict):
        return response
    dump = getattr(response, "model_dump", None)
    if callable(dump):
        try:
            data = dump()
        except Exception:  # an answer the SDK could not model: no attributes rather than a failed attempt
            return {}
        return data if isinstance(data, dict) else {}
    return {}


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _get(container: Any, key: str) -> Any:
    return container.get(key) if isinstance(container, dict) else None


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and set(map(type, value)) == {int}:
        return value
    return None
