"""Rollouts the bridge holds, and hand-backs that respect a cancel: real Store, Redis, bridge and workers.

``QUEUE_BY_MODE`` routes ``val`` to a queue that no worker consumes at first. The bridge holds the val
rollouts it claims (``bridge.dispatch.v03.hold``) and goes on dispatching train rollouts; ``status`` and the
metrics name the unserved queue. A val rollout the trainer cancels while held is dropped, and stays
cancelled when a val worker starts. Every hand-back re-reads the rollout first (``bridge.core.store.handback``).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from bridge.core.coordination import coordination_client
from bridge.core.settings import load_settings
from bridge.core.store import API, StoreClient, handback
from bridge.ops import status
from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, rollout, stack_for, wait_finished, wait_for
from workers.lifecycle.steps.expired import hand_back_expired

pytestmark = [pytest.mark.integration, pytest.mark.cost(40)]

QUEUE_ENV = {
    "QUEUE_BY_MODE": "train=rollouts-train,val=rollouts-val",
    "BRIDGE_RECONCILE_INTERVAL_S": "2",  # the scan that drops cancelled held rollouts (an ordinary setting)
}


def metric(stack: LocalStack, series: str) -> float:
    """One labelled series of the bridge's /metrics, e.g. ``agl_bridge_held_rollouts{queue="rollouts-val"}``."""
    assert stack.bridge_metrics_url is not None
    for line in httpx.get(stack.bridge_metrics_url, timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def cancel(store_url: str, rollout_id: str) -> None:
    response = httpx.post(f"{store_url}{API}/rollouts/{rollout_id}", json={"status": "cancelled"}, timeout=30)
    response.raise_for_status()


def test_an_unserved_queue_never_stalls_the_others_and_a_held_rollout_cancelled_stays_cancelled(
    clean_store: LocalStack, tmp_path: Path
) -> None:
    stack = stack_for(
        clean_store,
        tmp_path,
        workers=1,
        concurrency=2,
        queues="rollouts-train",
        bridge_metrics_port=0,
        extra_env=QUEUE_ENV,
    )
    with stack:
        held_series = 'agl_bridge_held_rollouts{queue="rollouts-val"}'
        val = enqueue(stack.store_url, [{"instruction": f"val {i}"} for i in range(2)], mode="val")
        started = time.monotonic()
        train = enqueue(stack.store_url, [{"instruction": f"train {i}"} for i in range(6)], mode="train")
        final = wait_finished(stack.store_url, train, timeout_s=60)
        train_s = time.monotonic() - started
        assert {view["status"] for view in final.values()} == {"succeeded"}, final
        # Before, the first val rollout stopped every claim for 30 s, then the second one for 30 s more.
        assert train_s < 25, f"6 train rollouts took {train_s:.1f}s behind 2 held val rollouts"

        wait_for(lambda: metric(stack, held_series) == 2, 10, "both val rollouts held")
        assert metric(stack, 'agl_bridge_unserved_queue{queue="rollouts-val"}') == 1
        assert metric(stack, 'agl_bridge_unserved_queue{queue="rollouts-train"}') == 0
        settings = load_settings(
            store_url=stack.store_url, broker_url=stack.broker_url, queue_by_mode=QUEUE_ENV["QUEUE_BY_MODE"]
        )
        with StoreClient.from_settings(settings) as store:
            report = status.collect(settings, store, coordination_client(stack.broker_url), inspect=False)
        assert report["broker"]["unserved"] == ["rollouts-val"]
        assert report["broker"]["queues"]["rollouts-val"]["held"] == 2
        assert "no worker consumes queue rollouts-val: the bridge holds 2 rollouts" in status.render(report)
        assert {rollout(stack.store_url, rid)["status"] for rid in val} == {"preparing"}  # held, not cycled

        cancel(stack.store_url, val[0])
        wait_for(lambda: metric(stack, held_series) == 1, 15, "the cancelled rollout dropped from the hold")

        stack.config.queues = "rollouts-val"
        stack.add_worker()
        done = wait_finished(stack.store_url, [val[1]], timeout_s=60)
        assert done[val[1]]["status"] == "succeeded", done
        time.sleep(2.0)  # a reconcile round more: nothing brings the cancelled one back
        assert rollout(stack.store_url, val[0])["status"] == "cancelled"
        assert [a["status"] for a in attempts(stack.store_url, val[0])] == ["preparing"]  # claimed once, never run
        assert metric(stack, 'agl_bridge_unserved_queue{queue="rollouts-val"}') == 0
        assert metric(stack, 'agl_bridge_handed_back_total{reason="no_room"}') == 0


def test_a_hand_back_requeues_only_a_live_unstarted_attempt(clean_store: LocalStack) -> None:
    """Cancelled, started, superseded: left as they are, by the bridge's and the worker's hand-back alike."""
    ids = enqueue(clean_store.store_url, [{"instruction": f"hand back {i}"} for i in range(4)])
    settings = load_settings(store_url=clean_store.store_url, broker_url=clean_store.broker_url)
    with StoreClient.from_settings(settings) as store:
        claimed = {r.rollout_id: r for r in store.dequeue(4, "tests-hand-back")}
        assert set(claimed) == set(ids)
        cancelled, started, superseded, live = ids
        cancel(clean_store.store_url, cancelled)
        store.update_attempt(started, claimed[started].attempt.attempt_id, status="running")
        store.update_rollout(superseded, status="requeuing")
        [again] = store.dequeue(1, "tests-hand-back")
        assert again.rollout_id == superseded

        assert handback.hand_back(store, cancelled, claimed[cancelled].attempt.attempt_id) == "the rollout is cancelled"
        hand_back_expired(claimed[cancelled].model_dump(mode="json"), store)  # a worker's expired message
        assert handback.hand_back(store, started, claimed[started].attempt.attempt_id) == "the rollout is running"
        why = handback.hand_back(store, superseded, claimed[superseded].attempt.attempt_id)
        assert why == "a later attempt superseded ours"
        assert handback.hand_back(store, live, claimed[live].attempt.attempt_id) is None

    statuses = {rid: rollout(clean_store.store_url, rid)["status"] for rid in ids}
    assert statuses == {cancelled: "cancelled", started: "running", superseded: "preparing", live: "requeuing"}
