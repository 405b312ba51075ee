"""Readiness of one worker node: ``python -m workers.lifecycle.health [--node NAME] [-Q QUEUES]``.

Exit 0 while the node's slot advert (``bridge.core.coordination.keys.capacity``) is in the coordination Redis on every
queue given, 1 when one is missing or Redis does not answer (the line printed says which), 2 for a bad configuration.
A node advertises from ``worker_ready`` on, every 10 s with a 30 s lifetime, and withdraws at its warm shutdown
(``workers.lifecycle.steps.advertising``): so the check fails while the node starts, while it drains and 30 s after it
last reached Redis. It reads the same settings as the worker (the key's scope), and imports neither Celery nor the
agent. The Kubernetes worker Deployment uses it as its readiness probe (deploy/kubernetes).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

from bridge.core.coordination import capacity, coordination_redis, deployment_scope
from bridge.core.infra import EXIT_CONFIG_ERROR, ConfigError, redact_text
from bridge.core.settings import WorkerSettings, load_settings


def default_node() -> str:
    """``worker@<this host>``: what ``celery -A workers worker -n worker@%h`` names the node (Celery's ``%h`` is
    ``socket.gethostname()``, the pod's name in Kubernetes)."""
    return f"worker@{socket.gethostname()}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.lifecycle.health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", default=None, help="the worker's node name (-n); default worker@<hostname>")
    parser.add_argument(
        "-Q",
        "--queues",
        default=None,
        help="comma-separated queues the node consumes (its -Q); default CELERY_DEFAULT_QUEUE",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds for Redis to answer (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(WorkerSettings)
        scope = deployment_scope(settings)  # nothing naming the deployment is a configuration error too
    except ConfigError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    node = args.node or default_node()
    queues = [q.strip() for q in (args.queues or settings.default_queue).split(",") if q.strip()]
    client = coordination_redis(settings, timeout_s=args.timeout, connect_timeout_s=args.timeout)
    try:
        missing = capacity.missing_adverts(client, scope, node, queues)
    except Exception as exc:  # any Redis or network failure: not ready, never a traceback in the probe's output
        print(f"not ready: Redis did not answer: {redact_text(repr(exc))}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if missing:
        print(f"not ready: {node} advertises no slots on {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"ready: {node} advertises slots on {', '.join(queues)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
