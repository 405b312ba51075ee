"""The layering the two processes rely on, read from the source with ``ast`` (nothing is imported).

Why these rules: the bridge publishes by task name and must start without the worker stack (agent, LLM
client, telemetry); workers and the dispatcher share only ``bridge.core``; the offline WebShop server and
LLM stand-in run without either. ``bridge.cli`` reaches the operator tools by name through ``importlib``,
which is the one allowed way into ``bridge.tools`` and is invisible here on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "workers", "webshop_env")

# importer prefix -> prefixes it must never import (at any level: lazy imports count too)
FORBIDDEN = {
    "bridge.core": ("bridge.dispatch", "bridge.tools", "bridge.cli", "bridge.runner", "workers"),
    "bridge.dispatch": ("workers", "bridge.tools", "bridge.runner"),
    "workers": ("bridge.dispatch", "bridge.tools", "bridge.cli", "bridge.runner"),
    # The trainer-side runner runs the dispatcher in the trainer's process: never the worker stack.
    "bridge.runner": ("workers", "bridge.tools", "bridge.cli"),
    "bridge.runner_support": ("workers", "bridge.tools", "bridge.cli"),
    "webshop_env": ("bridge", "workers"),
}
# The modules whose module-level imports must form no cycle.
ACYCLIC = ("bridge.core", "bridge.dispatch", "bridge.runner", "bridge.runner_support", "workers")


@dataclass(frozen=True)
class Import:
    target: str
    line: int
    module_level: bool  # executed on import (not inside a function, nor under ``if TYPE_CHECKING``)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


MODULES = {module_name(path): path for path in source_files()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def resolve(base: str, names: list[str]) -> Iterator[str]:
    """``from base import a, b``: each name that is a module of ours is the import, else the package."""
    for name in names:
        candidate = f"{base}.{name}"
        yield candidate if candidate in MODULES else base


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str) -> list[Import]:
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = resolve(base, [alias.name for alias in node.names])
            found.extend(Import(target, node.lineno, module_level) for target in targets)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.iter_child_nodes(node):
                visit(child, False)
            return
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, module_level)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(tree, True)
    return list(dict.fromkeys(found))  # ``from m import a, b`` of one package names it once


IMPORTS = {name: imports_of(name) for name in MODULES}


def test_the_packages_are_found() -> None:
    assert {"bridge.core.store", "bridge.dispatch.dispatcher", "workers.tasks", "webshop_env.server"} <= set(MODULES)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(importer: str) -> None:
    violations = [
        f"{name}:{imp.line} imports {imp.target}"
        for name, imports in IMPORTS.items()
        if within(name, importer)
        for imp in imports
        if any(within(imp.target, banned) for banned in FORBIDDEN[importer])
    ]
    assert not violations, f"{importer} must not import {', '.join(FORBIDDEN[importer])}:\n" + "\n".join(violations)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_core_dispatch_and_workers() -> None:
    nodes = {name for name in MODULES if any(within(name, prefix) for prefix in ACYCLIC)}
    graph = {
        name: {imp.target for imp in IMPORTS[name] if imp.module_level and imp.target in nodes and imp.target != name}
        for name in nodes
    }
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])
