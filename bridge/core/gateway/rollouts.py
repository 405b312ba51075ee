"""An Agent Lightning 1.0 rollout as the bridge and the workers read it: its shape, the names of a 1.0 attempt's task
and Redis keys (docs/agl-v1.md), and the environment 1.0's ``local`` runner gives an agent program.

Models of our own, never an ``agentlightning`` import: one install serves 0.3 and 1.0 users. A 1.0 rollout has one
attempt id at a time (``last_attempt_id``); the gateway serves the trainer the events of that attempt only, so a
re-run under a new id leaves the lost attempt's events out of training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, ValidationError

V1_TASK_NAME = "workers.run_v1_rollout"
"""The task that runs one 1.0 attempt; its id is ``attempt_key(rollout_id, attempt_id)``."""

FIRST_ATTEMPT = "0"  # 1.0's own runners only ever use this one


class V1State(StrEnum):
    QUEUING = "queuing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class V1LocalConfig(BaseModel):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class V1Config(BaseModel):
    timeout_seconds: int = 3600
    local: V1LocalConfig | None = None


class V1Status(BaseModel):
    state: V1State = V1State.QUEUING
    last_attempt_id: str | None = None
    error_message: str | None = None
    created_at: float | None = None
    updated_at: float | None = None


class V1Rollout(BaseModel):
    """The fields of a 1.0 rollout this project reads; the rest of the gateway's answer is ignored."""

    rollout_id: str
    input: Any = None
    is_train: bool = True
    config: V1Config = Field(default_factory=V1Config)
    status: V1Status = Field(default_factory=V1Status)

    @property
    def mode(self) -> str:
        """The proxy's path segment: ``train`` or ``val``."""
        return "train" if self.is_train else "val"


@dataclass(frozen=True)
class Malformed:
    """A rollout of the gateway's listing that ``V1Rollout`` rejects: ``reason`` names the fields at fault.
    ``rollout_id`` is None when even that is unreadable (nothing can then be done with it on the gateway)."""

    rollout_id: str | None
    state: str | None
    reason: str


def parse_rollout(item: Any) -> V1Rollout | Malformed:
    """One item of a listing: the rollout, or why it cannot be run (never raises)."""
    try:
        return V1Rollout.model_validate(item)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'rollout'}: {error['msg']}" for error in exc.errors()
        )
        raw = item if isinstance(item, dict) else {}
        rid = raw.get("rollout_id")
        status = raw.get("status")
        state = status.get("state") if isinstance(status, dict) else None
        return Malformed(
            rid if isinstance(rid, str) and rid else None,
            state if isinstance(state, str) else None,
            f"invalid rollout: {problems}",
        )


def attempt_key(rollout_id: str, attempt_id: str) -> str:
    """One 1.0 attempt's name in Celery and Redis: its task id, in-flight entry, lease, started and done keys.

    Deterministic, so a dispatcher restarted between publish and patch publishes the same task again and the
    worker's lease and done marker drop the second delivery."""
    return f"v1-{rollout_id}-{attempt_id}"


def scoped_attempt_key(scope: str, rollout: V1Rollout, attempt_id: str) -> str:
    """The name of one attempt's Redis state (lease, owner, started and done markers, kept result): ``attempt_key``
    under deployment ``scope`` (``bridge.core.coordination.connection.deployment_scope``) and the rollout's creation
    time on the gateway, so deployments sharing a Redis never read each other's, and a rollout id that a restarted
    gateway hands out again is a new attempt rather than one that finished already."""
    created = rollout.status.created_at
    generation = f"{created:.6f}" if created is not None else "0"
    return f"{scope}:{generation}:{attempt_key(rollout.rollout_id, attempt_id)}"


def agent_environment(rollout: V1Rollout, attempt_id: str, *, agent_url: str, key: str | None) -> dict[str, str]:
    """The variables 1.0's ``local`` runner gives an agent program, for this attempt: the proxy's OpenAI base
    URL, the events URL, the key, and each ``config.local.env_map`` entry resolved from the input (a string
    as is, anything else as JSON). ValueError names an ``env_map`` path the input lacks."""
    root = agent_url.rstrip("/")
    rid = rollout.rollout_id
    env = {
        "AGL_KEY": key or "",
        "AGL_OPENAI_BASE_URL": f"{root}/proxy/rollout/{rid}/attempt/{attempt_id}/mode/{rollout.mode}/openai/v1",
        "AGL_EVENT_URL": f"{root}/api/rollouts/{rid}/attempt/{attempt_id}/events",
    }
    local = rollout.config.local or V1LocalConfig()
    for name, path in local.env_map.items():
        value = _input_at(rollout.input, path)
        env[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return env


def _input_at(task_input: Any, path: str) -> Any:
    """``input`` is the whole input, ``input.a.0.b`` a path into it; any other string is a literal."""
    if path == "input":
        return task_input
    if not path.startswith("input."):
        return path
    value = task_input
    for part in path.split(".")[1:]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ValueError(f"config.local.env_map path {path!r} is not in the rollout's input")
    return value
