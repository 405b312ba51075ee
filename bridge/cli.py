"""``python -m bridge``: the dispatcher, plus the operator commands (demo, status, bench)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from bridge.settings import ConfigError, Settings, load_settings

log = logging.getLogger("bridge")

DESCRIPTION = """\
Move Agent Lightning rollouts from the Store into Celery.

With no command (or `run`), the bridge claims rollouts from the Store at AGENT_LIGHTNING_STORE_URL,
only as many as the Celery workers have free slots, and publishes each as the task
`workers.run_rollout` (task id = attempt id). Start the workers with `celery -A workers worker`.
Configuration comes from the environment and `.env` (see .env.example).
"""

EPILOG = """\
commands:
  run      dispatch rollouts (the default)
  demo     bring up a whole local stack, run rollouts through it, tear it down
  status   Store counts, broker queues, workers and in-flight rollouts
  bench    measure throughput and overheads on a local stack
  chaos    kill, pause and corrupt a local stack; audit that no rollout was lost or run twice

Exit codes: 0 on a clean stop (SIGINT/SIGTERM), 2 on invalid configuration, 1 on other errors.
"""


def _run(args: argparse.Namespace) -> int:
    settings = load_settings()
    return run_bridge(settings, metrics_port=args.metrics_port)


def run_bridge(settings: Settings, *, metrics_port: int | None = None) -> int:
    import redis

    from bridge.dispatcher import Dispatcher
    from bridge.logs import configure_logging
    from bridge.publisher import Publisher
    from bridge.redact import redact_url
    from bridge.store import StoreClient
    from bridge.tracing import setup_process_tracing

    configure_logging(settings.log_level, settings.log_json)
    setup_process_tracing(settings.service_name + "-bridge")
    stop = threading.Event()
    _install_signal_handlers(stop)
    port = metrics_port if metrics_port is not None else settings.metrics_port
    if port is not None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=settings.metrics_host)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
    store = StoreClient(
        settings.store_base,
        token=settings.store_token,
        timeout_s=settings.store_timeout_s,
        retries=settings.store_retries,
    )
    if not store.health():
        log.warning("the Store at %s does not answer yet; the bridge keeps trying", redact_url(settings.store_base))
    client = redis.Redis.from_url(settings.broker_url, socket_timeout=5, socket_connect_timeout=5)
    dispatcher = Dispatcher(settings, store, client, Publisher(settings), stop)
    try:
        dispatcher.run()
    finally:
        store.close()
    return 0


def _install_signal_handlers(stop: threading.Event) -> None:
    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: finishing the publish in hand and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def _lazy(module: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(args))

    return call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bridge",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=_run, metrics_port=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="dispatch rollouts (default)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on 127.0.0.1:PORT (default: BRIDGE_METRICS_PORT, off)",
    )
    run.set_defaults(func=_run)
    for name, module, register in _extra_commands():
        register(
            sub.add_parser(name, help=_summary(module.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
        )
    return parser


def _summary(doc: str | None) -> str:
    """First line of a module docstring, safe for argparse (which %-formats help strings)."""
    first = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    return first.replace("%", "%%")


def _extra_commands() -> list[tuple[str, object, Callable[[argparse.ArgumentParser], None]]]:
    """Commands that live in their own modules; each exposes ``add_arguments`` and ``main``."""
    import importlib

    found: list[tuple[str, object, Callable[[argparse.ArgumentParser], None]]] = []
    for name in ("demo", "status", "bench", "chaos"):
        try:
            module = importlib.import_module(f"bridge.{name}")
        except ImportError:
            continue

        def register(p: argparse.ArgumentParser, module: Any = module, name: str = name) -> None:
            module.add_arguments(p)
            p.set_defaults(func=_lazy(f"bridge.{name}"))

        found.append((name, module, register))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
