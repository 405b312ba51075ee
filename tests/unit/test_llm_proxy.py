"""LLM routing through a proxy: each attempt calls its own path on the endpoint (the LLMProxy protocol)."""

from __future__ import annotations

import pytest

from workers.agents.llm import proxy_attempt_url


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076/v1"),
        ("http://127.0.0.1:9/v1/", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076/v1"),
        ("http://127.0.0.1:9", "http://127.0.0.1:9/rollout/ro-9a85aef652f5/attempt/at-0a07a076"),
        ("http://h:9/api/", "http://h:9/api/rollout/ro-9a85aef652f5/attempt/at-0a07a076"),
    ],
)
def test_proxy_attempt_url_follows_the_protocol(endpoint: str, expected: str) -> None:
    assert proxy_attempt_url(endpoint, "ro-9a85aef652f5", "at-0a07a076") == expected
