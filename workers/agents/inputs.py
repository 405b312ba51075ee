"""Validation of a rollout's ``input`` before any resource is spent on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.core.infra import InvalidInputError


@dataclass(frozen=True)
class TaskInput:
    """What the agent loop needs from a rollout input: the instruction, and how to pick the goal."""

    instruction: str
    task_id: str | None = None
    goal_id: int | None = None

    def reset_request(self) -> dict[str, Any]:
        """The WebShop reset body: a task id names the scored goal; the instruction is the fallback."""
        if self.task_id is not None:
            return {"task_id": self.task_id}
        if self.goal_id is not None:
            return {"goal_id": self.goal_id}
        return {"instruction": self.instruction}


def parse_task_input(raw: Any, *, max_chars: int) -> TaskInput:
    """Accept ``{"instruction": str, "task_id"?: str, "goal_id"?: int}``; say exactly what is wrong otherwise."""
    if not isinstance(raw, dict):
        raise InvalidInputError(f"rollout input must be a JSON object with an 'instruction', got {type(raw).__name__}")
    instruction = raw.get("instruction")
    if instruction is None:
        raise InvalidInputError("rollout input has no 'instruction' field")
    if not isinstance(instruction, str):
        raise InvalidInputError(f"rollout input 'instruction' must be a string, got {type(instruction).__name__}")
    instruction = instruction.strip()
    if not instruction:
        raise InvalidInputError("rollout input 'instruction' is empty")
    if len(instruction) > max_chars:
        raise InvalidInputError(
            f"rollout input 'instruction' has {len(instruction)} characters, "
            f"more than MAX_INSTRUCTION_CHARS={max_chars}"
        )
    task_id = raw.get("task_id")
    if task_id is not None and (not isinstance(task_id, str) or not task_id.strip() or len(task_id) > 200):
        raise InvalidInputError("rollout input 'task_id' must be a non-empty string of at most 200 characters")
    goal_id = raw.get("goal_id")
    if goal_id is not None:
        if isinstance(goal_id, bool) or not isinstance(goal_id, (int, str)):
            raise InvalidInputError("rollout input 'goal_id' must be an integer")
        try:
            goal_id = int(goal_id)
        except ValueError:
            raise InvalidInputError(f"rollout input 'goal_id' must be an integer, got {goal_id!r}") from None
        if goal_id < 0:
            raise InvalidInputError("rollout input 'goal_id' must not be negative")
    return TaskInput(instruction=instruction, task_id=task_id, goal_id=goal_id)
