"""Agent Lightning 1.0's API gateway as the bridge and the workers call it: plain HTTP, the project's retry
schedule, and the gateway's errors (docs/agl-v1.md). The rollout's shape is ``bridge.core.gateway.rollouts``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from bridge.core.gateway.rollouts import FIRST_ATTEMPT, Malformed, V1Rollout, V1State, parse_rollout
from bridge.core.infra import BridgeError, Retries, redact_text, redact_url, service_client
from bridge.core.task import error_text


def _said(response: httpx.Response) -> str:
    """The start of a gateway's answer as an error carries it (logs, task results, ``error_message``): masked by
    ``redact_text`` before it is cut, so no secret is cut in half."""
    return redact_text(response.text[:1000])[:200]


@dataclass(frozen=True)
class ProxyPause:
    """The gateway's proxy pause (``GET /proxy/state``): the trainer pauses it around a weight update, and until it
    resumes every model call answers 429 with ``X-Agl-Paused: true`` (docs/agl-v1.md, "A paused gateway")."""

    paused: bool
    reason: str | None = None

    def describe(self) -> str:
        """``the gateway's proxy was paused (reason)``, for an error message."""
        return "the gateway's proxy was paused" + (f" ({self.reason})" if self.reason else "")


class GatewayError(BridgeError):
    """The gateway could not be reached or answered an error other than the ones named below."""


class GatewayConflict(GatewayError):
    """The gateway refused a state change (409): the rollout moved on, e.g. the trainer failed or deleted it."""


