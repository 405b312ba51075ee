"""What the operator configured the workers to run: ``AGENT`` and ``AGENT_HOOKS``, imported once per process.

The paths come from the worker's own settings, never from a broker message: a message names the agent it
expects only so that ``ConfiguredAgent.accepts`` can refuse a rollout meant for another (its ``AGENT`` string or
the built agent's identity, ``bridge.core.task.message.agent_identity``). An agent path names a ``LitAgent``
subclass, instance or zero-argument factory (``@agentlightning.rollout`` functions included), a hook path a
``Hook`` the same way. ``agentlightning`` is imported only when ``AGENT`` is not ``webshop``, so the built-in
agent needs no ``agl`` extra. Operator's view: docs/operations.md, "Running your own agent".
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from bridge.core.infra import ConfigError
from bridge.core.settings import WorkerSettings
from bridge.core.task import DEFAULT_AGENT, agent_identity
from workers.lifecycle import state

log = logging.getLogger("workers.agents")

INSTALL_HINT = "pip install -e '.[agl]'"


def require_agentlightning() -> Any:
    """The ``agentlightning`` module, or a start-up error (exit code 2) saying how to install it."""
    # agentlightning imports litellm, which otherwise fetches its model cost map from the internet at import
    # (three tries, ~8 s on a cluster without egress); the copy it ships is all a worker needs.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # agentops (imported with agentlightning) otherwise truncates and writes ./agentops.log in every process.
    os.environ.setdefault("AGENTOPS_LOGGING_TO_FILE", "False")
    try:
        return importlib.import_module("agentlightning")
    except ImportError as exc:
        raise ConfigError(
            f"AGENT names a LitAgent, which needs the agentlightning package on the worker ({exc}); "
            f"install the optional extra: {INSTALL_HINT}"
        ) from None


def _search_working_directory() -> None:
    """Let ``AGENT=my_pkg.agents:MyAgent`` resolve from the directory the worker was started in, as
    ``python -m`` would: ``celery`` does not put it on ``sys.path``. Appended, so it never shadows an
    installed package; only operator-configured paths are imported through it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def import_path(path: str) -> Any:
    """The object ``module.path:attr`` names (``attr`` may be dotted); a ConfigError naming what failed."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"expected 'module.path:attr', got {path!r}")
    _search_working_directory()
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for {path!r}: {exc}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r} ({path!r})") from None
    return target


def _instantiate(path: str, obj: Any, base: type, what: str) -> Any:
    """A class of ``base`` is built without arguments, an instance is used as is, a callable is a factory."""
    if isinstance(obj, base):
        return obj
    try:
        if isinstance(obj, type):
            if not issubclass(obj, base):
                raise ConfigError(f"{path!r} is a class but not a {what} subclass")
            return obj()
        if callable(obj):
            made = obj()
            if not isinstance(made, base):
                raise ConfigError(f"the factory {path!r} returned {type(made).__name__}, not a {what}")
            return made
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"building {what} {path!r} failed: {type(exc).__name__}: {exc}") from None
    raise ConfigError(f"{path!r} is a {type(obj).__name__}, not a {what} class, instance or factory")


def class_path(obj: Any) -> str:
    """How ``CeleryRunner`` names the trainer's agent (``bridge.core.task.message.agent_identity``)."""
    return agent_identity(obj)


@dataclass
class ConfiguredAgent:
    """The LitAgent and hooks of this process, and the names a message may use for them."""

    path: str  # AGENT as configured
    agent: Any  # agentlightning.LitAgent
    hooks: list[Any] = field(default_factory=list)  # agentlightning.Hook
    pid: int = field(default_factory=os.getpid)
    tracer_kind: str = "otel"  # AGENT_TRACER
    _own_tracer: Any = None  # agentlightning.AgentOpsTracer under AGENT_TRACER=agentops, built on first use

    def own_tracer(self) -> Any:
        """Agent Lightning's AgentOps tracer for this process (``None`` unless AGENT_TRACER=agentops).

        Built at the first attempt of the process that runs attempts, never in a prefork parent: it
        instruments the process's libraries and keeps one trace at a time (see ``check_tracer_pool``).
        """
        if self.tracer_kind != "agentops":
            return None
        if self._own_tracer is None:
            from agentlightning.tracer.agentops import AgentOpsTracer

            tracer = AgentOpsTracer()
            tracer.init_worker(self.pid)
            self._own_tracer = tracer
        return self._own_tracer

    @property
    def class_path(self) -> str:
        return class_path(self.agent)

    def accepts(self, expected: str | None) -> bool:
        """Whether a message expecting ``expected`` may run here (compared as strings, never imported)."""
        return (expected or DEFAULT_AGENT) in (self.path, self.class_path)


def build(settings: WorkerSettings) -> ConfiguredAgent:
    """Import and build ``AGENT`` and ``AGENT_HOOKS``; every problem is a ConfigError (exit code 2)."""
    agl = require_agentlightning()
    agent = _instantiate(settings.agent, import_path(settings.agent), agl.LitAgent, "LitAgent")
    hooks = [_instantiate(p, import_path(p), agl.Hook, "Hook") for p in settings.agent_hooks]
    return ConfiguredAgent(settings.agent, agent, hooks, tracer_kind=settings.agent_tracer)


ONE_TRACE_POOLS = {"prefork", "solo"}


def check_tracer_pool(settings: WorkerSettings, pool: str, concurrency: int) -> None:
    """Refuse AGENT_TRACER=agentops where one process runs several attempts at once.

    AgentOps instruments the whole process and Agent Lightning's AgentOps tracer holds one trace at a
    time, so two attempts in one process would share (and swap) their spans. Under prefork and solo a
    process runs one attempt at a time; a thread or greenlet pool is accepted only with concurrency 1.
    """
    if settings.agent == DEFAULT_AGENT or settings.agent_tracer != "agentops":
        return
    if pool not in ONE_TRACE_POOLS and concurrency > 1:
        raise ConfigError(
            f"AGENT_TRACER=agentops traces one attempt per process, but the {pool} pool runs {concurrency} "
            "attempts in one process: use -P prefork (the default), or AGENT_TRACER=otel for a threads pool"
        )


def advertised_agent(settings: WorkerSettings) -> str:
    """What this node advertises (``keys.worker_agent``): the agent's class path, or ``webshop``."""
    configured = configured_agent(settings)
    return configured.class_path if configured is not None else DEFAULT_AGENT


def configured_agent(settings: WorkerSettings) -> ConfiguredAgent | None:
    """This process's agent, built on first use (``None`` for the built-in WebShop agent).

    Rebuilt when the process id changes: a prefork child gets its own instance (clients the agent holds
    must not be shared across a fork), and every thread of a ``-P threads`` process shares one, as every
    rollout of an Agent Lightning runner process does. Held in ``workers.lifecycle.state``.
    """
    if settings.agent == DEFAULT_AGENT:
        return None
    process = state.process
    with process.agent_lock:
        configured = process.configured_agent
        if configured is None or configured.pid != os.getpid():
            configured = process.configured_agent = build(settings)
            log.info(
                "agent %s (%s) with %d hook(s), tracer %s",
                settings.agent,
                configured.class_path,
                len(configured.hooks),
                settings.agent_tracer,
            )
        return configured
