"""Refuse a docker compose stack that cannot work, with one line that names the fix.

docker-compose.yml runs this as one-shot services (``preflight``, ``preflight-v1``, ``preflight-rabbitmq``) that
the others wait for (``condition: service_completed_successfully``): where a check fails, ``docker compose up``
stops with ``service "preflight…" didn't complete successfully: exit 2`` before starting them, and
``docker compose logs preflight…`` holds the one line. It checks only what it is given:

  --llm URL       the 0.3 workers' LLM (OPENAI_API_BASE): its host must resolve and must not be a loopback
                  address (inside a container that is the container itself). Where it does not resolve, a
                  ``main_llm`` in the Store's latest resources (--store, the trainer's) does instead.
  --gateway URL   Agent Lightning 1.0's gateway (AGL_V1_SERVER_URL): its host must resolve, not to loopback.
  --password NAME the environment variable NAME must hold a password of the operator's own: set, not an
                  example's placeholder, at least 12 characters.

A host is tried for --wait-s seconds (compose's own services are healthy before this runs; the wait covers a slow
DNS answer). Exit status 0 when every check holds, 2 with one line on stderr for the first that does not.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from bridge.core.infra import EXIT_CONFIG_ERROR, StoreError

MIN_PASSWORD_CHARS = 12
PLACEHOLDERS = frozenset({"change-me", "changeme", "change_me", "password", "admin", "secret", "flower", "guest"})
"""Passwords that come from an example or a default, never an operator's own (Flower's login uses the same)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llm", metavar="URL", help="the 0.3 workers' LLM endpoint (OPENAI_API_BASE)")
    parser.add_argument("--store", metavar="URL", help="the Store whose latest resources may name a main_llm")
    parser.add_argument("--gateway", metavar="URL", help="Agent Lightning 1.0's gateway (AGL_V1_SERVER_URL)")
    parser.add_argument(
        "--password",
        metavar="NAME",
        action="append",
        default=[],
        help="an environment variable that must hold a password of the operator's own (repeatable)",
    )
    parser.add_argument("--wait-s", type=float, default=10.0, help="how long a host is tried (default 10)")


def password_problem(name: str, value: str | None) -> str | None:
    """Why ``value`` is not a password of the operator's own for ``name``, or None when it is."""
    if not value:
        return f"{name} is not set: set it in .env to a password of your own (e.g. openssl rand -hex 24)"
    if value.strip().lower() in PLACEHOLDERS:
        return f"{name} still has an example's password: set one of your own in .env"
    if len(value) < MIN_PASSWORD_CHARS:
        return f"{name}: the password needs {MIN_PASSWORD_CHARS}+ characters"
    return None


def resolve(host: str, wait_s: float) -> list[str]:
    """The addresses ``host`` resolves to, tried once a second for ``wait_s``; [] when it never does."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
        except (socket.gaierror, UnicodeError):
            if time.monotonic() >= deadline:
                return []
            time.sleep(1.0)


def host_problem(setting: str, url: str, wait_s: float) -> str | None:
    """Why the host of ``url`` (from ``setting``) cannot be reached from here, or None: no host, a name that
    does not resolve (``"unresolved"``), or only loopback addresses."""
    host = urlsplit(url).hostname
    if not host:
        return f"{setting}={url!r} names no host"
    addresses = resolve(host, wait_s)
    if not addresses:
        return "unresolved"
    if all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses):
        return (
            f"{setting}={url} is a loopback address, which inside a container is that container: name the host "
            "as containers reach it (its address, or host.docker.internal with extra_hosts)"
        )
    return None


def store_names_llm(store_url: str | None) -> bool:
    """Whether the Store's latest resources hold a ``main_llm`` (the trainer's model) that workers call instead."""
    if not store_url:
        return False
    from bridge.core.store import StoreClient

    try:
        with StoreClient(store_url, timeout_s=5.0, retries=1) as store:
            latest = store.get_resources(None)
    except (StoreError, OSError, ValueError):  # no Store, or not one: no main_llm to be had from it
        return False
    return latest is not None and "main_llm" in latest.resources


def problem(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The first check of ``args`` that fails, as one line, or None."""
    for name in args.password:
        found = password_problem(name, env.get(name))
        if found:
            return found
    if args.llm:
        found = host_problem("OPENAI_API_BASE", args.llm, args.wait_s)
        if found == "unresolved" and not store_names_llm(args.store):
            return (
                f"no LLM for the 0.3 workers: {args.llm} does not resolve and the Store names no main_llm: add "
                "--profile standin for the stand-in, or set OPENAI_API_BASE in .env to your model server"
            )
        if found and found != "unresolved":
            return found
    if args.gateway:
        found = host_problem("AGL_V1_SERVER_URL", args.gateway, args.wait_s)
        if found == "unresolved":
            return (
                f"no Agent Lightning 1.0 gateway: {args.gateway} does not resolve: add --profile agl-v1-gateway "
                "for compose's own, or set AGL_V1_SERVER_URL in .env to your trainer's gateway"
            )
        if found:
            return found
    return None


def main(args: argparse.Namespace) -> int:
    found = problem(args, os.environ)
    if found is None:
        print("preflight: ok", file=sys.stderr)
        return 0
    print(f"preflight: refusing to start: {found}", file=sys.stderr)
    return EXIT_CONFIG_ERROR
