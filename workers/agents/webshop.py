"""HTTP client for the WebShop environment server (docs/webshop-env.md section 1).

Retries are bounded and only where repeating a request cannot change the episode: connection
failures before the request was sent, and 5xx/429 answers (the server did not apply the action).
A step whose answer timed out is *not* retried: it may have been applied (a second ``Buy Now`` would
turn a real reward into "episode finished"), so it fails the attempt as an environment error.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bridge.core.infra import Retries, WebShopError, retry_after_s, service_client
from workers.lifecycle import metrics as worker_metrics

log = logging.getLogger("workers.agents.webshop")

_SAFE_TO_RETRY = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 30.0  # a server asking for longer is not waited on beyond this


@dataclass
class Observation:
    session_id: str
    observation: str
    done: bool
    reward: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return bool(self.info.get("valid", True))

    @property
    def clickables(self) -> list[str] | None:
        """The buttons and links the page offers, when the server lists them."""
        available = self.info.get("available_actions")
        return available.get("clickables") if isinstance(available, dict) else None


class WebShopClient:
    """One per process; thread-safe because httpx.Client is."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 3) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._client = service_client(base_url, token=token, timeout_s=timeout_s, max_connections=256)
        self.calls = 0
        self.errors = 0

    def close(self) -> None:
        self._client.close()

    def reset(self, body: dict[str, Any]) -> Observation:
        # A reset only creates a session: a retried one at worst leaves an orphan that expires.
        return self._parse(self._post("/reset", body, idempotent=True), "/reset")

    def step(self, session_id: str, action: str) -> Observation:
        body = {"session_id": session_id, "action": action}
        return self._parse(self._post("/step", body, idempotent=False), "/step")

    def close_session(self, session_id: str) -> None:
        """Free the server's memory at once instead of waiting for the idle expiry; failures do not matter."""
        try:
            self._client.delete(f"/sessions/{session_id}", timeout=5.0)
        except httpx.HTTPError as exc:
            log.debug("could not close WebShop session %s: %r", session_id, exc)

    def _post(self, path: str, body: dict[str, Any], *, idempotent: bool) -> httpx.Response:
        schedule = Retries(limit=self.retries, base_s=0.2, cap_s=5.0)
        while True:
            self.calls += 1
            started = time.perf_counter()
            try:
                response = self._client.post(path, json=body)
                worker_metrics.observe_env(path.strip("/"), time.perf_counter() - started, response.status_code)
                if response.status_code not in _RETRY_STATUS:
                    break
                problem = f"{response.status_code} {response.text[:200]}"
                retry_after = retry_after_s(response, cap_s=MAX_RETRY_AFTER_S)
            except httpx.TransportError as exc:
                worker_metrics.observe_env(path.strip("/"), time.perf_counter() - started, "transport")
                if not idempotent and not isinstance(exc, _SAFE_TO_RETRY):
                    self.errors += 1
                    raise WebShopError(f"WebShop {path} failed at {self.base_url}: {exc!r}") from exc
                problem, retry_after = repr(exc), None
            self.errors += 1
            delay = schedule.next_delay(retry_after)
            if delay is None:
                tries = schedule.done + 1
                raise WebShopError(f"WebShop {path} failed after {tries} tries at {self.base_url}: {problem}")
            log.warning("WebShop %s: %s; retry %d in %.1fs", path, problem, schedule.done, delay)
            time.sleep(delay)
        if response.status_code >= 400:
            self.errors += 1
            raise WebShopError(f"WebShop {path} answered {response.status_code}: {response.text[:300]}")
        return response

    @staticmethod
    def _parse(response: httpx.Response, path: str) -> Observation:
        try:
            data = response.json()
        except ValueError:
            raise WebShopError(f"WebShop {path} answered non-JSON: {response.text[:200]!r}") from None
        if not isinstance(data, dict):
            raise WebShopError(f"WebShop {path} answered {type(data).__name__}, expected an object")
        observation, done, reward = data.get("observation"), data.get("done"), data.get("reward", 0.0)
        session_id = data.get("session_id") or data.get("sessionId")
        if not isinstance(observation, str) or not isinstance(done, bool) or not isinstance(session_id, str):
            raise WebShopError(f"WebShop {path} answer lacks observation/done/session_id: {str(data)[:200]}")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise WebShopError(f"WebShop {path} answered a non-numeric reward {reward!r}")
        if not math.isfinite(reward):
            raise WebShopError(f"WebShop {path} answered a non-finite reward ({reward!r})")
        raw_info = data.get("info")
        info: dict[str, Any] = raw_info if isinstance(raw_info, dict) else {}
        return Observation(session_id, observation, done, float(reward), info)
