"""``python -m bridge``: the dispatcher (``run``, the default), the operator commands and the lab's.

A command's module is imported only when the command is given, so the dispatcher never loads one. The operator
commands (``bridge.ops``) need only the product's dependencies; the lab's (``bridge_lab``: the demo, benchmarks,
chaos and cluster runs) need the ``lab`` extra, and without it fail with the install command instead of vanishing
from --help.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence
from types import FrameType, ModuleType

from bridge.core.infra import EXIT_CONFIG_ERROR, ConfigError, make_undumpable
from bridge.core.settings import DispatcherSettings, load_settings

DESCRIPTION = """\
Move Agent Lightning rollouts from the Store into Celery.

With no command (or `run`), the bridge claims rollouts from the Store at AGENT_LIGHTNING_STORE_URL,
only as many as the Celery workers have free slots, and publishes each as the task
`workers.run_rollout` (task id = attempt id). Start the workers with `celery -A workers worker`.
Configuration comes from the environment and `.env` (see .env.example and docs/configuration.md).
"""

EPILOG = """\
Exit codes: 0 on a clean stop (SIGINT/SIGTERM), 2 on invalid configuration, 1 on other errors.
"""

TOOLS: dict[str, tuple[str, str]] = {
    "demo": ("bridge_lab.demo", "bring up a whole local stack, run rollouts through it, tear it down"),
    "status": ("bridge.ops.status", "Store counts, broker queues, workers and in-flight rollouts"),
    "bench": ("bridge_lab.bench.run", "measure throughput and overheads on a local stack"),
    "bench-scale": ("bridge_lab.bench.scale_up", "a burst on a stack with no worker: how fast autoscale adds slots"),
    "bench-v1": (
        "bridge_lab.bench.agl_v1",
        "Agent Lightning 1.0 rollouts on our workers beside 1.0's own local runner",
    ),
    "preflight": (
        "bridge.ops.preflight",
        "refuse a docker compose stack that cannot work (no LLM, no gateway, a placeholder password)",
    ),
    "autoscale": ("bridge.ops.autoscale", "follow agl_bridge_desired_slots: start and stop local worker processes"),
    "chaos": (
        "bridge_lab.chaos.run",
        "inject faults into a local stack; audit that no rollout was lost or run twice",
    ),
    "cluster": (
        "bridge_lab.cluster.run",
        "worker hosts as network namespaces (root): scale-out, host loss, partition, outages",
    ),
}
"""Command -> (module, one-line summary). Each module exposes ``add_arguments(parser)`` and ``main(args)``."""

LAB_PACKAGE = "bridge_lab"
LAB_INSTALL = "pip install 'agl-celery-bridge[lab]' (from a clone: pip install -e '.[lab]')"


class ToolUnavailable(RuntimeError):
    """A command's module failed to import (for a lab command, usually the ``lab`` extra not installed)."""


def _run(args: argparse.Namespace) -> int:
    from bridge.dispatch.v03 import run_bridge

    settings = load_settings(DispatcherSettings)
    make_undumpable("bridge")
    return run_bridge(settings, metrics_port=args.metrics_port)


def _run_v1(args: argparse.Namespace) -> int:
    import threading

    from bridge.dispatch.dispatcher import install_signal_handlers
    from bridge.dispatch.v1 import run_v1

    if args.key is not None:
        raise ConfigError(
            "--key would show the gateway's key to anyone who can list processes (ps): "
            "set AGL_V1_KEY in the environment or give --key-file PATH instead"
        )
    overrides = {k: v for k, v in (("agl_v1_url", args.server), ("agl_v1_key", _read_key(args.key_file))) if v}
    settings = load_settings(DispatcherSettings, **overrides)
    stop = threading.Event()
    install_signal_handlers(stop)
    make_undumpable("1.0 dispatcher")
    return run_v1(settings, stop, metrics_port=args.metrics_port)


def _read_key(path: str | None) -> str | None:
    """The key in the file ``path`` (its first line, stripped); None without a path. ConfigError when unreadable."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            key = handle.readline().strip()
    except OSError as exc:
        raise ConfigError(f"--key-file {path}: {exc.strerror or exc}") from None
    if not key:
        raise ConfigError(f"--key-file {path} is empty")
    return key


V1_DESCRIPTION = """\
Run Agent Lightning 1.0 rollouts on this Celery cluster: a runner type beside 1.0's `local` and `k8s`.

Reads the rollouts queuing on the 1.0 gateway (AGL_V1_SERVER_URL), publishes each as the task
`workers.run_v1_rollout`, only as many as the workers have free slots, and reconciles until each ends: a
worker lost mid-run means the rollout runs again once under a new attempt id (AGL_V1_MAX_RERUNS). The same
`celery -A workers worker` processes serve it beside 0.3's bridge; give it their settings (broker, Redis,
and AGENT_LIGHTNING_STORE_URL or REDIS_KEY_SCOPE, which name their Redis keys). Without a Store (1.0 only)
neither is needed: the dispatcher and the workers then scope their keys by AGL_V1_SERVER_URL, which they
must spell alike. See docs/agl-v1.md.
"""


def _interrupt_on_stop_signals() -> None:
    """A tool unwinds as on Ctrl-C when it is told to stop, so the processes it started are stopped too:
    SIGTERM and SIGHUP (a closed terminal), whose defaults end the process at once, leaving a bench's Store,
    stand-ins and workers running; and SIGINT even where the tool was started with it ignored (a background job of
    a non-interactive shell, as CI runners start commands, inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt: the demo's "press Ctrl-C" would wait forever)."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


def load_tool(name: str) -> ModuleType:
    """The module of command ``name``; ToolUnavailable with the reason (and the install command for a lab
    command missing a module) when it cannot be imported."""
    module_name = TOOLS[name][0]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        message = f"'python -m bridge {name}' cannot load ({module_name}): {exc}"
        if isinstance(exc, ModuleNotFoundError) and module_name.startswith(LAB_PACKAGE + "."):
            message += f"; it is a lab command, which needs the lab extra: {LAB_INSTALL}"
        raise ToolUnavailable(message) from exc


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s tool module is imported, to add its own arguments."""
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
        help="dispatch rollouts (the default)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_metrics_port(run)
    run.set_defaults(func=_run)
    v1 = sub.add_parser(
        "v1",
        help="dispatch Agent Lightning 1.0 rollouts from its gateway",
        description=V1_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v1.add_argument("--server", default=None, help="the 1.0 gateway's URL (default: AGL_V1_SERVER_URL)")
    v1.add_argument(
        "--key-file",
        default=None,
        metavar="PATH",
        help="a file whose first line is the gateway's key (default: AGL_V1_KEY)",
    )
    v1.add_argument("--key", default=None, help=argparse.SUPPRESS)  # refused: a key on the command line leaks
    _add_metrics_port(v1)
    v1.set_defaults(func=_run_v1)
    for name, (_module, summary) in TOOLS.items():
        tool_parser = sub.add_parser(name, help=summary, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            module = load_tool(name)
            tool_parser.description = module.__doc__
            module.add_arguments(tool_parser)
            tool_parser.set_defaults(func=module.main)
    return parser


def _add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on METRICS_HOST:PORT (default: BRIDGE_METRICS_PORT, off)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = args_in[0] if args_in and args_in[0] in TOOLS else None
    try:
        parser = build_parser(command)
    except ToolUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    args = parser.parse_args(args_in)
    if command is not None:
        _interrupt_on_stop_signals()
    try:
        return int(args.func(args))
    except ConfigError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 130
