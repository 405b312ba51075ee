"""LLM calls through an Agent Lightning 1.0 gateway that the trainer pauses (docs/agl-v1.md, "A paused gateway").

1.0's trainer pauses its gateway's proxy around every weight update: until it resumes, every model call answers
429 with ``Retry-After`` and ``X-Agl-Paused: true``. The OpenAI SDK treats that as rate limiting and gives up after
its two retries, so a program on the plain SDK fails in any pause longer than about ten seconds. Here a pause costs
time, never the rollout:

* ``paused_wait_s``: how long a paused answer asks to wait (its ``Retry-After``), or None for any other answer,
  a plain 429 included (rate limiting stays the SDK's, or the caller's, to handle);
* ``PauseWaitingTransport``: an httpx transport that waits out a paused answer and sends the request again, for as
  long as the gateway says it is paused, until ``deadline`` (epoch seconds; None: no bound but the process's own,
  the worker kills a program at its rollout's ``timeout_seconds``). Past the deadline the paused answer is returned
  as it came. A pause is logged once when it starts and once when it ends;
* ``openai_client``: an ``openai.OpenAI`` on the proxy (``AGL_OPENAI_BASE_URL``, ``AGL_KEY``) with that transport,
  for agent programs: the built-in WebShop program uses it, and so can any 1.0 program this project's workers run.

Paused time counts against the rollout's ``timeout_seconds``, as in 1.0's own runners; the worker classes a rollout
that ends while its gateway is paused ``infra``, naming the pause (``workers.v1.attempt``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import httpx
import openai

from bridge.core.infra import retry_after_s

log = logging.getLogger("workers.agents.gateway_llm")

PAUSED_HEADER = "x-agl-paused"
DEFAULT_WAIT_S = 5.0  # 1.0's own default Retry-After for a pause
MAX_WAIT_S = 30.0  # between two tries, whatever Retry-After asks: a resume is seen within this


def paused_wait_s(response: httpx.Response) -> float | None:
    """The seconds a paused gateway asks to wait before the next try, or None when ``response`` is not a
    paused gateway's answer (429 with ``X-Agl-Paused: true``)."""
    if response.status_code != 429 or response.headers.get(PAUSED_HEADER, "").strip().lower() != "true":
        return None
    wait = retry_after_s(response, cap_s=MAX_WAIT_S)
    return DEFAULT_WAIT_S if wait is None else max(wait, 0.1)


def pause_reason(response: httpx.Response) -> str:
    """The reason the trainer gave for the pause (the answer's JSON ``reason``), or ''."""
    try:
        body = response.json()
    except ValueError:
        return ""
    reason = body.get("reason") if isinstance(body, dict) else None
    return str(reason) if reason else ""


class PauseWaitingTransport(httpx.BaseTransport):
    """Sends each request through ``inner``; a paused gateway's answer is waited out and the request sent again,
    until ``deadline`` (epoch seconds, None: none). Every other answer is returned as it came."""

    def __init__(self, inner: httpx.BaseTransport | None = None, *, deadline: float | None = None) -> None:
        self.inner = inner if inner is not None else httpx.HTTPTransport()
        self.deadline = deadline

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()  # the body is sent again after a pause
        paused_since: float | None = None
        while True:
            response = self.inner.handle_request(request)
            wait = paused_wait_s(response)
            if wait is None:
                if paused_since is not None:
                    log.warning("the gateway's proxy resumed after %.1fs", time.monotonic() - paused_since)
                return response
            if self.deadline is not None and time.time() + wait >= self.deadline:
                log.warning("the gateway's proxy is paused past this program's deadline: giving up")
                return response
            response.read()
            if paused_since is None:
                paused_since = time.monotonic()
                reason = pause_reason(response)
                log.warning(
                    "the gateway's proxy is paused%s: waiting (tries again every %.1fs)",
                    f" ({reason})" if reason else "",
                    wait,
                )
            response.close()
            time.sleep(wait)

    def close(self) -> None:
        self.inner.close()


def openai_client(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    deadline: float | None = None,
    timeout_s: float = 600.0,
    **kwargs: Any,
) -> openai.OpenAI:
    """An OpenAI client on the gateway's proxy that waits out its pauses (``PauseWaitingTransport``).

    ``base_url`` and ``api_key`` default to the program's ``AGL_OPENAI_BASE_URL`` and ``AGL_KEY``; ``deadline``
    bounds the waiting (epoch seconds); other keyword arguments go to ``openai.OpenAI`` (``max_retries`` keeps
    the SDK's handling of every other error)."""
    base = base_url if base_url is not None else os.environ["AGL_OPENAI_BASE_URL"]
    key = api_key if api_key is not None else (os.environ.get("AGL_KEY") or "none")
    http = httpx.Client(
        transport=PauseWaitingTransport(deadline=deadline), timeout=httpx.Timeout(timeout_s, connect=10.0)
    )
    return openai.OpenAI(base_url=base, api_key=key, http_client=http, **kwargs)
