"""Waiting for rollouts to finish, written once for the demo and the benchmark.

The Store answers ``POST /waits/rollouts`` with the rollouts of a list that are finished; asking with a
zero timeout and sleeping in between keeps every request short (a paused or slow Store cannot hold a
caller past its own deadline) and lets the caller report progress between polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from bridge.core.store import StoreClient

FinishedPoll = Callable[[list[str]], Mapping[str, str]]
"""Given rollout ids, the finished ones among them: rollout id -> final status."""

CHUNK = 1000  # ids per wait request: the Store reads them all from one request body


def store_poll(store: StoreClient) -> FinishedPoll:
    """The poll through a ``StoreClient`` (the benchmark brings its own, to count its requests)."""

    def finished(ids: list[str]) -> dict[str, str]:
        return {item.rollout_id: str(item.status) for item in store.wait_rollouts(ids, timeout_s=0)}

    return finished


def finished_among(poll: FinishedPoll, rollout_ids: list[str]) -> dict[str, str]:
    """One round of ``poll`` over ``rollout_ids``, ``CHUNK`` ids a request."""
    finished: dict[str, str] = {}
    for start in range(0, len(rollout_ids), CHUNK):
        finished.update(poll(rollout_ids[start : start + CHUNK]))
    return finished


def wait_for_rollouts(
    poll: FinishedPoll,
    rollout_ids: list[str],
    timeout_s: float,
    *,
    on_progress: Callable[[Mapping[str, str]], None] | None = None,
    interval_s: float = 1.0,
) -> dict[str, str]:
    """Poll until every rollout finished or ``timeout_s`` passed; returns rollout id -> status of the finished.

    ``on_progress`` sees the finished map after every round (progress bars, memory marks). Rollouts not in
    the result did not finish in time; the caller decides whether that is an error.
    """
    finished: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(rollout_ids) and time.monotonic() < deadline:
        finished.update(finished_among(poll, [r for r in rollout_ids if r not in finished]))
        if on_progress is not None:
            on_progress(finished)
        if len(finished) < len(rollout_ids):
            time.sleep(interval_s)
    return finished
