"""The WebShop episode as the benchmark's other executors run it (the peer and the floor): one place, so
both run exactly what our task runs (``workers.agents.webshop_loop.Episode``) and differ only in what surrounds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bridge.core.settings import WorkerSettings
    from workers.agents.inputs import TaskInput
    from workers.agents.llm import LLMTarget
    from workers.agents.webshop import WebShopClient
    from workers.agents.webshop_loop import EpisodeResult
    from workers.telemetry.spans import AttemptTelemetry


def run_episode(
    task: TaskInput, env: WebShopClient, target: LLMTarget, telemetry: AttemptTelemetry, settings: WorkerSettings
) -> EpisodeResult:
    """One episode with nothing to stop it early; its spans stay in ``telemetry`` for the caller to flush."""
    from workers.agents import llm as llm_mod
    from workers.agents.webshop_loop import Episode

    episode = Episode(
        task=task,
        env=env,
        client=llm_mod.make_client(target, settings.llm_timeout_s),
        target=target,
        telemetry=telemetry,
        settings=settings,
        check_stop=lambda: None,
    )
    return episode.run()
