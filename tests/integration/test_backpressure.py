"""Backpressure per queue, with real workers: the bridge never claims more rollouts for a queue than
that queue's workers can start now (docs/architecture.md, hop 1).

The operator's set-up of docs/operations.md ("A queue per mode"):
``QUEUE_BY_MODE=train=rollouts-train,val=rollouts-val,test=rollouts-val``,
one worker consuming only ``rollouts-train`` and one only ``rollouts-val`` (4 slots each), LLM calls of
200 ms. The Store is sampled while the rollouts run: a rollout is *claimed* from its dequeue (its
attempt clock runs, docs/store-protocol.md 6.3) until it finishes, so ``preparing`` + ``running`` per
mode is what the bridge holds for that mode's queue. The bound allows one batch on top of the slots:
a dequeue whose answer is in the bridge's hands and not yet published is claimed too.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from bridge.core.store import API
from bridge_lab.stack import LocalStack, StackConfig
from tests.helpers import split_tasks, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(75)]

SLOTS = 4
MAX_BATCH = 4
QUEUE_ENV = {
    "QUEUE_BY_MODE": "train=rollouts-train,val=rollouts-val,test=rollouts-val",
    "BRIDGE_MAX_BATCH": str(MAX_BATCH),
    "BRIDGE_POLL_MIN_S": "0.1",
    "BRIDGE_POLL_MAX_S": "0.5",
}


class ClaimSampler:
    """Counts the Store's ``preparing``/``running`` rollouts per mode every 100 ms; keeps each mode's peak."""

    def __init__(self, store_url: str) -> None:
        self.store_url = store_url
        self.peak: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-sampler", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                params: dict[str, Any] = {"status_in": ["preparing", "running"], "limit": 1000}
                try:
                    items = client.get(f"{self.store_url}{API}/rollouts", params=params).json()["items"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                now = Counter(str(item.get("mode")) for item in items)
                for mode, count in now.items():
                    self.peak[mode] = max(self.peak[mode], count)
                self.samples += 1
                self._stop.wait(0.1)

    def __enter__(self) -> ClaimSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@contextmanager
def train_and_val_workers(services: LocalStack, log_dir: Path) -> Iterator[LocalStack]:
    """One node on rollouts-train only, one on rollouts-val only, then the bridge; an LLM stand-in at 200 ms."""
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=None,  # our own stand-in, with latency, so episodes last long enough to pile up
            policy_latency_ms=200.0,
            workers=1,
            concurrency=SLOTS,
            queues="rollouts-train",
            bridge=False,
            bridge_metrics_port=0,
            log_dir=log_dir,
            extra_env=QUEUE_ENV,
        )
    )
    with stack:
        stack.config.queues = "rollouts-val"
        stack.add_worker()
        stack.start_bridge()
        yield stack


def enqueue_modes(store_url: str, modes: list[str]) -> list[str]:
    tasks = split_tasks(len(modes))
    body = {"rollouts": [{"input": task, "mode": mode} for task, mode in zip(tasks, modes, strict=True)]}
    response = httpx.post(f"{store_url}{API}/queues/rollouts/enqueue", json=body, timeout=30)
    response.raise_for_status()
    return [item["rollout_id"] for item in response.json()]


def bridge_counter(stack: LocalStack, name: str) -> float:
    """One series of the bridge's /metrics (summed over labels)."""
    assert stack.bridge_metrics_url is not None
    text = httpx.get(stack.bridge_metrics_url, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def run_load(services: LocalStack, log_dir: Path, modes: list[str]) -> tuple[Counter[str], dict[str, Any], float]:
    with train_and_val_workers(services, log_dir) as stack, ClaimSampler(services.store_url) as sampler:
        ids = enqueue_modes(services.store_url, modes)
        views = wait_finished(services.store_url, ids, timeout_s=240)
        dequeues = bridge_counter(stack, "agl_bridge_dequeue_requests_total")
    assert sampler.samples > 20
    statuses = Counter(view["status"] for view in views.values())
    print(f"peak claimed per mode: {dict(sampler.peak)}; statuses {dict(statuses)}; {dequeues:.0f} dequeue requests")
    return sampler.peak, dict(statuses), dequeues


def test_one_busy_queue_is_never_claimed_beyond_its_slots(clean_store: LocalStack, tmp_path: Path) -> None:
    """40 train rollouts, 4 train slots, 4 idle val slots: idle val slots must not pull train rollouts."""
    peak, statuses, dequeues = run_load(clean_store, tmp_path, ["train"] * 40)
    assert statuses == {"succeeded": 40}
    assert peak["train"] <= SLOTS + MAX_BATCH, peak
    assert dequeues <= 2 * 40 + 60, dequeues  # about one request per rollout while train is full, plus polls


@pytest.mark.nightly("one queue held within its slots: the test above, every run")
def test_a_mixed_load_keeps_each_queue_within_its_slots(clean_store: LocalStack, tmp_path: Path) -> None:
    """30 train and 10 val, shuffled: each queue's claims stay within its own slots (plus one batch)."""
    modes = ["train"] * 30 + ["val"] * 10
    random.Random(15).shuffle(modes)
    peak, statuses, _ = run_load(clean_store, tmp_path, modes)
    assert statuses == {"succeeded": 40}
    assert peak["train"] <= SLOTS + MAX_BATCH, peak
    assert peak["val"] <= SLOTS + MAX_BATCH, peak
