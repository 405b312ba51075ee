"""How one attempt ended, as both lines' workers write it and the dispatcher reads it: ``Outcome`` and its codec.

One record serves three readers: the Celery task's result (``Outcome.as_dict``: Flower, the worker's metrics), the
record a 1.0 worker keeps in Redis for its dispatcher (``Outcome.to_json`` / ``Outcome.parse`` at
``keys.v1_result``), and the error a trainer reads (the 0.3 Store's ``error`` metadata, the 1.0 gateway's
``error_message``: ``error_text``, ``failed_message``). The rules for an error's text are applied here, once:

* **redaction**: every detail is masked by ``redact_text`` when the record is made, so no line sends a secret;
* **truncation**: an error keeps its first line (what happened, up to ``HEADLINE_CHARS``) and the tail of the
  rest (a program's or a traceback's last lines), never the middle (docs/operations.md, "Failure classes");
* **failure class**: a line whose error has no field of its own for it (1.0's ``error_message``) starts the text
  with ``[failure class: x]``, written by ``failed_message`` and read back by ``failure_class_of``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bridge.core.infra import redact_text

ERROR_CHARS = 2000  # of a failed attempt's error, what the trainer's side is sent
HEADLINE_CHARS = 500  # of an error, the first line kept whole up to this
DETAIL_CHARS = 4000  # of an outcome's detail, what a record holds
_PREFIX = "[failure class: "


class FailureClass(StrEnum):
    """Why an attempt did not succeed; ``workers.protocol.failures.classify`` maps an exception to one."""

    INFRA = "infra"  # broker, Store, gateway, network, worker lost
    ENV = "env"  # the WebShop server failed
    LLM = "llm"  # the LLM endpoint failed after retries
    INPUT = "input"  # the rollout's input cannot be run
    TELEMETRY = "telemetry"  # spans (the reward span above all) could not be delivered
    TIMEOUT = "timeout"  # the episode ran out of its time budget
    CANCELLED = "cancelled"  # the rollout was cancelled or superseded while running
    AGENT = "agent"  # the agent (a LitAgent, a 1.0 program) failed, returned something unsupported, or is not expected
    SHUTDOWN = "shutdown"  # the worker drained (WORKER_SHUTDOWN_GRACE_S) before the episode finished


class OutcomeStatus(StrEnum):
    """The delivery's outcome, not the Store's or the gateway's attempt status."""

    SUCCEEDED = "succeeded"  # a succeeded report reached the trainer's side (or is kept for one to send it)
    FAILED = "failed"  # a failed report reached the trainer's side (or is kept for one to send it)
    SKIPPED = "skipped"  # nothing reported by this delivery (a duplicate, fenced, moved on, handed over)


def error_text(detail: str, limit: int = ERROR_CHARS) -> str:
    """``detail`` in at most ``limit`` characters: its first line (up to ``HEADLINE_CHARS`` when more follows),
    then as much of the rest's tail as fits."""
    head, newline, rest = detail.partition("\n")
    head = head[: HEADLINE_CHARS if rest else max(0, limit)]
    room = limit - len(head) - len(newline)
    return head + newline + (rest[-room:] if room > 0 and rest else "")


def failed_message(failure_class: str | None, detail: str, limit: int = ERROR_CHARS) -> str:
    """A failed attempt's error where the class has no field of its own: ``[failure class: x] `` then
    ``error_text`` of the detail, at most ``limit`` characters in all."""
    prefix = f"{_PREFIX}{failure_class}] " if failure_class else ""
    return prefix + error_text(detail, max(0, limit - len(prefix)))


def failure_class_of(message: str) -> str | None:
    """The class a ``failed_message`` names, or None when it names none."""
    if not message.startswith(_PREFIX) or "]" not in message:
        return None
    return message[len(_PREFIX) :].split("]", 1)[0]


@dataclass(frozen=True)
class Outcome:
    """How one delivery of an attempt ended. ``detail`` is masked and bounded (``DETAIL_CHARS``) on creation;
    ``failure_class`` says why it did not succeed; ``handover`` (skipped, class ``shutdown``): a draining worker
    stopped the attempt, to run again elsewhere without counting as a failure."""

    status: OutcomeStatus
    detail: str = ""
    failure_class: FailureClass | None = None
    reward: float | None = None
    handover: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", error_text(redact_text(self.detail), DETAIL_CHARS))

    @property
    def state(self) -> str | None:
        """The reported state (``succeeded`` or ``failed``), None when this delivery reports nothing."""
        return None if self.status is OutcomeStatus.SKIPPED else str(self.status)

    @property
    def headline(self) -> str:
        """The detail's first line: what happened."""
        return self.detail.partition("\n")[0]

    def message(self) -> str:
        """What the 1.0 gateway is told: a failure's ``failed_message``, else the detail."""
        if self.status is not OutcomeStatus.FAILED:
            return self.detail
        return failed_message(self.failure_class, self.detail)

    def as_dict(self) -> dict[str, Any]:
        """The task's return value: plain JSON strings (never enum objects), empty fields left out."""
        data = {
            "status": str(self.status),
            "reason": self.detail,
            "failure_class": None if self.failure_class is None else str(self.failure_class),
            "reward": self.reward,
        }
        return {k: v for k, v in data.items() if v not in (None, "")}

    def to_json(self) -> str:
        """The kept record: JSON ``{"state", "detail", "failure_class", "handover"}`` (``reward`` when set)."""
        data: dict[str, Any] = {
            "state": self.state,
            "detail": self.detail,
            "failure_class": None if self.failure_class is None else str(self.failure_class),
            "handover": self.handover,
        }
        if self.reward is not None:
            data["reward"] = self.reward
        return json.dumps(data, allow_nan=False)

    @classmethod
    def parse(cls, raw: str | bytes) -> Outcome:
        """A kept record (``failure_class``, ``handover`` and ``reward`` optional); ValueError when ``raw`` is not
        one."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        state, failure_class, reward = data.get("state"), data.get("failure_class"), data.get("reward")
        if failure_class is not None and not isinstance(failure_class, str):
            raise ValueError(f"failure_class {failure_class!r} is not a string")
        if state is not None and state not in (OutcomeStatus.SUCCEEDED, OutcomeStatus.FAILED):
            raise ValueError(f"state {state!r} is not succeeded, failed or null")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise ValueError(f"reward {reward!r} is not a number")
        return cls(
            OutcomeStatus(state) if state is not None else OutcomeStatus.SKIPPED,
            str(data.get("detail", "")),
            FailureClass(failure_class) if failure_class else None,
            None if reward is None else float(reward),
            data.get("handover") is True,
        )


def skipped(log: logging.Logger | logging.LoggerAdapter[Any], reason: str) -> Outcome:
    """Log why this delivery writes nothing and return its ``skipped`` outcome."""
    log.warning("%s", reason)
    return Outcome(OutcomeStatus.SKIPPED, reason)
