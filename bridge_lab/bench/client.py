"""The benchmark's own Store client: raw REST calls, each one counted.

The Store's Prometheus counters count every client's requests, the benchmark's too; what this client
sends is subtracted from them (``metrics.diff_counts``), so the figures count only the executors'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from bridge.core.store import API, FINISHED_ROLLOUT
from bridge_lab.rollouts import finished_among, wait_for_rollouts


class BenchClient:
    """The benchmark's own Store calls, counted so they can be subtracted from the Store's counters."""

    def __init__(self, store_url: str) -> None:
        self.url = store_url
        self.http = httpx.Client(base_url=store_url + API, timeout=60)
        self.own: dict[str, float] = {}

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        key = f"{method} {API}{path}"
        self.own[key] = self.own.get(key, 0.0) + 1
        response = self.http.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def enqueue(self, inputs: list[dict[str, Any]], resources_id: str) -> list[str]:
        ids: list[str] = []
        for start in range(0, len(inputs), 500):
            chunk = inputs[start : start + 500]
            body = {"rollouts": [{"input": i, "mode": "train", "resources_id": resources_id} for i in chunk]}
            ids += [r["rollout_id"] for r in self.call("POST", "/queues/rollouts/enqueue", json=body)]
        return ids

    def finished(self, ids: list[str]) -> dict[str, str]:
        """The finished ones among ``ids`` (rollout id -> status), through a counted request."""
        body = {"rollout_ids": ids, "timeout": 0}
        return {r["rollout_id"]: str(r["status"]) for r in self.call("POST", "/waits/rollouts", json=body)}

    def finished_count(self) -> int:
        """How many rollouts the Store holds in a final status: one counted request (``limit=1``, read ``total``)."""
        params: list[tuple[str, str | int]] = [("status_in", str(s)) for s in sorted(FINISHED_ROLLOUT)]
        return int(self.call("GET", "/rollouts", params=[*params, ("limit", 1)])["total"])

    def wait(self, ids: list[str], timeout_s: float) -> set[str]:
        """Until every rollout of ``ids`` finished or ``timeout_s`` passed; returns the finished ids."""
        return set(wait_for_rollouts(self.finished, ids, timeout_s))

    def wait_counted(
        self, ids: list[str], finished_before: int, timeout_s: float, on_progress: Callable[[int], None] | None = None
    ) -> set[str]:
        """``wait`` for a workload, whose polling must not load the Store it measures.

        The Store's ``/waits/rollouts`` checks each id it is given, and a running rollout's check is costly: with
        1,000 pending ids and 128 running attempts, a poll a second cost the Store 79 ms of CPU a second (against
        3 ms idle, measured on an ``agl store`` alone), which the figures counted as the executor's: about 10 ms
        of "Store CPU per rollout" at 128 slots of 2,000 ms calls. So progress is read from the count of finished
        rollouts (``finished_before``: the count before ``ids`` were enqueued), and the ids are checked only once
        the count says they may all be done, and at the end. ``on_progress`` gets the number finished.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.finished_count() - finished_before
            if on_progress is not None:
                on_progress(min(done, len(ids)))
            if done >= len(ids) or time.monotonic() >= deadline:
                finished = set(finished_among(self.finished, ids))
                if len(finished) == len(ids) or time.monotonic() >= deadline:
                    return finished
            time.sleep(1.0)

    def rollouts(self, ids: list[str]) -> list[dict[str, Any]]:
        views: list[dict[str, Any]] = []
        for start in range(0, len(ids), 100):
            params = [("rollout_id_in", r) for r in ids[start : start + 100]]
            views += self.call("GET", "/rollouts", params=params)["items"]
        return views

    def stored_trace(self, ids: list[str], sample: int = 10) -> dict[str, float | None]:
        """What the Store holds per rollout for a sample of ``ids`` (their latest attempts): spans and token
        ids (``prompt_token_ids`` + ``response_token_ids``), read back the same way for both executors, so a
        comparison at "equal trace volume" can be checked rather than assumed."""
        picked = ids[:: max(1, len(ids) // sample)][:sample]
        spans = tokens = 0
        for rollout_id in picked:
            items = self.call("GET", "/spans", params={"rollout_id": rollout_id, "attempt_id": "latest"})["items"]
            spans += len(items)
            for item in items:
                attributes = item.get("attributes") or {}
                tokens += sum(len(attributes.get(k) or []) for k in ("prompt_token_ids", "response_token_ids"))
        n = len(picked)
        return {
            "stored_spans_per_rollout": round(spans / n, 2) if n else None,
            "stored_token_ids_per_rollout": round(tokens / n, 1) if n else None,
        }

    def store_capacity_rps(self, seconds: float = 2.0) -> float:
        """Cheapest W-request rate one client reaches: the ceiling that bounds any executor at 0 ms."""
        done, deadline = 0, time.monotonic() + seconds
        started = time.monotonic()
        while time.monotonic() < deadline:
            self.call("POST", "/queues/rollouts/dequeue", json={"limit": 0})
            done += 1
        return done / (time.monotonic() - started)


# --- figures -------------------------------------------------------------------------------------
