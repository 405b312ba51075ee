"""Deadlines hold inside the LLM's retries under ``-P threads``, where Celery enforces no time limit.

The LLM is an address that accepts connections and never answers (a hung vLLM, a proxy that lost its
upstream). With the default ``LLM_TIMEOUT_S`` (120 s) and ``LLM_RETRIES`` (6), one call used to hold its
thread for up to 7 x 120 s plus back-offs: the Store's watchdog timed the attempt out with no failure class,
and a warm shutdown waited for all of it. Now each try is capped at the episode's remaining budget and the
episode ends at its deadline as ``failed`` with class ``timeout``; the warm shutdown ends with it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.core.settings import load_settings
from bridge.core.task import soft_time_limit
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import attempts, enqueue, rollout, silent_llm_url, wait_finished

pytestmark = pytest.mark.cost(19)

TIMEOUT_SECONDS = 20.0  # the rollout's budget; the episode's own deadline is the soft limit below it
MARGIN_S = 4.0  # reporting the failure: a span flush and one Store update


@pytest.fixture
def silent_llm() -> Iterator[str]:
    with silent_llm_url() as url:
        yield url


def test_a_hanging_llm_ends_the_episode_at_its_deadline_under_threads(
    services: LocalStack, clean_store: LocalStack, silent_llm: str, tmp_path: Path
) -> None:
    soft_s = soft_time_limit(load_settings(store_url="http://127.0.0.1:1"), TIMEOUT_SECONDS)
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=silent_llm,
            workers=1,
            concurrency=2,
            pool="threads",
            log_dir=tmp_path,
            # The defaults: LLM_TIMEOUT_S=120, LLM_RETRIES=6. Streamed spans mark the attempt running early.
            extra_env={"LLM_RETURN_TOKEN_IDS": "false", "SPAN_FLUSH_INTERVAL_S": "1"},
        )
    )
    with stack:
        [rid] = enqueue(
            services.store_url, [{"instruction": "buy a lamp"}], config={"max_attempts": 1, "timeout_seconds": 20}
        )
        started = _wait_started(services.store_url, rid, timeout_s=30)
        # A warm shutdown now: the worker stops taking messages and waits for the running episode.
        worker = stack.workers[0]
        worker.signal(signal.SIGTERM)
        exit_bound = started + soft_s + MARGIN_S
        while worker.alive() and time.time() < exit_bound + 20:
            time.sleep(0.2)
        worker_exited_at = time.time() if not worker.alive() else None
        final = wait_finished(services.store_url, [rid], timeout_s=10)[rid]
        attempt = attempts(services.store_url, rid)[-1]

    meta = attempt.get("metadata") or {}
    assert attempt["status"] == "failed" and meta.get("failure_class") == "timeout", (final["status"], attempt)
    ended_after_s = float(attempt["end_time"]) - float(attempt["start_time"])
    assert ended_after_s <= soft_s + MARGIN_S, (
        f"the attempt ended {ended_after_s:.1f} s after its start; its deadline was {soft_s:.1f} s"
    )
    assert worker_exited_at is not None and worker_exited_at <= exit_bound, (
        "the warm shutdown waited past the episode's deadline for the LLM's retries"
    )


def _wait_started(store_url: str, rollout_id: str, timeout_s: float) -> float:
    """The attempt's start (the dequeue, the Store's clock) once a worker runs it (the first span stored)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = rollout(store_url, rollout_id)
        attempt = view.get("attempt") or {}
        if attempt.get("status") == "running":
            return float(attempt["start_time"])
        time.sleep(0.2)
    raise AssertionError(f"rollout {rollout_id} never started running: {rollout(store_url, rollout_id)}")
