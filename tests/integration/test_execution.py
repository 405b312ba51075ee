"""The core pipeline end to end with real processes: Store, Redis, WebShop, stand-in LLM, celery workers, bridge."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_lab.stack import LocalStack
from tests.helpers import attempts, enqueue, purchases, split_tasks, stack_for, wait_finished

pytestmark = [pytest.mark.integration, pytest.mark.cost(31)]


@pytest.fixture(scope="module")
def pipeline(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Two prefork workers with 4 slots each and one bridge."""
    from tests.helpers import cancel_unfinished

    cancel_unfinished(services.store_url)
    stack = stack_for(services, tmp_path_factory.mktemp("pipeline"), workers=2, concurrency=4)
    stack.start()
    yield stack
    stack.stop()
    cancel_unfinished(services.store_url)


def test_fifty_rollouts_succeed_with_the_reward_the_environment_computed(pipeline: LocalStack) -> None:
    tasks = split_tasks(50)
    rollout_ids = enqueue(pipeline.store_url, tasks)
    final = wait_finished(pipeline.store_url, rollout_ids, timeout_s=240)

    statuses = {rid: r["status"] for rid, r in final.items()}
    assert all(s == "succeeded" for s in statuses.values()), statuses
    for rid, view in final.items():
        history = attempts(pipeline.store_url, rid)
        assert len(history) == 1, f"{rid} has {len(history)} attempts"
        meta = view["attempt"]["metadata"]
        assert meta["celery_task_id"] == view["attempt"]["attempt_id"]
        assert meta["steps"] >= 1
        ledger = purchases(pipeline.webshop_url, meta["env_session_id"])
        if meta["done"]:
            # Exactly one purchase in that session, and the reported reward is the one the server computed.
            assert len(ledger) == 1, (rid, ledger)
            assert meta["reward"] == ledger[0]["reward"]
            assert ledger[0]["task_id"] == view["input"]["task_id"]
        else:
            assert ledger == [] and meta["reward"] == 0.0 and meta["truncated"]
    rewards = [v["attempt"]["metadata"]["reward"] for v in final.values()]
    assert sum(rewards) > 0  # the stand-in policy buys things; an all-zero run would mean a broken loop


def test_malformed_inputs_fail_with_clear_messages_and_the_rest_succeed(pipeline: LocalStack) -> None:
    bad_inputs: list[object] = [
        "just a string",
        {"task_id": "syn_x"},
        {"instruction": 42},
        {"instruction": "   "},
        {"instruction": "x" * 20_000},
    ]
    expected_words = ["JSON object", "no 'instruction'", "must be a string", "is empty", "MAX_INSTRUCTION_CHARS"]
    good = split_tasks(10)
    retrying = {"max_attempts": 3, "retry_condition": ["failed"]}  # bad input must not be retried even so
    bad_ids = enqueue(pipeline.store_url, bad_inputs, config=retrying)
    good_ids = enqueue(pipeline.store_url, good)
    final = wait_finished(pipeline.store_url, bad_ids + good_ids, timeout_s=180)

    for rid, words in zip(bad_ids, expected_words, strict=True):
        view = final[rid]
        assert view["status"] == "failed", view
        meta = view["attempt"]["metadata"]
        assert meta["failure_class"] == "input"
        assert words in meta["error"], meta["error"]
        assert len(attempts(pipeline.store_url, rid)) == 1  # no Celery retry of bad input
    assert all(final[rid]["status"] == "succeeded" for rid in good_ids)


def test_unknown_task_id_fails_as_an_environment_error(pipeline: LocalStack) -> None:
    [rid] = enqueue(pipeline.store_url, [{"instruction": "buy a red shirt", "task_id": "no-such-task"}])
    view = wait_finished(pipeline.store_url, [rid], timeout_s=60)[rid]
    assert view["status"] == "failed"
    meta = view["attempt"]["metadata"]
    assert meta["failure_class"] == "env"
    assert "unknown task_id" in meta["error"]


def test_free_form_instruction_runs_unscored(pipeline: LocalStack, tmp_path: Path) -> None:
    [rid] = enqueue(pipeline.store_url, [{"instruction": "i want a lamp for my desk, price lower than 50.00 dollars"}])
    view = wait_finished(pipeline.store_url, [rid], timeout_s=60)[rid]
    assert view["status"] == "succeeded"
    assert view["attempt"]["metadata"]["reward"] == 0.0
