"""Which LLM a rollout talks to, and one chat call with bounded, Retry-After-aware retries.

Resolution follows docs/store-protocol.md section 5: the rollout's resources (by id, else the latest),
``main_llm`` of type ``llm`` (used as is) or ``proxy_llm`` (rewritten to the per-attempt URL so the
proxy files its spans under this attempt); with neither, ``OPENAI_API_BASE`` + ``WEBSHOP_MODEL``.
``OPENAI_API_KEY`` goes only to ``OPENAI_API_BASE``'s host and the ``LLM_KEY_HOSTS`` (``llm_api_key``).
Everything goes through the ``openai`` SDK, so vLLM, OpenAI and the stand-in are interchangeable.

A call never outlives its attempt: ``chat`` takes the episode's deadline and stop check, caps each try's
timeout at the time left and stops retrying at the deadline (``TimeoutError``, class ``timeout``). Under
``-P threads`` this is the only bound, as Celery's time limits work only under prefork.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import openai

from bridge.core.infra import HTTPClient, LLMError, LLMPaused, Retries, pooled_transport, redact_url, retry_after_s
from bridge.core.settings import WorkerSettings, split_host_port
from bridge.core.store import AttemptedRollout, LLMResource, ResourcesUpdate
from workers.agents.gateway_llm import pause_reason, paused_wait_s
from workers.lifecycle import metrics as worker_metrics
from workers.lifecycle import state

if TYPE_CHECKING:
    from openai._types import RequestOptions  # a TypedDict: only its name is used, at type-checking time

log = logging.getLogger("workers.agents.llm")

# Sampling parameters travel in the request body as given (OpenAI's named ones and vLLM's extras alike),
# except keys that would replace what the call itself decides.
_RESERVED = {"model", "messages", "stream"}


MAX_REPLY_CHARS = 32_000  # far above any useful action reply; see _to_result


@dataclass(frozen=True)
class LLMTarget:
    base_url: str
    model: str
    api_key: str
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str = "settings"  # "llm", "proxy_llm" or "settings": for logs and span attributes
    return_token_ids: bool = False  # ask for vLLM's token ids (the trainer's triplets are built from them)
    key_withheld: str = ""  # why OPENAI_API_KEY was not sent here (``llm_api_key``); added to a failed call's error


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _endpoint_host(url: str) -> tuple[str, int | None] | None:
    """(lower-case host, port, the scheme's default where none is written) of an endpoint URL; None if unreadable."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port if port is not None else _DEFAULT_PORTS.get(parts.scheme.lower())


def _key_allowed(host: tuple[str, int | None], settings: WorkerSettings) -> bool:
    """Whether ``host`` is OPENAI_API_BASE's host and port or matches an LLM_KEY_HOSTS entry (no port: any)."""
    base = _endpoint_host(str(settings.openai_api_base)) if settings.openai_api_base is not None else None
    if host == base:
        return True
    for entry in settings.llm_key_hosts:
        allowed = split_host_port(entry)
        if allowed is not None and allowed[0] == host[0] and allowed[1] in (None, host[1]):
            return True
    return False


def llm_api_key(endpoint: str, own_key: str | None, settings: WorkerSettings) -> tuple[str | None, str]:
    """The API key to send to ``endpoint``, and why ``OPENAI_API_KEY`` was withheld ("" when it was not).

    A resource's own key is always used as is. Otherwise ``OPENAI_API_KEY`` goes only to the host (and port)
    of ``OPENAI_API_BASE`` and to the ``LLM_KEY_HOSTS`` entries; anywhere else the key is None.
    """
    if own_key or not settings.openai_api_key:
        return own_key or None, ""
    host = _endpoint_host(endpoint)
    if host is not None and _key_allowed(host, settings):
        return settings.openai_api_key, ""
    why = (
        f"OPENAI_API_KEY was withheld from {_show(host)}: it is not OPENAI_API_BASE's host and not listed in "
        "LLM_KEY_HOSTS"
    )
    process = state.process  # each endpoint is named in a warning once per process
    with process.withheld_lock:
        first = endpoint not in process.withheld_endpoints
        if len(process.withheld_endpoints) >= 1024:  # a Store naming endpoint after endpoint: warn again, bounded
            process.withheld_endpoints.clear()
        process.withheld_endpoints.add(endpoint)
    if first:
        log.warning("%s (the Store's resources name the LLM endpoint %s)", why, redact_url(endpoint))
    return None, why


def _show(host: tuple[str, int | None] | None) -> str:
    if host is None:
        return "an endpoint without a readable host"
    name = f"[{host[0]}]" if ":" in host[0] else host[0]
    return f"host {name}" if host[1] is None else f"host {name}:{host[1]}"


def proxy_attempt_url(endpoint: str, rollout_id: str, attempt_id: str) -> str:
    """Per-attempt base URL of an LLM proxy (docs/store-protocol.md 5, steps 1-4)."""
    url = endpoint[:-1] if endpoint.endswith("/") else endpoint
    had_v1 = url.endswith("/v1")
    if had_v1:
        url = url[: -len("/v1")]
    url = f"{url}/rollout/{rollout_id}/attempt/{attempt_id}"
    return f"{url}/v1" if had_v1 else url


def resolve_target(resources: ResourcesUpdate | None, rollout: AttemptedRollout, settings: WorkerSettings) -> LLMTarget:
    """Build the LLM target from the *current* attempt, never from a URL kept from an earlier one."""
    main = (resources.resources.get("main_llm") if resources else None) or None
    if main is not None and main.get("resource_type") in ("llm", "proxy_llm"):
        llm = LLMResource.model_validate(main)
        base = llm.endpoint
        if llm.resource_type == "proxy_llm":
            base = proxy_attempt_url(llm.endpoint, rollout.rollout_id, rollout.attempt.attempt_id)
        key, withheld = llm_api_key(llm.endpoint, llm.api_key, settings)
        return LLMTarget(
            base,
            llm.model,
            key or "EMPTY",
            dict(llm.sampling_parameters),
            llm.resource_type,
            settings.llm_return_token_ids,
            withheld,
        )
    if settings.openai_api_base is not None:
        base = str(settings.openai_api_base).rstrip("/")
        api_key = settings.openai_api_key or "EMPTY"
        return LLMTarget(base, settings.model, api_key, {}, "settings", settings.llm_return_token_ids)
    raise LLMError(
        "no LLM to call: the Store has no 'main_llm' resource of type llm/proxy_llm for this rollout "
        "and OPENAI_API_BASE is not set"
    )


@dataclass
class ChatResult:
    content: str
    model: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    latency_s: float
    retries: int
    rate_limited: int


def shared_http(timeout_s: float) -> httpx.Client:
    """One connection pool per process for every LLM endpoint (clients per attempt are cheap views on it)."""
    process = state.process
    with process.llm_http_lock:
        if process.llm_http is None:
            process.llm_http = HTTPClient(
                timeout=httpx.Timeout(timeout_s, connect=10.0), transport=pooled_transport(max_connections=512)
            )
        return process.llm_http


def make_client(target: LLMTarget, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=target.base_url, api_key=target.api_key, max_retries=0, http_client=shared_http(timeout_s)
    )


def chat(
    client: openai.OpenAI,
    target: LLMTarget,
    messages: list[dict[str, str]],
    *,
    retries: int,
    max_backoff_s: float,
    before_call: Callable[[], object] | None = None,
    check_stop: Callable[[], None] | None = None,
    deadline: float | None = None,
    timeout_s: float | None = None,
) -> ChatResult:
    """One completion. 429 honours Retry-After (capped); 5xx and network errors back off; other 4xx fail.

    ``deadline`` (epoch seconds) is the attempt's budget and ``check_stop`` its stop check (raises when
    the attempt is superseded, cancelled or out of time). Under ``-P threads`` nothing else bounds this
    call: Celery's soft/hard time limits exist only under prefork, and a warm shutdown waits for the
    thread. So each try's timeout (``timeout_s``, else the client's) is capped at the time left, the stop
    check runs before every try and during every back-off, and no try or back-off starts that would end
    past the deadline: ``TimeoutError`` is raised instead, which ``workers.protocol.failures`` classes ``timeout``.

    The body is posted as built, through the SDK's generic ``post`` (same auth, base URL, timeouts and
    typed errors as ``chat.completions.create``), and the answer is read as plain JSON: ``create`` would
    re-walk the whole conversation against the SDK's request types and build response models that are read
    once, a large share of a worker's CPU at low LLM latency, and neither changes a byte on the wire.
    """
    body: dict[str, Any] = {k: v for k, v in target.sampling.items() if k not in _RESERVED}
    if target.return_token_ids:
        body.setdefault("return_token_ids", True)
    body["model"] = target.model
    body["messages"] = messages
    schedule = Retries(limit=retries, base_s=1.0, cap_s=max_backoff_s)
    rate_limited = 0
    if timeout_s is None:
        timeout_s = _client_timeout(client)
    problem = ""
    pause_logged = paused_last = False
    while True:
        _stop_if_due(check_stop, deadline, problem, paused_at=target.base_url if paused_last else None)
        paused_last = False
        if before_call is not None:
            before_call()  # the rate limiter's wait runs the stop check itself
        options = _request_options(deadline, timeout_s, problem)
        started = time.perf_counter()
        try:
            response = client.post("/chat/completions", cast_to=httpx.Response, body=body, options=options)
            result = _to_result(_json_object(response), time.perf_counter() - started, schedule.done, rate_limited)
            worker_metrics.observe_llm(time.perf_counter() - started, "ok", target.source)
            return result
        except openai.RateLimitError as exc:
            paused = paused_wait_s(exc.response)
            if paused is not None:  # a trainer's weight update: waited out, never counted as a retry
                worker_metrics.observe_llm(time.perf_counter() - started, "paused", target.source)
                problem = "the LLM gateway is paused"
                if deadline is not None and time.time() + paused >= deadline:
                    raise LLMPaused(
                        f"the LLM gateway at {target.base_url} stayed paused until the rollout's deadline"
                    ) from exc
                if not pause_logged:
                    pause_logged = True
                    log.warning("the LLM gateway is paused (%s): waiting", pause_reason(exc.response) or "no reason")
                _sleep(paused, check_stop)
                paused_last = True
                continue
            worker_metrics.observe_llm(time.perf_counter() - started, "rate_limited", target.source)
            rate_limited += 1
            hint = retry_after_s(exc.response, with_ms=True)
            problem = f"429 rate limited: {_short(exc)}"
        except openai.APIStatusError as exc:
            worker_metrics.observe_llm(time.perf_counter() - started, "error", target.source)
            if exc.status_code < 500 and exc.status_code != 408:
                raise _llm_error(
                    target, f"LLM at {target.base_url} rejected the request ({exc.status_code}): {_short(exc)}"
                ) from exc
            hint = None
            problem = f"{exc.status_code}: {_short(exc)}"
        except (openai.APIConnectionError, openai.APITimeoutError, httpx.HTTPError) as exc:
            worker_metrics.observe_llm(time.perf_counter() - started, "error", target.source)
            hint = None
            problem = repr(exc)
        except ValueError as exc:
            # A 200 whose body is not valid JSON (a proxy's error page, a truncated answer). Possibly
            # transient, so retried like a 5xx, then an LLM error, not "infra".
            worker_metrics.observe_llm(time.perf_counter() - started, "error", target.source)
            hint = None
            problem = f"answer is not valid JSON: {_short(exc)}"
        if deadline is not None and deadline - time.time() < MIN_TRY_S:
            # This try was cut by the budget (its timeout was capped at the time left), not by the LLM.
            raise TimeoutError(f"the rollout's time budget ran out while calling the LLM (last try: {problem})")
        delay = schedule.next_delay(min(hint, max_backoff_s) if hint else None)
        if delay is None:
            tries = schedule.done + 1
            raise _llm_error(target, f"LLM at {target.base_url} failed after {tries} tries: {problem}")
        if deadline is not None and time.time() + delay >= deadline:
            raise TimeoutError(
                f"the rollout's time budget runs out before LLM retry {schedule.done} (last try: {problem})"
            )
        log.warning("LLM call failed (%s); retry %d in %.1fs", problem, schedule.done, delay)
        _sleep(delay, check_stop)


STOP_CHECK_EVERY_S = 0.5  # a back-off re-runs the stop check at least this often
MIN_TRY_S = 0.05  # a try with less time left than this is not started


def _llm_error(target: LLMTarget, message: str) -> LLMError:
    """A failed call's error, naming the withheld key where one was (a missing key is a likely cause)."""
    return LLMError(f"{message} ({target.key_withheld})" if target.key_withheld else message)


def _stop_if_due(
    check_stop: Callable[[], None] | None, deadline: float | None, problem: str, *, paused_at: str | None = None
) -> None:
    """Raise if the attempt must stop: its own stop check first (it knows why), then the deadline. ``paused_at``:
    the last wait was for the gateway there to resume, so a deadline reached is the pause's (``LLMPaused``),
    however far the wait overshot on a busy machine."""
    if check_stop is not None:
        check_stop()
    if deadline is not None and deadline - time.time() < MIN_TRY_S and paused_at is not None:
        raise LLMPaused(f"the LLM gateway at {paused_at} stayed paused until the rollout's deadline")
    if deadline is not None and deadline - time.time() < MIN_TRY_S:
        last = f" (last try: {problem})" if problem else ""
        raise TimeoutError(f"the rollout's time budget ran out while calling the LLM{last}")


def _request_options(deadline: float | None, timeout_s: float | None, problem: str) -> RequestOptions:
    """This try's timeout: the configured one, never past the deadline (connect, read, write and pool
    each get the capped value; the read timeout bounds each wait for bytes, so a server that never
    answers is cut at the deadline)."""
    if deadline is None:
        return {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))}
    left = deadline - time.time()
    if left < MIN_TRY_S:
        raise TimeoutError(f"the rollout's time budget ran out while calling the LLM (last try: {problem or 'none'})")
    cap = left if timeout_s is None else min(timeout_s, left)
    return {"timeout": httpx.Timeout(cap, connect=min(10.0, cap))}


