"""The WebShop episode as the benchmark's other executors run it (the peer and the floor): one place, so
both run exactly what our task runs (``workers.agent.Episode``) and differ only in what surrounds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bridge.core.settings import Settings
    from workers.agent import EpisodeResult
    from workers.inputs import TaskInput
    from workers.llm import LLMTarget
    from workers.telemetry import AttemptTelemetry
    from workers.webshop import WebShopClient


def run_episode(
    task: TaskInput, env: WebShopClient, target: LLMTarget, telemetry: AttemptTelemetry, settings: Settings
) -> EpisodeResult:
    """One episode with nothing to stop it early; its spans stay in ``telemetry`` for the caller to flush."""
    from workers import llm as llm_mod
    from workers.agent import Episode

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
