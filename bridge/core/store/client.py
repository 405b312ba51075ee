"""The one client for the Agent Lightning Store's REST API (docs/store-protocol.md).

Error handling follows section 9 of the protocol: connection errors, timeouts and 5xx answers other
than a store-level ``ValueError`` are transient and retried with jittered exponential backoff;
4xx answers and ``ValueError`` are permanent. A connection the Store reset (it closes the socket
after a 500 on ``/v1/traces``) is retried on a fresh connection, which httpx's pool gives us.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from bridge.core.infra import Retries, StoreRejected, StoreUnavailable, UnknownIdError, redact_url, service_client
from bridge.core.store.models import Attempt, AttemptedRollout, ResourcesUpdate, Rollout

if TYPE_CHECKING:  # settings reads TRACES from here at runtime: a type-only import keeps the two acyclic
    from bridge.core.settings import StoreSettings

log = logging.getLogger(__name__)

API = "/v1/agl"
"""Prefix of every Store REST path; the one spelling of it (tools and tests import it from here)."""
TRACES = "/v1/traces"
"""The Store's OTLP/HTTP span endpoint, beside (not under) the REST API."""
_TRANSIENT_EXCEPTIONS = (httpx.TransportError,)
ROLLOUTS_PER_READ = 100
"""Ids per batched rollout read: keeps the query string (about 30 bytes an id) far below URL limits."""


class SharedResources(Protocol):
    """Resources updates shared by the processes of a cluster (``workers.lifecycle.shared_resources``): the fetch time
    (epoch seconds) and the update, so each process applies the same TTL from the one fetch."""

    def get(self, resources_id: str) -> tuple[float, ResourcesUpdate] | None: ...

    def put(self, fetched_at: float, update: ResourcesUpdate, ttl_s: float) -> None: ...