def _client_timeout(client: openai.OpenAI) -> float | None:
    """The read timeout the client was built with (``make_client``: ``LLM_TIMEOUT_S``)."""
    timeout = client.timeout
    if isinstance(timeout, httpx.Timeout):
        return timeout.read
    return float(timeout) if isinstance(timeout, (int, float)) else None


def _sleep(delay: float, check_stop: Callable[[], None] | None) -> None:
    """A back-off that a cancelled or superseded attempt leaves within ``STOP_CHECK_EVERY_S``."""
    end = time.monotonic() + delay
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, STOP_CHECK_EVERY_S))
        if check_stop is not None:
            check_stop()


def _json_object(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object. Declared JSON that does not parse raises ValueError (retried: a truncated
    answer may be transient); another content type (a proxy's HTML error page) or a non-object, LLMError."""
    try:
        if "json" not in response.headers.get("content-type", "json"):
            raise LLMError(f"LLM answered with non-JSON content: {response.text[:200]!r}")
        data = response.json()
    finally:
        response.close()
    if not isinstance(data, dict):
        raise LLMError(f"LLM answered with JSON that is not an object: {str(data)[:200]!r}")
    return data


def _to_result(data: dict[str, Any], latency_s: float, retries: int, rate_limited: int) -> ChatResult:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise LLMError("LLM answered with no choices")
    choice: dict[str, Any] = choices[0]
    message = _object(choice.get("message"))
    content = message.get("content")
    if not isinstance(content, str):
        content = ""
    if len(content) > MAX_REPLY_CHARS:
        # Kept in the conversation, a multi-megabyte answer would be resent with every later call. The
        # action sits on the last line, so the tail is what matters.
        log.warning("LLM answer of %d characters cut to its last %d", len(content), MAX_REPLY_CHARS)
        content = content[-MAX_REPLY_CHARS:]
    usage = _object(data.get("usage"))
    finish_reason = choice.get("finish_reason")
    return ChatResult(
        content=content,
        model=str(data.get("model") or ""),
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        prompt_token_ids=_int_list(data.get("prompt_token_ids") or choice.get("prompt_token_ids")),
        response_token_ids=_response_token_ids(choice, message),
        latency_s=latency_s,
        retries=retries,
        rate_limited=rate_limited,
    )


def _response_token_ids(choice: dict[str, Any], message: dict[str, Any]) -> list[int] | None:
    """vLLM puts them in ``choices[i].token_ids``; LiteLLM (the Agent Lightning proxy) may move them into
    ``provider_specific_fields`` of the choice or of its message."""
    candidates = (
        choice.get("token_ids"),
        _field(choice.get("provider_specific_fields"), "token_ids"),
        _field(message.get("provider_specific_fields"), "token_ids"),
        choice.get("response_token_ids"),
    )
    return next((ids for ids in map(_int_list, candidates) if ids is not None), None)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _field(container: Any, key: str) -> Any:
    return _object(container).get(key)


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _int_list(value: Any) -> list[int] | None:
    # set(map(type, ...)) runs in C: token-id lists are hundreds of ids per call, every call.
    if type(value) is list and (not value or set(map(type, value)) == {int}):
        return value
    return None


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
