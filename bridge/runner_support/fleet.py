"""Which agent the trainer expects, and which online worker nodes run another one.

A worker node is told its agent by its operator (``AGENT``) and advertises the agent's import path in Redis
beside its slots (``bridge.core.coordination.keys.worker_agent``, scoped by its deployment's Store like the slots). A
message never makes a worker import anything: it only names the agent the sender expects, and a worker
running another refuses it. So a trainer whose agent
no worker runs would see its rollouts refused one by one; ``CeleryRunner.init`` reads the advertisements
first and fails at once, naming the workers that disagree.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from bridge.core.coordination.capacity import advertised_agents, listed_scopes
from bridge.core.task import agent_identity

log = logging.getLogger("bridge.runner")


class AgentMismatchError(RuntimeError):
    """Online workers run another agent than the one the runner was given.

    ``mismatched`` maps each such worker node to the agent path it advertises.
    """

    def __init__(self, expected: str, mismatched: dict[str, str]) -> None:
        self.expected = expected
        self.mismatched = dict(mismatched)
        listed = ", ".join(f"{node} runs {agent!r}" for node, agent in sorted(mismatched.items()))
        hint = ""
        if expected.startswith("__main__:"):
            hint = (
                " The agent class is defined in the script being run (__main__), which no worker can import:"
                " move it into a module and name that module in AGENT."
            )
        super().__init__(
            f"CeleryRunner executes agent {expected!r}, but online workers run another one: {listed}. "
            f"Start those workers with AGENT={expected} (or stop them).{hint}"
        )


def agent_path(agent: Any) -> str:
    """The import path a LitAgent stands for: ``module:QualifiedClassName`` of its class.

    The workers advertise the same spelling for the agent ``AGENT`` names, so the two compare as strings.
    """
    return agent_identity(agent)


def check_fleet(client: redis.Redis, scope: str | None, queues: list[str], expected: str) -> dict[str, str | None]:
    """Raise AgentMismatchError when a live worker of the deployment ``scope`` runs another agent; returns
    what was read (``bridge.core.coordination.connection.deployment_scope``: workers of other Stores are not looked at).
    With ``scope`` None (the Store is not known yet) the workers of every Store on ``queues`` are checked.

    No worker online is not an error (workers may start after the trainer: rollouts wait in the Store
    until one does), only a warning; a node that advertises slots but no agent yet is logged and let be.
    """
    advertised: dict[str, str | None] = {}
    for each in sorted(listed_scopes(client, queues)) if scope is None else [scope]:
        advertised.update(advertised_agents(client, each, queues))
    if not advertised:
        log.warning(
            "no worker consumes queues %s yet%s: rollouts wait in the Store until one starts with AGENT=%s and "
            "names the Store by the same URL (AGENT_LIGHTNING_STORE_URL)",
            ", ".join(queues),
            f" for this Store (Redis key scope {scope})" if scope else "",
            expected,
        )
        return advertised
    mismatched = {node: agent for node, agent in advertised.items() if agent is not None and agent != expected}
    if mismatched:
        raise AgentMismatchError(expected, mismatched)
    silent = sorted(node for node, agent in advertised.items() if agent is None)
    if silent:
        log.warning("workers %s advertise slots but no agent yet; their agent is not checked", ", ".join(silent))
    return advertised