class StoreClient:
    """Thread-safe (httpx.Client is) synchronous client, one per process."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        resources_ttl_s: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._client = service_client(base_url, token=token, timeout_s=timeout_s, max_connections=max_connections)
        self._resources_ttl_s = resources_ttl_s
        self._resources_cache: dict[str, tuple[float, ResourcesUpdate]] = {}
        self._cache_lock = threading.Lock()
        self.shared_resources: SharedResources | None = None  # set by the workers: one fetch per TTL for all processes
        self.requests_sent = 0

    @classmethod
    def from_settings(
        cls, settings: StoreSettings, *, timeout_s: float | None = None, retries: int | None = None
    ) -> StoreClient:
        """A client configured by the STORE_* settings; a short-lived caller (a status probe) may ask for
        a shorter timeout or fewer retries than the long-lived processes."""
        return cls(
            settings.store_base,
            token=settings.store_token,
            timeout_s=settings.store_timeout_s if timeout_s is None else timeout_s,
            retries=settings.store_retries if retries is None else retries,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport -----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        retries: int | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request, retrying transient failures until ``retries`` or ``deadline`` runs out."""
        budget = self.retries if retries is None else retries
        schedule = Retries(limit=None if deadline is not None else budget, base_s=0.5, cap_s=10.0, deadline=deadline)
        while True:
            try:
                self.requests_sent += 1
                response = self._client.request(
                    method,
                    path,
                    json=json,
                    params=params,
                    content=content,
                    headers=headers,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
                error = self._classify(response, path)
                if error is None:
                    return response
            except _TRANSIENT_EXCEPTIONS as exc:
                url = path if "://" in path else f"{self.base_url}{path}"
                error = StoreUnavailable(f"Store unreachable at {redact_url(url)}: {exc!r}", path=path)
            if isinstance(error, StoreRejected):
                raise error
            delay = schedule.next_delay()
            if delay is None:
                raise error
            log.warning("%s %s failed (%s); retry %d in %.1fs", method, path, error, schedule.done, delay)
            time.sleep(delay)

    @staticmethod
    def _classify(response: httpx.Response, path: str) -> StoreRejected | StoreUnavailable | None:
        code = response.status_code
        if code < 400:
            return None
        detail = _detail(response)
        message = f"Store answered {code} for {path}: {detail}"
        if code >= 500:
            error_type = _error_type(response)
            if error_type == "ValueError" or error_type == "ResponseValidationError":
                if "not found" in detail.lower() or error_type == "ResponseValidationError":
                    return UnknownIdError(message, status_code=code, path=path)
                return StoreRejected(message, status_code=code, path=path)
            return StoreUnavailable(message, status_code=code, path=path)
        if code in (408, 429):
            return StoreUnavailable(message, status_code=code, path=path)
        return StoreRejected(message, status_code=code, path=path)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, API + path, **kwargs).json()

    # --- endpoints -----------------------------------------------------------------------------

    def health(self) -> bool:
        try:
            response = self._client.get(API + "/health", timeout=3.0)
            return response.status_code == 200 and response.json().get("status") == "ok"
        except (httpx.HTTPError, ValueError):
            return False

    def enqueue(self, requests: Iterable[Mapping[str, Any]]) -> list[Rollout]:
        data = self._json("POST", "/queues/rollouts/enqueue", json={"rollouts": list(requests)})
        return [Rollout.model_validate(item) for item in data]

    def dequeue(self, limit: int, worker_id: str, *, timeout: float = 10.0) -> list[AttemptedRollout]:
        """Claim up to ``limit`` rollouts. Not idempotent: never retried blindly (a lost answer strands them)."""
        if limit <= 0:
            return []
        data = self._json(
            "POST",
            "/queues/rollouts/dequeue",
            json={"limit": limit, "worker_id": worker_id},
            retries=0,
            timeout=timeout,
        )
        return [AttemptedRollout.model_validate(item) for item in data or []]

    def get_rollout(
        self, rollout_id: str, *, retries: int | None = None, timeout: float | None = None
    ) -> Rollout | AttemptedRollout:
        data = self._json("GET", f"/rollouts/{rollout_id}", retries=retries, timeout=timeout)
        if data is None:
            raise UnknownIdError(f"rollout {rollout_id} is unknown to the Store", path=f"/rollouts/{rollout_id}")
        return _rollout(data)

    def list_rollouts(
        self,
        *,
        status_in: Iterable[str] = (),
        rollout_ids: Iterable[str] = (),
        limit: int = -1,
        sort_by: str | None = None,
        retries: int | None = None,
        timeout: float | None = None,
    ) -> tuple[list[Rollout | AttemptedRollout], int]:
        """One page of rollouts (``limit`` -1: all) and ``total``, the count of every match; ``sort_by`` a
        Rollout field, ascending (docs/store-protocol.md 3)."""
        params: list[tuple[str, str | int]] = [("status_in", s) for s in status_in]
        params += [("rollout_id_in", r) for r in rollout_ids]
        if sort_by is not None:
            params += [("sort_by", sort_by), ("sort_order", "asc")]
        params.append(("limit", limit))
        data = self._json("GET", "/rollouts", params=params, retries=retries, timeout=timeout)
        return [_rollout(item) for item in data["items"]], int(data["total"])

    def get_rollouts(
        self, rollout_ids: Sequence[str], *, retries: int | None = None, timeout: float | None = None
    ) -> dict[str, Rollout | AttemptedRollout]:
        """Many rollouts by id, each with its latest attempt, in one ``GET /rollouts?rollout_id_in=…`` per
        ``ROLLOUTS_PER_READ`` ids (docs/store-protocol.md 3): a worker process fences all its running attempts
        with one request instead of one ``GET /rollouts/{id}`` each. Ids the Store does not know are absent
        from the answer. ``timeout`` bounds each request; a failed chunk raises, as one read would.
        """
        unique = list(dict.fromkeys(rollout_ids))
        found: dict[str, Rollout | AttemptedRollout] = {}
        for start in range(0, len(unique), ROLLOUTS_PER_READ):
            chunk = unique[start : start + ROLLOUTS_PER_READ]
            items, _ = self.list_rollouts(rollout_ids=chunk, limit=len(chunk), retries=retries, timeout=timeout)
            found.update((item.rollout_id, item) for item in items)
        return found

    def count_rollouts(self, status: str) -> int:
        return self.list_rollouts(status_in=[status], limit=1)[1]

    def list_attempts(self, rollout_id: str) -> list[Attempt]:
        data = self._json("GET", f"/rollouts/{rollout_id}/attempts")
        return [Attempt.model_validate(item) for item in data["items"]]

    def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        deadline: float | None = None,
        retries: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> Attempt:
        body = {k: v for k, v in fields.items() if v is not None}
        data = self._json(
            "POST",
            f"/rollouts/{rollout_id}/attempts/{attempt_id}",
            json=body,
            deadline=deadline,
            retries=retries,
            timeout=timeout,
        )
        return Attempt.model_validate(data)

    def update_rollout(self, rollout_id: str, **fields: Any) -> Rollout:
        data = self._json("POST", f"/rollouts/{rollout_id}", json=fields)
        return Rollout.model_validate(data)

    def get_resources(self, resources_id: str | None) -> ResourcesUpdate | None:
        """Resources by id, else the latest. An update by id is cached for ``resources_ttl_s`` from its fetch, in
        this process and, with ``shared_resources``, for every process: a rollout reads them once, and under
        prefork each process would otherwise fetch the same update (0.40 requests per rollout at 32 slots)."""
        now = time.monotonic()
        if resources_id is not None:
            with self._cache_lock:
                cached = self._resources_cache.get(resources_id)
            if cached and now - cached[0] < self._resources_ttl_s:
                return cached[1]
            shared = self._shared_get(resources_id)
            if shared is not None:
                age = max(0.0, time.time() - shared[0])
                if age < self._resources_ttl_s:
                    self._cache_resources(now - age, shared[1])
                    return shared[1]
        path = f"/resources/{resources_id}" if resources_id else "/resources/latest"
        fetched_at = time.time()
        data = self._json("GET", path)
        if data is None:
            return None
        update = ResourcesUpdate.model_validate(data)
        self._cache_resources(now, update)
        if self.shared_resources is not None:
            self.shared_resources.put(fetched_at, update, self._resources_ttl_s)
        return update

    def _shared_get(self, resources_id: str) -> tuple[float, ResourcesUpdate] | None:
        return self.shared_resources.get(resources_id) if self.shared_resources is not None else None

    def _cache_resources(self, fetched_at: float, update: ResourcesUpdate) -> None:
        with self._cache_lock:
            self._resources_cache[update.resources_id] = (fetched_at, update)
            if len(self._resources_cache) > 256:
                oldest = min(self._resources_cache, key=lambda k: self._resources_cache[k][0])
                self._resources_cache.pop(oldest, None)

    def spans(self, rollout_id: str, attempt_id: str = "latest") -> list[dict[str, Any]]:
        data = self._json("GET", "/spans", params={"rollout_id": rollout_id, "attempt_id": attempt_id})
        return list(data["items"])

    def post_traces(
        self,
        payload: bytes,
        *,
        url: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        once: bool = False,
    ) -> None:
        """OTLP/HTTP protobuf export to ``url`` (None: the Store's ``/v1/traces``; an absolute URL keeps this
        client's retry and reconnect policy, and a 500 here also closes the connection, which the retry
        handles) until ``deadline``, or a single try with ``once``; ``timeout`` bounds each try."""
        self.request(
            "POST",
            url or TRACES,
            content=payload,
            headers={"Content-Type": "application/x-protobuf"},
            deadline=None if once else deadline,
            retries=0 if once else None,
            timeout=timeout,
        )

    def wait_rollouts(self, rollout_ids: list[str], timeout_s: float = 0.0) -> list[Rollout]:
        data = self._json("POST", "/waits/rollouts", json={"rollout_ids": rollout_ids, "timeout": timeout_s})
        return [Rollout.model_validate(item) for item in data or []]

    def statistics(self) -> dict[str, Any]:
        return dict(self._json("GET", "/statistics"))


def _rollout(data: dict[str, Any]) -> Rollout | AttemptedRollout:
    if data.get("attempt"):
        return AttemptedRollout.model_validate(data)
    return Rollout.model_validate(data)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(body, dict):
        detail = body.get("detail", body)
        if body.get("traceback"):
            last = str(body["traceback"]).strip().splitlines()[-1:]
            return f"{detail} ({last[0] if last else ''})"
        return str(detail)[:500]
    return str(body)[:500]


def _error_type(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error_type") if isinstance(body, dict) else None
