"""Handing a claimed rollout back to the Store's queue, only while that is still right.

Every hand-back (the bridge's held rollouts, a failed publish, a stranded attempt, shutdown, a worker's
expired message) goes through ``hand_back``: it re-reads the rollout and writes ``requeuing`` only when
the rollout is still ``preparing`` and its latest attempt is the one we claimed, still ``preparing``. A
rollout the trainer cancelled (the Store leaves its attempt ``preparing``), one that finished, or one
whose attempt started or was superseded is left as it is. The Store has no conditional update, so one
window remains between the read and the write (docs/architecture.md, "Handing a rollout back").
"""

from __future__ import annotations

from bridge.core.infra import UnknownIdError
from bridge.core.store.client import StoreClient
from bridge.core.store.models import AttemptedRollout, AttemptStatus, RolloutStatus


def why_not_requeue(current: object, attempt_id: str) -> str | None:
    """Why the rollout read as ``current`` must not be requeued for ``attempt_id``; None when it may be."""
    status = getattr(current, "status", None)
    if status != RolloutStatus.PREPARING:
        return f"the rollout is {status}"
    if not isinstance(current, AttemptedRollout) or current.attempt.attempt_id != attempt_id:
        return "a later attempt superseded ours"
    if current.attempt.status != AttemptStatus.PREPARING:
        return f"its attempt is {current.attempt.status}"
    return None


def hand_back(store: StoreClient, rollout_id: str, attempt_id: str) -> str | None:
    """Requeue the rollout if it is live and ``attempt_id`` unstarted; returns why not, or None when requeued.

    Raises ``StoreError`` when the Store could not be read or written (the caller retries later).
    """
    try:
        current = store.get_rollout(rollout_id)
    except UnknownIdError:
        return "the Store does not know the rollout"
    reason = why_not_requeue(current, attempt_id)
    if reason is None:
        store.update_rollout(rollout_id, status=RolloutStatus.REQUEUING)
    return reason
