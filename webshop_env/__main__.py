"""Command line: ``python -m webshop_env serve`` runs the server, ``tasks`` lists task ids."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from webshop_env import needs_lab_extra
from webshop_env.goals import SPLITS, load_tasks
from webshop_env.session import DEFAULT_MAX_SESSIONS, DEFAULT_TTL_S

logger = logging.getLogger("webshop_env.cli")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m webshop_env",
        description="Offline WebShop-compatible text environment (1,000 real products, 6,923 goals).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the HTTP server (POST /reset, POST /step, GET /health)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind")
    serve.add_argument("--port", type=int, default=3000, help="TCP port")
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        help="open sessions allowed at once; /reset answers 503 beyond it",
    )
    serve.add_argument(
        "--session-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds an idle session lives before it expires",
    )
    serve.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random goal drawn by a /reset without task_id/goal_id/instruction",
    )
    serve.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="optional per-episode step cap (done, reward 0, info.truncated); none upstream",
    )
    serve.add_argument(
        "--strict-search",
        action="store_true",
        help="ignore search[...] on pages without a search bar (upstream accepts it anywhere)",
    )
    serve.add_argument(
        "--expose-goal",
        action="store_true",
        help="debug: include the target asin/attributes/options in reset info",
    )
    serve.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every /reset and /step")
    serve.add_argument(
        "--error-rate", type=float, default=0.0, help="fault test: share of /reset and /step answered 503"
    )
    serve.add_argument(
        "--timeout-rate", type=float, default=0.0, help="fault test: share of /reset and /step that stall"
    )
    serve.add_argument("--stall-s", type=float, default=60.0, help="how long an injected stall lasts")
    serve.add_argument(
        "--nan-reward-rate", type=float, default=0.0, help="fault test: share of purchases answered with reward NaN"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--access-log", action="store_true", help="log every request (slower)")

    tasks = sub.add_parser(
        "tasks",
        help="print a JSON list of {task_id, instruction, goal_id, split}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tasks.add_argument(
        "--split",
        choices=list(SPLITS),
        default="test",
        help="test = goals 0-499, val = 500-1499, train = 1500+",
    )
    tasks.add_argument("--limit", type=int, default=None, help="at most this many tasks")
    tasks.add_argument(
        "--seed",
        type=int,
        default=0,
        help="0: goal-list order (first N of the split); other values: a seeded shuffle",
    )
    return parser


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from webshop_env.env import EnvSettings
        from webshop_env.server import ServerConfig, create_app
    except ModuleNotFoundError as exc:  # its HTTP and search libraries are the project's `lab` extra
        print(needs_lab_extra("webshop_env", "the server", exc), file=sys.stderr)
        return 1

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        seed=args.seed,
        env=EnvSettings(strict_search=args.strict_search, max_steps=args.max_steps, expose_goal=args.expose_goal),
        latency_ms=args.latency_ms,
        error_rate=args.error_rate,
        timeout_rate=args.timeout_rate,
        stall_s=args.stall_s,
        nan_reward_rate=args.nan_reward_rate,
    )
    app = create_app(config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    json.dump(load_tasks(args.split, args.limit, args.seed), sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
