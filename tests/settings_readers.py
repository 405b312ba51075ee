"""Which settings (bridge/core/settings/) each command of ours reads, read from the source (nothing is imported).

``settings_read(ENTRIES[command])``: the variables of the settings that the modules a command runs (and what they
import, lazy imports included) read as ``settings.<field>``, derived values expanded to their fields, and the
fields the settings' cross-checks read, which a process that loads the settings checks together at start. The
deployments' tests (docker-compose.yml, deploy/kubernetes) give each container what its command reads of this,
and of the secrets (``SECRET_SETTINGS``) nothing more.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bridge.core.settings import Settings, env_name
from tests.unit.test_architecture import IMPORTS, MODULES
from workers.lifecycle.steps import WORKER_STEPS

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_MODULE = "bridge.core.settings"

# A worker runs its tasks and its bootsteps (named as "module:Class" in workers.lifecycle.steps, imported by Celery).
WORKER = ("workers", "workers.tasks", "workers.v1.task", *(step.partition(":")[0] for step in WORKER_STEPS))
ENTRIES = {  # the modules each command of ours runs (with what they import)
    "bridge": ("bridge.dispatch.v03",),  # python -m bridge run
    "dispatcher-v1": ("bridge.dispatch.v1",),  # python -m bridge v1
    "worker": WORKER,
    "worker-agl-v1": WORKER,
    "flower": ("bridge.ops.flower", "workers.app"),  # Flower imports the workers' Celery app, runs no task
    "webshop": ("webshop_env.__main__",),  # python -m webshop_env serve
}
V1_WORKER = ("AGL_V1_AGENT_MODULES", "AGL_V1_PRELOAD_AGENTS")  # checked together; only a 1.0 worker starts programs
STORE_CLIENT = ("AGENT_LIGHTNING_STORE_TOKEN", "STORE_TIMEOUT_S", "STORE_RETRIES")  # what a Store request reads
AGENT_03 = (
    "AGENT", "AGENT_HOOKS", "AGENT_TRACER", "OPENAI_API_KEY", "OPENAI_API_BASE", "LLM_KEY_HOSTS", "WEBSHOP_MODEL",
    "LLM_TIMEOUT_S", "LLM_RETRIES", "LLM_MAX_BACKOFF_S", "LLM_RETURN_TOKEN_IDS", "LLM_RPM", "LLM_TPM",
    "LLM_RATE_LIMITS", "LLM_RATE_BURST_S", "TRACE_CONTENT", "SPAN_FLUSH_INTERVAL_S", "SPAN_BUFFER_MAX_SPANS",
    "SPAN_GATHER_MAX_S", "AGENT_LIGHTNING_OTLP_ENDPOINT", "MAX_INSTRUCTION_CHARS", "MAX_STUCK_AGENT_THREADS",
)  # fmt: skip
SECRET_SETTINGS = {  # settings whose value is a secret: keys, tokens, and URLs that may carry a password
    "OPENAI_API_KEY",
    "AGENT_LIGHTNING_STORE_TOKEN",
    "WEBSHOP_TOKEN",
    "AGL_V1_KEY",
    "CELERY_BROKER_URL",
    "REDIS_URL",
}


def _settings_classes() -> list[ast.ClassDef]:
    """The settings' groups and process classes, whose methods are the derived values and the cross-checks."""
    return [
        node
        for module in ("groups", "processes")
        for node in ast.parse((ROOT / f"bridge/core/settings/{module}.py").read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    ]


SETTINGS_METHODS = {
    node.name: node for cls in _settings_classes() for node in cls.body if isinstance(node, ast.FunctionDef)
}


def fields_of(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The settings fields ``settings.<name>`` reads: itself for a field, those its body reads for a derived one."""
    if name in Settings.model_fields:
        return {name}
    if name not in SETTINGS_METHODS or name in seen:
        return set()
    return {
        field
        for node in ast.walk(SETTINGS_METHODS[name])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        for field in fields_of(node.attr, seen | {name})
    }


CHECKED_TOGETHER = [
    fields_of(name)
    for name, method in SETTINGS_METHODS.items()
    if any("model_validator" in ast.unparse(decorator) for decorator in method.decorator_list)
]


def closure(entries: tuple[str, ...]) -> set[str]:
    """The modules of ours that importing ``entries`` may import (lazy imports included) and their packages."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name not in MODULES:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + [imp.target for imp in IMPORTS[name]]
    return seen


def settings_read(entries: tuple[str, ...]) -> set[str]:
    """The variables of the settings that the modules of ``entries`` read, and the cross-checked ones (none for
    modules that never load the settings)."""
    modules = closure(entries)
    if SETTINGS_MODULE not in modules:
        return set()
    fields = set().union(*CHECKED_TOGETHER)
    for module in {m for m in modules if m != SETTINGS_MODULE and not m.startswith(SETTINGS_MODULE + ".")}:
        for name in re.findall(r"settings(?:\(\))?\.([a-z_0-9]+)", MODULES[module].read_text(encoding="utf-8")):
            fields |= fields_of(name)
    return {env_name(field) for field in fields}