class GatewayClient:
    """The calls a dispatcher and a worker make to the gateway, with the project's retry schedule for
    transport errors and 5xx answers (every call here is idempotent)."""

    def __init__(
        self,
        base_url: str,
        *,
        key: str | None,
        timeout_s: float = 10.0,
        retries: int = 3,
        http: httpx.Client | None = None,
    ) -> None:
        """``http``: the HTTP client the calls go through, ``base_url`` its base (an in-process transport, say);
        by default one of the shared pool's (``bridge.core.infra.http.service_client``) with ``key`` as bearer token."""
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._client = (
            http
            if http is not None
            else service_client(self.base_url, token=key, timeout_s=timeout_s, max_connections=8)
        )

    def close(self) -> None:
        self._client.close()

    def list_rollouts(self, *states: V1State, limit: int = 500) -> list[V1Rollout]:
        return [V1Rollout.model_validate(item) for item in self.list_raw(*states, limit=limit)]

    def list_raw(
        self, *states: V1State, limit: int = 500, retries: int | None = None, timeout: float | None = None
    ) -> list[Any]:
        """The gateway's listing of the rollouts in ``states`` as it answers it: at most ``limit``, in its order
        (creation order: the oldest first), not validated. ``retries`` and ``timeout`` replace the client's for
        this call. GatewayError when the answer is not a list."""
        params: list[tuple[str, str | int]] = [("state_in", s.value) for s in states] + [("limit", limit)]
        extra: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        response = self._send("GET", "/api/rollouts", params=params, retries=retries, **extra)
        try:
            items = response.json()
        except ValueError:
            items = None
        if not isinstance(items, list):
            raise GatewayError(f"gateway GET /api/rollouts answered something else than a list: {_said(response)}")
        return items

    def list_checked(self, *states: V1State, limit: int = 500) -> tuple[list[V1Rollout], list[Malformed]]:
        """``list_rollouts``, but each rollout is validated on its own: the valid ones, and those that are not."""
        valid: list[V1Rollout] = []
        malformed: list[Malformed] = []
        for item in self.list_raw(*states, limit=limit):
            parsed = parse_rollout(item)
            if isinstance(parsed, V1Rollout):
                valid.append(parsed)
            else:
                malformed.append(parsed)
        return valid, malformed

    def fail_malformed(self, rollout: Malformed) -> bool:
        """Fail a rollout this project cannot read (``queuing`` or ``running`` -> ``failed``) with its reason;
        True when set. Its answer is not parsed, for the same reason."""
        if rollout.rollout_id is None:
            return False
        body = {"status": {"state": V1State.FAILED.value, "error_message": error_text(redact_text(rollout.reason))}}
        response = self._send("PATCH", f"/api/rollouts/{rollout.rollout_id}", json=body, allow=(404, 409))
        return response.status_code < 400

    def create_rollouts(self, rollouts: list[dict[str, Any]]) -> list[V1Rollout]:
        """Enqueue rollouts as 1.0's trainer does (``POST /api/rollouts``): each item is ``input``, ``is_train``,
        ``config`` and, for a retry-safe call, a ``rollout_id`` of the caller's (an existing id is not created
        twice)."""
        response = self._send("POST", "/api/rollouts", json=rollouts)
        return [V1Rollout.model_validate(item) for item in response.json()]

    def events(self, rollout_id: str, *, event_type: str | None = None) -> list[dict[str, Any]]:
        """The events of the rollout's current attempt, oldest first (``event_type``: only those)."""
        params = {"event_type": event_type} if event_type else None
        return list(self._send("GET", f"/api/rollouts/{rollout_id}/events", params=params).json())

    def post_event(
        self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any], timeout_s: float = 2.0
    ) -> None:
        """Record an event of the attempt, as a program posts its reward; one try within ``timeout_s`` (GatewayError
        when it fails): for what the worker adds beside the program, which is never worth holding an attempt up."""
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
        self._send("POST", path, json={"event_type": event_type, "data": data}, retries=0, timeout=timeout_s)

    def get_rollout(self, rollout_id: str) -> V1Rollout | None:
        """The rollout, or None when the gateway no longer has it (the trainer deletes finished ones)."""
        response = self._send("GET", f"/api/rollouts/{rollout_id}", allow=(404,))
        if response.status_code == 404:
            return None
        return V1Rollout.model_validate(response.json()["rollout"])

    def proxy_pause(self) -> ProxyPause | None:
        """Whether the trainer has paused the gateway's proxy now; None when the gateway does not say (no such
        route, an error, no answer). One try: a caller that needs the answer later asks again."""
        try:
            response = self._send("GET", "/proxy/state", allow=(404,), retries=0)
            data = response.json() if response.status_code == 200 else None
        except (GatewayError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("paused"), bool):
            return None
        reason = data.get("reason")
        return ProxyPause(data["paused"], str(reason) if reason else None)

    def patch_status(self, rollout_id: str, **status: Any) -> V1Rollout | None:
        """PATCH the rollout's status fields; None when it is gone, GatewayConflict when the gateway refuses
        the state change."""
        body = {"status": {k: (v.value if isinstance(v, V1State) else v) for k, v in status.items()}}
        response = self._send("PATCH", f"/api/rollouts/{rollout_id}", json=body, allow=(404, 409))
        if response.status_code == 404:
            return None
        if response.status_code == 409:
            raise GatewayConflict(f"gateway refused {body} for rollout {rollout_id}: {_said(response)}")
        return V1Rollout.model_validate(response.json())

    def finish(self, rollout_id: str, attempt_id: str, state: V1State, detail: str) -> bool:
        """Set the final state of ``attempt_id`` if it is still the rollout's current attempt and the rollout
        is not finished; True when set. The gateway has no conditional update: one read, then the writes
        (docs/agl-v1.md, "Guarantees")."""
        current = self.get_rollout(rollout_id)
        if current is None or current.status.state in (V1State.SUCCEEDED, V1State.FAILED):
            return False
        if current.status.last_attempt_id not in (None, attempt_id):
            return False
        try:
            if current.status.state == V1State.QUEUING:
                self.patch_status(rollout_id, state=V1State.RUNNING, last_attempt_id=attempt_id)
            fields: dict[str, Any] = {"state": state, "last_attempt_id": attempt_id}
            if state == V1State.FAILED:
                fields["error_message"] = error_text(redact_text(detail))
            return self.patch_status(rollout_id, **fields) is not None
        except GatewayConflict:
            return False

    def supersede(self, rollout_id: str, attempt_id: str, next_attempt_id: str) -> V1Rollout | None:
        """Make ``next_attempt_id`` the current attempt of the rollout, if it is still ``running`` on ``attempt_id``;
        the rollout as moved, None when it is gone, GatewayConflict (nothing moved) when it finished or is on
        another attempt.

        The gateway takes a ``last_attempt_id`` without a ``state`` even on a finished rollout, refuses ``state:
        running`` on a running one (not a transition), and has no conditional update; so: one read, the write of
        ``last_attempt_id`` alone, and the write's answer (the rollout as that write left it) checked. A rollout
        that finished between the read and the write gets ``attempt_id`` written back at once, before this returns
        (docs/agl-v1.md, "The window that remains")."""
        current = self.get_rollout(rollout_id)
        if current is None:
            return None
        state, named = current.status.state, current.status.last_attempt_id or FIRST_ATTEMPT
        if state != V1State.RUNNING or named != attempt_id:
            why = f"rollout {rollout_id} is {state.value} on attempt {named}, not running on {attempt_id}"
            raise GatewayConflict(why)
        moved = self.patch_status(rollout_id, last_attempt_id=next_attempt_id)
        if moved is None or moved.status.state == V1State.RUNNING:
            return moved
        try:
            if self.patch_status(rollout_id, last_attempt_id=attempt_id) is None:
                return None
        except GatewayError as exc:
            raise GatewayError(
                f"rollout {rollout_id} finished ({moved.status.state.value}) before attempt {next_attempt_id} was "
                f"named, and writing attempt {attempt_id} back failed: the trainer reads attempt "
                f"{next_attempt_id}'s events ({exc})"
            ) from exc
        raise GatewayConflict(
            f"rollout {rollout_id} finished ({moved.status.state.value}) before attempt {next_attempt_id} was named: "
            f"attempt {attempt_id} written back"
        )

    def _send(
        self, method: str, path: str, *, allow: tuple[int, ...] = (), retries: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        schedule = Retries(limit=self.retries if retries is None else retries, base_s=0.5, cap_s=5.0)
        while True:
            try:
                response = self._client.request(method, path, **kwargs)
                if response.status_code < 400 or response.status_code in allow:
                    return response
                problem = f"{response.status_code} {_said(response)}"
                if response.status_code < 500:
                    raise GatewayError(f"gateway {method} {path} answered {problem}")
            except httpx.TransportError as exc:
                problem = redact_text(repr(exc))
            delay = schedule.next_delay()
            if delay is None:
                raise GatewayError(f"gateway at {redact_url(self.base_url)}: {method} {path} failed: {problem}")
            time.sleep(delay)
