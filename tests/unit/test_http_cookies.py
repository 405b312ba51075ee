"""The service clients' cookie store (``bridge.core.infra.http.HTTPClient``): a response is handed to the cookie jar
only when it sets a cookie, which saves the standard library's request and response stand-ins on every other
response, and a cookie that is set (a load balancer's sticky session) still goes back with the next request.
Real ``httpx`` clients over an in-memory transport; the jar counts what it is given."""

from __future__ import annotations

from http.cookiejar import CookieJar
from typing import Any

import httpx

from bridge.core.infra import HTTPClient


class CountingJar(CookieJar):
    def __init__(self) -> None:
        super().__init__()
        self.extracted = 0

    def extract_cookies(self, response: Any, request: Any) -> None:
        self.extracted += 1
        super().extract_cookies(response, request)


def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/sticky":
        return httpx.Response(200, headers={"set-cookie": "lb=node-2; Path=/"}, json={})
    return httpx.Response(200, json={"cookie": request.headers.get("cookie")})


def _client(cls: type[httpx.Client], jar: CookieJar) -> httpx.Client:
    return cls(base_url="http://service.test", cookies=jar, transport=httpx.MockTransport(_answer))


def test_a_response_without_set_cookie_never_reaches_the_jar() -> None:
    ours, plain = CountingJar(), CountingJar()
    with _client(HTTPClient, ours) as client, _client(httpx.Client, plain) as reference:
        for _ in range(3):
            assert client.get("/step").json() == {"cookie": None}
            reference.get("/step")
    assert ours.extracted == 0
    assert plain.extracted == 3  # what httpx does on its own: every response


def test_a_cookie_that_is_set_goes_back_with_the_next_request() -> None:
    jar = CountingJar()
    with _client(HTTPClient, jar) as client:
        client.get("/sticky")
        assert client.get("/step").json() == {"cookie": "lb=node-2"}
        assert dict(client.cookies) == {"lb": "node-2"}
        client.cookies = {"lb": "node-3"}  # replacing the store keeps the behaviour
        assert client.get("/step").json() == {"cookie": "lb=node-3"}
    assert jar.extracted == 1
