"""The chaos audit's observer (``bridge_lab.chaos.state.ChaosRun``) counts a flip only where the Store's status changed.

Two threads observe during a host-loss scenario: the observer's loop and the fault's ``wait_recovered``. A read
answered before the final report, taken into account after a later read that saw the report, looked like
``succeeded`` -> ``running`` with the same attempt: the two flips of docs/cluster.md. Here the earlier read is
held between its answer and its bookkeeping, as a thread descheduled on a loaded machine would be, against the
session's real ``agl store``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from bridge.core.store import RolloutStatus, StoreClient
from bridge_lab.chaos.state import ChaosRun
from bridge_lab.stack import LocalStack
from tests.helpers import split_tasks
from workers.telemetry.spans import AttemptTelemetry

pytestmark = [pytest.mark.integration, pytest.mark.cost(3)]


def _running_rollout(store: StoreClient) -> tuple[str, str]:
    """A rollout dequeued and sent one span: ``running``, as an episode under way reads."""
    [enqueued] = store.enqueue([{"input": split_tasks(1)[0], "mode": "test"}])
    [claimed] = store.dequeue(1, "observer-test")
    assert claimed.rollout_id == enqueued.rollout_id
    telemetry = AttemptTelemetry(
        store, rollout_id=claimed.rollout_id, attempt_id=claimed.attempt.attempt_id, service_name="observer-test"
    )
    with telemetry.span("step"):
        pass
    telemetry.flush()
    assert store.get_rollout(claimed.rollout_id).status == RolloutStatus.RUNNING
    return claimed.rollout_id, claimed.attempt.attempt_id


def test_a_read_taken_before_the_report_and_counted_after_a_later_one_is_no_flip(clean_store: LocalStack) -> None:
    store = StoreClient(clean_store.store_url, retries=3)
    rid, aid = _running_rollout(store)
    run = ChaosRun(clean_store, clean_store, [rid])
    answered, resume = threading.Event(), threading.Event()
    read = run.store.list_rollouts
    first = [True]

    def held_after_its_answer(**kwargs: Any) -> Any:
        answer = read(**kwargs)
        if first[0]:
            first[0] = False
            answered.set()
            assert resume.wait(10)
        return answer

    run.store.list_rollouts = held_after_its_answer  # type: ignore[method-assign]
    try:
        early = threading.Thread(target=run.observe_once)  # the observer's loop: reads `running`, then stalls
        early.start()
        assert answered.wait(10)
        store.update_attempt(rid, aid, status="succeeded", worker_id="observer-test", metadata={"reward": 1.0})
        late = threading.Thread(target=run.observe_once)  # wait_recovered's read: after the report
        late.start()
        late.join(1.0)
        resume.set()
        early.join(10)
        late.join(10)
        assert not early.is_alive() and not late.is_alive()
        assert run.first_final == {rid: RolloutStatus.SUCCEEDED}
        assert not run.flipped, run.notes
        run.observe_once()
        assert not run.flipped and run.latest[rid].status == RolloutStatus.SUCCEEDED
    finally:
        resume.set()
        run.close()
        store.close()
