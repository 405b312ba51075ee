"""The fence: whether a rollout as the Store shows it still waits for this attempt. ``fence`` is the one rule every
read of the rollout is judged by (the attempt's own reads, the shared rounds of ``workers.protocol.fence_board``,
the read before the final report); who may write is decided by the lease (``workers.protocol.write_guard``).
"""

from __future__ import annotations

from bridge.core.store import ACTIVE_ATTEMPT, ACTIVE_ROLLOUT, AttemptedRollout


def fence(rollout: object, attempt_id: str) -> str | None:
    """Why this attempt must not run or report, or None if it is still the rollout's live attempt."""
    if not isinstance(rollout, AttemptedRollout):
        return "the rollout has no attempt"
    if rollout.attempt.attempt_id != attempt_id:
        return f"superseded by attempt {rollout.attempt.attempt_id}"
    if rollout.status not in ACTIVE_ROLLOUT:
        return f"rollout is {rollout.status}"
    if rollout.attempt.status not in ACTIVE_ATTEMPT:
        return f"attempt is {rollout.attempt.status}"
    return None
