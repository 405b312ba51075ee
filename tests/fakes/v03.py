"""The 0.3 line's collaborators as plain objects: the Store calls a V03Dispatcher makes, and its publisher."""

from __future__ import annotations

from typing import Any

from bridge.core.store import AttemptedRollout, RolloutStatus
from bridge.core.task import DEFAULT_AGENT
from bridge.dispatch.publisher import Task


def attempted_rollout(
    n: int, mode: str = "train", start_time: float = 1.0, worker_id: str | None = None
) -> AttemptedRollout:
    """Rollout ``ro-<n>`` with its attempt ``at-<n>``, preparing."""
    rid, aid = f"ro-{n}", f"at-{n}"
    attempt = {"rollout_id": rid, "attempt_id": aid, "status": "preparing", "start_time": start_time}
    if worker_id is not None:
        attempt["worker_id"] = worker_id
    return AttemptedRollout.model_validate({"rollout_id": rid, "status": "preparing", "mode": mode, "attempt": attempt})


class Store:
    """The Store calls the V03Dispatcher makes: ``dequeue`` takes up to ``limit`` from the head of the queue."""

    def __init__(self, queue: list[AttemptedRollout], dequeue_error: Exception | None = None) -> None:
        self.queue = list(queue)
        self.dequeue_error = dequeue_error
        self.rollouts = {r.rollout_id: r for r in queue}
        self.requeued: list[str] = []

    def dequeue(self, limit: int, worker_id: str) -> list[AttemptedRollout]:
        if self.dequeue_error is not None:
            error, self.dequeue_error = self.dequeue_error, None
            raise error
        batch, self.queue = self.queue[:limit], self.queue[limit:]
        return batch

    def get_rollout(self, rollout_id: str) -> AttemptedRollout:
        return self.rollouts[rollout_id]

    def update_rollout(self, rollout_id: str, **fields: Any) -> None:
        assert fields == {"status": RolloutStatus.REQUEUING}
        self.requeued.append(rollout_id)

    def list_rollouts(self, **_: Any) -> tuple[list[AttemptedRollout], int]:
        return list(self.rollouts.values()), len(self.rollouts)


class Publisher:
    """Records what it publishes; raises ``error`` for the rollout ids in ``fail``."""

    def __init__(self, fail: set[str] = frozenset(), error: Exception | None = None) -> None:  # type: ignore[assignment]
        self.fail, self.error = fail, error or RuntimeError("a bug in the publish path")
        self.published: list[tuple[str, str]] = []

    agent = DEFAULT_AGENT

    def send(self, task: Task) -> None:
        rollout_id = task.kwargs["rollout"]["rollout_id"]
        if rollout_id in self.fail:
            raise self.error
        self.published.append((rollout_id, task.queue))

    def close(self) -> None:
        self.closed = True
