"""The one way this project builds an HTTP client for a service it calls (Store, WebShop)."""

from __future__ import annotations

import httpx


def service_client(base_url: str, *, token: str | None, timeout_s: float, max_connections: int) -> httpx.Client:
    """A pooled client with an optional bearer token (for services behind an authenticating proxy).

    The connect timeout is short and separate: a service that is down should fail fast into the caller's
    retry policy, while a slow answer may take the whole ``timeout_s``.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
    )
