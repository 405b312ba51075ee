"""The benchmark's peer: the same WebShop loop run by Agent Lightning's own runner (``--peer agl-runner``).

``python -m bridge bench --peer agl-runner`` starts this module as a child process, so its CPU and memory are
measured like the bridge's. It connects ``n_runners`` runner processes of the installed ``agentlightning``
(``Trainer`` with ``ClientServerExecutionStrategy(role="runner")``) to the benchmark's Store, running
``workers.agents.webshop_loop.Episode``, so the two executors differ only in how they talk to the Store. The reward goes
back as a float; with ``--export-spans`` (``bench --peer-spans``) the episode's spans and token ids are
shipped like ours, one OTLP request per rollout, else dropped. Why: docs/performance.md, "`python -m bridge
bench`".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

log = logging.getLogger("bridge_lab.bench.peer")


def _make_agent(export_spans: bool = False) -> Any:
    """Build the LitAgent class lazily: importing agentlightning takes seconds and is optional."""
    from agentlightning import LitAgent

    from bridge.core.settings import get_settings
    from bridge.core.store import AttemptedRollout, ResourcesUpdate, StoreClient
    from bridge_lab.bench.episode import run_episode
    from workers.agents import llm as llm_mod
    from workers.agents.inputs import parse_task_input
    from workers.agents.webshop import WebShopClient
    from workers.telemetry.spans import AttemptTelemetry

    class WebShopAgent(LitAgent[dict[str, Any]]):
        """One WebShop episode per rollout; clients are built once per runner process."""

        def __init__(self) -> None:
            super().__init__()
            self._clients: tuple[int, WebShopClient, StoreClient] | None = None

        def _process_clients(self) -> tuple[WebShopClient, StoreClient]:
            if self._clients is None or self._clients[0] != os.getpid():
                settings = get_settings()
                env = WebShopClient(str(settings.webshop_url), timeout_s=settings.webshop_timeout_s)
                store = StoreClient(settings.store_base)  # called only with --export-spans
                self._clients = (os.getpid(), env, store)
            return self._clients[1], self._clients[2]

        def rollout(self, task: dict[str, Any], resources: Any, rollout: Any) -> float:
            settings = get_settings()
            env, store = self._process_clients()
            # The target our workers would build (token ids included, LLM_RETURN_TOKEN_IDS), from Agent
            # Lightning's objects converted to the Store's JSON shapes.
            named = {name: resource.model_dump(mode="json") for name, resource in (resources or {}).items()}
            target = llm_mod.resolve_target(
                ResourcesUpdate(resources_id=str(rollout.resources_id or "latest"), resources=named),
                AttemptedRollout.model_validate(rollout.model_dump(mode="json")),
                settings,
            )
            telemetry = AttemptTelemetry(
                store,
                rollout_id=rollout.rollout_id,
                attempt_id=rollout.attempt.attempt_id,
                service_name="agl-runner-peer",
                export=export_spans,
            )
            try:
                parsed = parse_task_input(task, max_chars=settings.max_instruction_chars)
                reward = float(run_episode(parsed, env, target, telemetry, settings).reward)
                telemetry.flush()
                return reward
            finally:
                telemetry.close()

    return WebShopAgent()


def run(store_url: str, n_runners: int, poll_interval_s: float, export_spans: bool = False) -> None:
    """Block running ``n_runners`` SDK runner processes against ``store_url`` until terminated."""
    from urllib.parse import urlsplit

    from agentlightning import ClientServerExecutionStrategy, LitAgentRunner, OtelTracer, Trainer

    parts = urlsplit(store_url)
    strategy = ClientServerExecutionStrategy(
        role="runner", server_host=parts.hostname, server_port=parts.port, n_runners=n_runners
    )
    runner = LitAgentRunner(tracer=OtelTracer(), poll_interval=poll_interval_s)
    trainer = Trainer(n_runners=n_runners, strategy=strategy, runner=runner, tracer=OtelTracer())
    trainer.fit(_make_agent(export_spans))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_lab.bench.peer", description=__doc__)
    parser.add_argument("--store-url", required=True, help="the benchmark's Store, e.g. http://127.0.0.1:4747")
    parser.add_argument("--n-runners", type=int, required=True, help="runner processes (= the slots compared)")
    parser.add_argument(
        "--poll-interval-s", type=float, default=5.0, help="dequeue poll interval when idle (SDK default 5 s)"
    )
    parser.add_argument("--export-spans", action="store_true", help="ship the episode's spans like our workers")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run(args.store_url.rstrip("/"), args.n_runners, args.poll_interval_s, args.export_spans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
